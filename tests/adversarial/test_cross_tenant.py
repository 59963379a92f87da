"""Cross-tenant: another user (or another chat) guessing, enumerating or colliding into a session.

The first tests drive the installed function in-process with crafted ids; the others go through a real
Open WebUI over HTTP as a second, non-admin account.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import unicodedata

import httpx
import pytest

from tests.adversarial.attack import assert_index_matches_disk, links, published_files
from tests.support.open_webui import FUNCTION_ID, Account, OpenWebUI, Reply
from tests.support.pipe_harness import PipeHarness, code

LIST = code("import os\nprint('files:', sorted(os.listdir('/mnt/data')))", "Try /mnt/data/secret.txt")
SECRET = code("open('/mnt/data/secret.txt', 'w').write('alice only')", "Mine: /mnt/data/secret.txt")


def crafted_chat_ids(chat: str) -> list[str]:
    nfd = unicodedata.normalize("NFD", chat)
    return [
        f"../{chat}",
        f"{chat}/..",
        f"{chat}/../{chat}",
        f"./{chat}",
        chat.upper(),
        chat + "\x00",
        chat + " ",
        nfd if nfd != chat else chat + "\u0301",
        chat.replace("a", "\u0430"),  # Cyrillic а
        f"temporary:{chat}",
        f"local:{chat}",
        chat[:32] + "-other-tail",  # same readable slug, different id
        "",
    ]


@pytest.mark.runsc
async def test_other_users_and_crafted_chat_ids_never_reach_a_session(harness: PipeHarness):
    """Naive: the folder is named after the chat id alone (or a sanitised one): ids collide or climb."""
    chat = "chat-éa-" + "x" * 40
    mine = await harness.say("alice", chat, SECRET)
    assert len(links(mine.splitlines()[-1])) == 1
    copies = published_files(harness)
    attempts = [("bob", chat)] + [("bob", c) for c in crafted_chat_ids(chat)]
    attempts += [("alice", c) for c in crafted_chat_ids(chat)]  # her other chats are other folders too
    for start in range(0, len(attempts), 4):  # different chats: they may run side by side
        batch = attempts[start : start + 4]
        answers = await asyncio.gather(*(harness.say(user, chat_id, LIST) for user, chat_id in batch))
        for (user, chat_id), answer in zip(batch, answers, strict=True):
            assert "files: []" in answer, (user, chat_id)
            assert links(answer) == [], (user, chat_id)
    assert published_files(harness) == copies
    folders = harness.sessions_root / "sessions"
    assert len([c for u in folders.iterdir() for c in u.iterdir()]) == 1 + len(attempts)
    await assert_index_matches_disk(harness)


@pytest.mark.runsc
async def test_temporary_chats_are_private_to_their_user(harness: PipeHarness):
    """Naive: temporary chats have no id, so every user's temporary chat shares one folder."""
    for chat_id in ("", "local:abc", "temporary:abc"):
        await harness.say("alice", chat_id, SECRET)
        answer = await harness.say("bob", chat_id, LIST)
        assert "files: []" in answer and links(answer) == []
    sessions = await harness.pipe._services.store.sessions()
    assert {s.temporary for s in sessions} == {True}


# ---- through a real Open WebUI, as a second user -------------------------------------------------------


@pytest.fixture(scope="module")
def alice_link(open_webui: OpenWebUI) -> tuple[Reply, str]:
    reply = open_webui.admin.say(
        "```python\nopen('/mnt/data/secret.txt', 'w').write('admin only')\n```\nreply: /mnt/data/secret.txt"
    )
    return reply, reply.links()[-1]


@pytest.mark.e2e
@pytest.mark.runsc
def test_second_user_cannot_list_guess_or_climb_to_links(open_webui: OpenWebUI, alice_link):
    """Naive: the publish folder is listable, tokens are short, or /cache/.. reaches DATA_DIR or the index."""
    _reply, link = alice_link
    bob: Account = open_webui.accounts["bob"]
    token = link.split("/")[-2]
    prefix = f"/cache/functions/{FUNCTION_ID}/"
    probes = [
        prefix,
        prefix + token,
        prefix + token + "/",
        re.sub(r"/[A-Za-z0-9_-]{32}/", f"/{secrets.token_urlsafe(24)}/", link),
        re.sub(r"/[A-Za-z0-9_-]{32}/", f"/{token[:-1]}A/", link),
        "/cache/%2e%2e/webui.db",
        "/cache/..%2fwebui.db",
        prefix + "%2e%2e/%2e%2e/%2e%2e/webui.db",
        prefix + "%2e%2e/%2e%2e/%2e%2e/code_sessions/index.sqlite3",
    ]
    for path in probes:
        response = httpx.get(open_webui.url + path, headers=bob.headers, timeout=30)
        assert response.status_code == 404, (path, response.status_code)
        assert b"admin only" not in response.content and b"SQLite format" not in response.content
    # Without a login nothing is served at all.
    anonymous = httpx.get(open_webui.url + link, timeout=30)
    assert anonymous.status_code in (401, 403)
    assert len(token) == 32  # 192 random bits


@pytest.mark.e2e
@pytest.mark.runsc
def test_second_user_cannot_use_the_first_users_chat_or_upload(open_webui: OpenWebUI, alice_link):
    """Naive: passing another user's chat id or file id in the request reaches their folder or file."""
    reply, _link = alice_link
    bob: Account = open_webui.accounts["bob"]
    payload = {
        "model": f"{FUNCTION_ID}.demo-scripted",
        "messages": [{"role": "user", "content": LIST}],
        "stream": False,
        "chat_id": reply.chat_id,
    }
    response = bob.post("/api/chat/completions", payload)
    assert response.status_code != 200 or "files: []" in response.text
    assert "secret.txt'" not in response.text and "admin only" not in response.text
    upload = open_webui.admin.upload("private.csv", b"admin,upload\n")
    theirs = bob.say(LIST, files=[upload])
    assert "files: []" in theirs.content and "private.csv" not in theirs.content
    # Nor can bob change the function's valves (e.g. a purge of everyone's files).
    valves = f"/api/v1/functions/id/{FUNCTION_ID}/valves"
    assert bob.get(valves).status_code in (401, 403)
    assert bob.post(valves + "/update", {"purge": "all"}).status_code in (401, 403)


@pytest.mark.e2e
@pytest.mark.runsc
def test_a_leaked_link_is_readable_by_any_logged_in_user(open_webui: OpenWebUI, alice_link):
    """Documented limit (docs/security.md): Open WebUI's /cache route checks login, not ownership."""
    _reply, link = alice_link
    bob: Account = open_webui.accounts["bob"]
    assert bob.download(link).content == b"admin only"
