"""The buttons under an answer (dist/code_sessions_actions.py) through a real Open WebUI 0.12.4, the way its
page calls them (`POST /api/chat/actions/<function>.<button>` with the chat, the answer and the page's
socket): they work for the chat's owner and do nothing for anyone else, whatever the body claims. The
browser walk of the same buttons is tests/e2e/test_newcomer.py's."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from demo import launcher
from storage._keys import id_key
from tests.support.notebooks import validated
from tests.support.open_webui import MODEL, Account, OpenWebUI, Reply

pytestmark = [pytest.mark.e2e, pytest.mark.runsc]

ACTION = launcher.ACTIONS_ID


def run(source: str, reply: str = "") -> str:
    return f"```python\n{source}\n```\n" + (f"reply: {reply}" if reply else "")


@pytest.fixture(scope="module")
def actions(open_webui: OpenWebUI) -> Iterator[OpenWebUI]:
    open_webui.admin_http.install_actions([MODEL])
    yield open_webui
    # The server is the session's: the other modules' pages show no buttons of ours.
    response = open_webui.admin.delete(f"/api/v1/functions/id/{ACTION}/delete")
    assert response.status_code == 200, response.text


def press(account: Account, button: str, reply: Reply, **body) -> dict:
    """A button pressed as the page presses it: the model, the chat, the answer, the page's socket."""
    payload = {
        "model": MODEL,
        "messages": [],
        "chat_id": reply.chat_id,
        "id": reply.message_id,
        "session_id": f"page-{uuid.uuid4().hex[:8]}",
        **body,
    }
    response = account.post(f"/api/chat/actions/{ACTION}.{button}", payload)
    return {"status": response.status_code, "body": response.json() if response.content else None}


def pressed(account: Account, button: str, reply: Reply, **body) -> dict:
    """What a button said to its owner (it answered 200)."""
    result = press(account, button, reply, **body)
    assert result["status"] == 200 and result["body"] and "code_sessions" in result["body"], result
    return result["body"]["code_sessions"]


def test_the_owner_gets_the_files_a_notebook_and_a_zip(actions: OpenWebUI) -> None:
    bob = actions.accounts["bob"]
    first = bob.say(run("open('/mnt/data/notes.txt', 'w').write('n')\nx = 41"))
    second = bob.say(run("x += 1\nprint(x)", "The answer is in /mnt/data/notes.txt"), previous=first)
    said = pressed(bob, "files", second)
    assert said["title"] == "Files of this chat", said
    assert "1 file," in said["text"] and "`/mnt/data/notes.txt` · 1 B" in said["text"], said
    assert "[download](/api/v1/files/code-sessions-" in said["text"], said
    notebook = pressed(bob, "notebook", second)
    assert notebook["level"] == "success" and "2 runs" in notebook["text"], notebook
    message = bob.get(f"/api/v1/chats/{second.chat_id}").json()["chat"]["history"]["messages"][
        second.message_id
    ]
    [item] = [f for f in message["files"] if f["name"].endswith(".ipynb")]
    cells = validated(bob.get(item["url"]).content)["cells"]
    assert [c["source"] for c in cells if c["cell_type"] == "code"][-1].strip() == "x += 1\nprint(x)"
    # Pressed again: the same notebook, the same attachment (one chip).
    again = pressed(bob, "notebook", second)
    assert again["level"] == "success" and "2 runs" in again["text"], again
    message = bob.get(f"/api/v1/chats/{second.chat_id}").json()["chat"]["history"]["messages"][
        second.message_id
    ]
    assert [f["id"] for f in message["files"] if f["name"].endswith(".ipynb")] == [item["id"]]
    zipped = pressed(bob, "zip", second)
    assert "1 file, 1 B" in zipped["text"], zipped
    # Open WebUI calls every button when an answer is regenerated: nothing happens then.
    assert press(bob, "zip", second, event={"id": "regenerate-response"})["body"] is None


def test_no_one_else_gets_anything_from_them(actions: OpenWebUI) -> None:
    admin, bob = actions.admin, actions.accounts["bob"]
    answer = bob.say(run("open('/mnt/data/private.txt', 'w').write('p')"))
    # Another user: Open WebUI's route refuses the chat.
    other = actions.account(f"carol-{uuid.uuid4().hex[:6]}@example.com", "Carol-Passw0rd", admin=False)
    refused = press(other, "files", answer)
    assert refused["status"] == 404 and "private.txt" not in str(refused["body"]), refused
    # An admin passes Open WebUI's route (admins may read every chat): ours says no, and opens nothing.
    for button in ("files", "zip", "notebook", "knowledge"):
        said = press(admin, button, answer)
        assert said["status"] == 200 and said["body"]["code_sessions"]["text"] == (
            "These buttons work in your own chats only."
        ), said
    assert not (actions.sessions_root / "sessions" / id_key(admin.user_id) / id_key(answer.chat_id)).exists()
