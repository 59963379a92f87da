"""The chat's files and Python state through a real Open WebUI 0.12.4, whatever shape the requests have:

* an API caller (`POST /api/chat/completions` with `chat_id` and the answer's `id`, the history in
  `messages`, and no `parent_id` or `user_message`: Open WebUI files each answer with no parent) keeps
  its files and variables at every turn, also with half the web UI's fields, also for a regenerate
  through the API, and four such chats at once each keep their own;
* a file uploaded through a link stays on the branch of the answer that offered the link: answer 1
  writes a.txt, answer 2 offers a link and a file is POSTed to it, the user regenerates answer 1, then
  continues under answer 2 and finds the file (driven the web UI's way: streamed, with a session_id).

Shares the session's Open WebUI (`open_webui`)."""

from __future__ import annotations

import re
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.branch_cells import RESTORED
from tests.support.open_webui import MODEL, Account, OpenWebUI, TreeChat

pytestmark = [pytest.mark.e2e, pytest.mark.runsc]

STARTED_AGAIN = "Started again from an empty /mnt/data"
UPLOAD_LINK = re.compile(r"https?://\S+/code-sessions/upload/[A-Za-z0-9_-]{43}")


def run(source: str, reply: str = "") -> str:
    return f"```python\n{source}\n```\n" + (f"reply: {reply}" if reply else "")


class ApiChat:
    """A chat driven the way scripts and integrations call Open WebUI: a saved chat, then each turn a
    completion naming the chat and the answer's id, with the history in `messages`."""

    def __init__(self, account: Account) -> None:
        self.account = account
        created = account.post("/api/v1/chats/new", {"chat": {}})
        assert created.status_code == 200, created.text
        self.chat_id = created.json()["id"]
        self.history: list[dict] = []

    def send(self, text: str, *, extra: dict | None = None, history: list[dict] | None = None) -> str:
        """One turn (its answer kept in the history unless `history` is given: a regenerate)."""
        earlier = self.history if history is None else history
        payload = {
            "model": MODEL,
            "messages": [*earlier, {"role": "user", "content": text}],
            "chat_id": self.chat_id,
            "id": str(uuid.uuid4()),
            "stream": False,
            **(extra or {}),
        }
        response = self.account.post("/api/chat/completions", payload)
        assert response.status_code == 200, response.text
        content = response.json()["choices"][0]["message"]["content"]
        if history is None:
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": content}]
        return content


def test_an_api_callers_chat_keeps_its_files_and_variables_across_turns(open_webui: OpenWebUI) -> None:
    chat = ApiChat(open_webui.admin)
    first = chat.send(run("open('/mnt/data/a.txt', 'w').write('kept')\nx = 41", "ok"))
    assert "ok" in first, first
    second = chat.send(run("print(open('/mnt/data/a.txt').read(), x + 1)"))
    assert "kept 42" in second and STARTED_AGAIN not in second, second
    # A regenerate through the API: nothing says which answer it replaces, so the newest state goes on.
    again = chat.send(run("print(open('/mnt/data/a.txt').read(), x + 1)"), history=chat.history[:2])
    assert "kept 42" in again and STARTED_AGAIN not in again, again
    # Half the web UI's fields: parent_id alone (Open WebUI drops it), or a user message without parentId.
    half = chat.send(run("x += 1\nprint(open('/mnt/data/a.txt').read(), x)"), extra={"parent_id": None})
    assert "kept 42" in half and STARTED_AGAIN not in half, half
    text = run("print(open('/mnt/data/a.txt').read(), x + 1)")
    user_message = {"id": str(uuid.uuid4()), "role": "user", "content": text}
    other = chat.send(text, extra={"user_message": user_message})
    assert "kept 43" in other and STARTED_AGAIN not in other, other


def test_four_api_callers_chats_at_once_each_keep_theirs(open_webui: OpenWebUI) -> None:
    def converse(n: int) -> tuple[str, str]:
        chat = ApiChat(open_webui.admin)
        chat.send(run(f"open('/mnt/data/mine.txt', 'w').write('chat {n}')\nmine = {n}", "ok"))
        return f"chat {n} {n}", chat.send(run("print(open('/mnt/data/mine.txt').read(), mine)"))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(converse, range(4)))
    for expected, said in results:
        assert expected in said and STARTED_AGAIN not in said, said


# ---- an upload link's file and the conversation's branches, the web UI's way --------------------------


LIST = "import os\nprint(sorted(os.listdir('/mnt/data')))"


def test_a_file_uploaded_through_a_link_stays_on_the_branch_of_the_answer_that_offered_it(
    open_webui: OpenWebUI,
) -> None:
    chat = TreeChat(open_webui.admin, streamed=True)
    first, said = chat.send(
        run(LIST + "\nopen('/mnt/data/a.txt', 'w').write('1')\nkept = 'kept-' + 'variable'", "ok"),
        parent=None,
    )
    assert "ok" in said, said
    second, offered = chat.send('call: upload_link {"path": "/mnt/data/up.bin"}', parent=first)
    link = UPLOAD_LINK.search(offered)
    assert link, offered
    upload = {"file": ("up.bin", b"uploaded", "application/octet-stream")}
    done = httpx.post(link.group(), files=upload, timeout=60)
    assert done.status_code == 201, done.text
    # The user regenerates answer 1: it starts again from the empty folder, without the upload.
    _, regenerated = chat.send("", parent=None, again=chat.parents[first])
    assert "[]" in regenerated and STARTED_AGAIN in regenerated, regenerated
    # Then continues under answer 2: its files, with the upload, and its Python state.
    _, back = chat.send(run(LIST + "\nprint(open('/mnt/data/up.bin').read())\nprint(kept)"), parent=second)
    assert "['a.txt', 'up.bin']" in back and "uploaded" in back and "kept-variable" in back, back
    assert RESTORED in back
