"""Cross-tenant: another user (or another chat) guessing, enumerating or colliding into a session.

The first tests drive the installed function in-process with crafted ids; the others go through a real
Open WebUI over HTTP as a second, non-admin account.
"""

from __future__ import annotations

import asyncio
import http.client
import unicodedata
import uuid
from urllib.parse import urlsplit

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

SECRET_LINE = "```python\nopen('/mnt/data/secret.txt', 'w').write('{text}')\n```\nreply: /mnt/data/secret.txt"


def raw_get(server: OpenWebUI, path: str, account: Account | None = None) -> tuple[int, bytes]:
    """GET the path exactly as written: httpx would resolve `..` segments before sending them."""
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.request("GET", path, headers=account.headers if account else {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def file_id(link: str) -> str:
    return link.split("/")[4]


@pytest.fixture(scope="module")
def admin_link(open_webui: OpenWebUI) -> tuple[Reply, str]:
    reply = open_webui.admin.say(SECRET_LINE.format(text="admin only"))
    return reply, reply.links()[-1]


@pytest.fixture(scope="module")
def carol(open_webui: OpenWebUI) -> Account:
    """A third, ordinary user (the module's own, so other modules' accounts stay as they are)."""
    return open_webui.account(f"carol-{uuid.uuid4().hex[:8]}@example.com", "Carol-Passw0rd", admin=False)


@pytest.mark.e2e
@pytest.mark.runsc
def test_second_user_cannot_list_guess_or_climb_to_links(open_webui: OpenWebUI, admin_link):
    """Naive: links anyone logged in can open (the old /cache route), short or sequential ids, a Files
    API that lists or searches other users' files, or a path that climbs out of a route to the bytes."""
    reply, link = admin_link
    bob: Account = open_webui.accounts["bob"]
    real = file_id(link)
    assert link == f"/api/v1/files/{real}/content"
    assert bob.download(link).status_code == 404  # the owner's link itself: not bob's to open

    # Every route of the real file, and ids an attacker would try next to it.
    routes = ["", "/content", "/content/html", "/content/secret.txt", "/content?attachment=true"]
    routes += ["/data/content", "/process/status"]
    ids = [real, real.upper(), real[:-1], real[:-1] + ("0" if real[-1] != "0" else "1"), real + "%00"]
    ids += [f"code-sessions-{uuid.uuid4()}", "code-sessions-", "code-sessions-%25", str(uuid.uuid4())]
    for guess in ids:
        for route in routes:
            path = f"/api/v1/files/{guess}{route}"
            status, body = raw_get(open_webui, path, bob)
            assert status == 404, (path, status, body[:200])
            assert b"admin only" not in body
    # Nor is it listed or found by name.
    assert [f for f in bob.get("/api/v1/files/").json()["items"] if f["id"] == real] == []
    for pattern in ("*", "secret*", "*.txt"):
        found = bob.get("/api/v1/files/search", params={"filename": pattern})
        assert found.status_code == 404 or all(f["id"] != real for f in found.json()), found.text
    assert bob.get(f"/api/v1/chats/{reply.chat_id}").status_code in (401, 403, 404)

    # Paths that climb out of a route match no route at all: Open WebUI answers with its web app's page
    # (the same page for any unknown path, to anyone), never the file, the uploads or the database.
    _, app_page = raw_get(open_webui, "/no-such-page")
    tricks = [
        "/api/v1/files/..%2f..",
        "/api/v1/files/..%2f..%2fwebui.db",
        "/api/v1/files/%2e%2e/%2e%2e/webui.db",
        f"/api/v1/files/{real}/content/../../..",
        f"/api/v1/files/{real}/content/..%2f..%2f..%2fwebui.db",
        f"/api/v1/files/{real}/../{real}/content",
        f"/api/v1/files/..%2fuploads%2f{real}.bin/content",
        "/api/v1/files/%2e%2e%2f%2e%2e%2fwebui.db/content",
        "/api/v1/files/../../../webui.db",
        "/cache/functions/code_sessions/",
        "/cache/..%2fwebui.db",
        "/cache/..%2fuploads%2f" + real + ".bin",
        "/cache/..%2fcode_sessions%2findex.sqlite3",
    ]
    for path in tricks:
        status, body = raw_get(open_webui, path, bob)
        assert status == 404 or (status == 200 and body == app_page), (path, status, body[:200])
        assert b"admin only" not in body and b"SQLite format" not in body
    # Nothing of ours lies in the cache Open WebUI serves to every logged-in user (the old links).
    cache = open_webui.data_dir / "cache"
    assert not [p for p in cache.rglob("*") if p.is_file() and b"admin only" in p.read_bytes()]

    # Without a login nothing is served at all.
    for route in ("/content", "/content/html", ""):
        assert httpx.get(f"{open_webui.url}/api/v1/files/{real}{route}", timeout=30).status_code == 401
    # The id: our prefix and a random (version 4) uuid, whose 122 random bits are all that guards it.
    assert real.startswith("code-sessions-")
    assert uuid.UUID(real.removeprefix("code-sessions-")).version == 4


@pytest.mark.e2e
@pytest.mark.runsc
def test_second_user_cannot_use_the_first_users_chat_or_upload(open_webui: OpenWebUI, admin_link):
    """Naive: passing another user's chat id or file id in the request reaches their folder or file."""
    reply, _link = admin_link
    bob: Account = open_webui.accounts["bob"]
    payload = {
        "model": f"{FUNCTION_ID}.demo-scripted",
        "messages": [{"role": "user", "content": LIST}],
        "stream": False,
        "chat_id": reply.chat_id,
    }
    response = bob.post("/api/chat/completions", payload)
    # Open WebUI refuses a chat id of another user before the function is called.
    assert response.status_code == 404, (response.status_code, response.text[:300])
    assert "secret.txt" not in response.text and "admin only" not in response.text
    upload = open_webui.admin.upload("private.csv", b"admin,upload\n")
    theirs = bob.say(LIST, files=[upload])
    assert "files: []" in theirs.content and "private.csv" not in theirs.content
    # Nor can bob change the function's valves (e.g. a purge of everyone's files).
    valves = f"/api/v1/functions/id/{FUNCTION_ID}/valves"
    assert bob.get(valves).status_code in (401, 403)
    assert bob.post(valves + "/update", {"purge": "all"}).status_code in (401, 403)


@pytest.mark.e2e
@pytest.mark.runsc
def test_a_leaked_link_opens_only_for_its_owner_admins_and_those_the_chat_is_shared_with(
    open_webui: OpenWebUI, carol: Account
):
    """Naive: the link is the only secret (the old /cache links opened for anyone logged in who had it),
    or sharing the chat does not reach its files, or unsharing leaves them readable."""
    bob: Account = open_webui.accounts["bob"]
    reply = bob.say(SECRET_LINE.format(text="bob only"))
    link = reply.links()[-1]
    assert bob.download(link).content == b"bob only"
    # Leaked to carol, another ordinary user who is logged in: nothing, on any route.
    for route in ("", "/html", "/secret.txt", "?attachment=true"):
        assert carol.download(link + route).status_code == 404, route
    # An admin can read every user's files in Open WebUI, these too.
    assert open_webui.admin.download(link).content == b"bob only"

    # Bob shares the chat with carol: the answer's file comes with it (its chat_file row), then goes.
    chat = f"/api/v1/chats/{reply.chat_id}"
    assert bob.post(chat + "/share").status_code == 200
    assert carol.download(link).status_code == 404  # a share link alone grants no one
    grant = [{"principal_type": "user", "principal_id": carol.user_id, "permission": "read"}]
    shared = bob.post(f"/api/v1/chats/shared/{reply.chat_id}/access/update", {"access_grants": grant})
    assert shared.status_code == 200, shared.text
    assert carol.download(link).content == b"bob only"
    assert httpx.delete(open_webui.url + chat + "/share", headers=bob.headers, timeout=60).status_code == 200
    assert carol.download(link).status_code == 404
