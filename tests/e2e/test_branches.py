"""Branches of a conversation through a real Open WebUI 0.12.4 (HTTP only, the requests the web UI
sends): a regenerated answer continues from the files and Python state of the message before it, going
back to the first branch continues that one's, and another chat is untouched. A clone (Open WebUI's
fork, clone, and clone of a shared chat) starts from its source's state at the message it was cloned at."""

from __future__ import annotations

import uuid

import pytest

from tests.support.branch_cells import HALVE, LOAD, LOOK, ONE, OWN_CLONE, RESTORED, SHARED_CLONE
from tests.support.open_webui import MODEL, Account, OpenWebUI, Reply, TreeChat, say_streamed

pytestmark = [pytest.mark.e2e, pytest.mark.runsc]


def run(source: str) -> str:
    return f"```python\n{source}\n```\n"


def api_caller_says(account: Account, chat_id: str, text: str) -> str:
    """A message to the chat the way an API caller sends one (its chat id and a new answer's id, no
    history): the answer's text."""
    payload = {
        "model": MODEL,
        "chat_id": chat_id,
        "id": f"a-{uuid.uuid4()}",
        "stream": False,
        "messages": [{"role": "user", "content": text}],
    }
    response = account.post("/api/chat/completions", payload)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_a_regenerated_or_edited_answer_and_the_first_branch_each_continue_from_their_own_state(
    open_webui: OpenWebUI,
) -> None:
    chat = TreeChat(open_webui.admin)
    first, said = chat.send(run(LOAD), parent=None)
    assert "rows 10" in said, said
    second, said = chat.send(run(HALVE), parent=first)
    assert "rows 5" in said, said
    # Regenerate turn 2: Open WebUI sends the same user message again. It halves turn 1's ten rows
    # (halving the five it had left would give 2).
    _, said = chat.send("", parent=None, again=chat.user_of(second))
    assert "rows 5" in said, said
    assert RESTORED in said
    # Edit turn 2 into another instruction: a new user message under turn 1.
    _, said = chat.send(run(LOOK), parent=first)
    assert "df 10 file 10" in said, said
    # The first branch of turn 2, continued: its halved file and frame.
    _, said = chat.send(run(LOOK), parent=second)
    assert "df 5 file 5" in said, said
    assert RESTORED in said
    # Another chat of the same user is untouched by all of it.
    other = TreeChat(open_webui.admin)
    look = "import os\nprint(sorted(os.listdir('/mnt/data')), 'df' in globals())"
    _, said = other.send(run(look), parent=None)
    assert "[] False" in said, said
    assert RESTORED not in said


# ---- clones (issue 35) ---------------------------------------------------------------------------------

SEE = (
    "import os\n"
    "print('df', len(df) if 'df' in globals() else None, 'file', len(pd.read_csv('/mnt/data/data.csv'))"
    " if os.path.exists('/mnt/data/data.csv') else None, sorted(os.listdir('/mnt/data')))"
)
IMPORT = "import pandas as pd\n"


def test_a_clone_starts_from_its_source_and_neither_side_reaches_the_other(open_webui: OpenWebUI) -> None:
    """Through a real Open WebUI: the owner forks a chat at its second answer (the web UI's request,
    streamed), a user the chat is shared with clones it (an API caller's request), another forges a
    clone's JSON. The owner's fork has that answer's files and variables; the reader's the files and not
    the variables; the forger nothing; and no run of either clone changes the source."""
    admin, bob = open_webui.admin, open_webui.accounts["bob"]
    chat = TreeChat(admin)
    first, said = chat.send(run(LOAD), parent=None)
    second, said = chat.send(run(HALVE), parent=first)
    assert "rows 5" in said, said
    # Shared with bob now (a snapshot up to the second answer), then the source goes on.
    share = admin.post(f"/api/v1/chats/{chat.chat_id}/share")
    assert share.status_code == 200, share.text
    grant = {"access_grants": [{"principal_type": "user", "principal_id": bob.user_id, "permission": "read"}]}
    assert admin.post(f"/api/v1/chats/shared/{chat.chat_id}/access/update", grant).status_code == 200
    third, said = chat.send(run(ONE), parent=second)
    assert "rows 1" in said, said

    # The owner forks at the second answer and goes on in the fork as the web UI does.
    fork = admin.post(f"/api/v1/chats/{chat.chat_id}/fork", {"message_id": second})
    assert fork.status_code == 200, fork.text
    fork_id = fork.json()["id"]
    assert fork.json()["chat"]["originalChatId"] == chat.chat_id
    at_second = Reply(fork_id, second, "", [])
    seen = say_streamed(admin, run(IMPORT + SEE), at_second)
    assert "df 5 file 5 ['data.csv']" in seen.content, seen.content
    assert seen.content.count(OWN_CLONE) == 1, seen.content
    changed = say_streamed(
        admin,
        run("df.iloc[:3].to_csv('/mnt/data/data.csv', index=False)\nopen('/mnt/data/fork.txt', 'w')"),
        seen,
    )
    assert "Python finished" in changed.content, changed.content

    # bob clones the shared snapshot (its branch point: the second answer) and writes as an API caller.
    clone = bob.post(f"/api/v1/chats/{share.json()['share_id']}/clone/shared")
    assert clone.status_code == 200, clone.text
    clone_id = clone.json()["id"]
    said = api_caller_says(bob, clone_id, run(IMPORT + SEE))
    assert "df None file 5 ['data.csv']" in said, said
    assert said.count(SHARED_CLONE) == 1 and "not its Python state" in said, said
    api_caller_says(bob, clone_id, run("open('/mnt/data/data.csv', 'w').write('n\\n7\\n')"))

    # A chat whose JSON claims to clone a chat bob may not read: nothing comes, nothing is said.
    secret = TreeChat(admin)
    secret_answer, _ = secret.send(run("open('/mnt/data/secret.txt', 'w').write('s')"), parent=None)
    forged = bob.post(
        "/api/v1/chats/new",
        {
            "chat": {
                "title": "forged",
                "originalChatId": secret.chat_id,
                "branchPointMessageId": secret_answer,
                "history": {"messages": {}, "currentId": None},
                "messages": [],
            }
        },
    )
    assert forged.status_code == 200, forged.text
    said = api_caller_says(bob, forged.json()["id"], run("import os\nprint('seen', sorted(os.listdir('.')))"))
    assert "seen []" in said, said
    assert "clone" not in said.lower(), said

    # The source's third answer, continued: its own file and frame, untouched by both clones.
    _, said = chat.send(run(SEE), parent=third)
    assert "df 1 file 1 ['data.csv']" in said, said
