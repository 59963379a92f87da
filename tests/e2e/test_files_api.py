"""Links through Open WebUI's Files API, as its users meet them: who can open a link, the attachment
chips on the message, a shared chat, and what deleting a chat or a user (or expiry) leaves behind.

A real Open WebUI 0.12.4, the bundled function installed as an admin would, the scripted model, real
gVisor. Accounts: the admin, bob and carol (ordinary users), and dave (deleted by the admin here).
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import httpx
import pytest

from storage._keys import id_key
from tests.support.open_webui import LINK, MODEL, Account, OpenWebUI, Reply

pytestmark = [pytest.mark.e2e, pytest.mark.runsc]


def run(code: str, reply: str = "") -> str:
    return f"```python\n{code}\n```\n" + (f"reply: {reply}" if reply else "")


def file_id(link: str) -> str:
    return link.split("/")[4]


def folder(server: OpenWebUI, user_id: str, chat_id: str) -> Path:
    return server.sessions_root / "sessions" / id_key(user_id) / id_key(chat_id)


@pytest.fixture(scope="module")
def carol(open_webui: OpenWebUI) -> Account:
    if "carol" not in open_webui.accounts:
        open_webui.accounts["carol"] = open_webui.account("carol@example.com", "Carol-Passw0rd", admin=False)
    return open_webui.accounts["carol"]


@pytest.fixture(scope="module")
def bobs_report(open_webui: OpenWebUI) -> Reply:
    bob = open_webui.accounts["bob"]
    # Two files; the answer names one: the other is only the message's attachment.
    write = "open('/mnt/data/bob.csv', 'w').write('bob,1\\n')\nopen('/mnt/data/notes.txt', 'w').write('n')"
    return bob.say(run(write, "Bob's file: /mnt/data/bob.csv"))


def attached(account: Account, reply: Reply) -> dict[str, dict]:
    """The message's attachments that code-sessions made, by name."""
    chat = account.get(f"/api/v1/chats/{reply.chat_id}").json()
    files = chat["chat"]["history"]["messages"][reply.message_id].get("files") or []
    return {f["name"]: f for f in files if str(f.get("id", "")).startswith("code-sessions-")}


def test_the_owner_and_an_admin_open_a_link_and_nobody_else(open_webui: OpenWebUI, bobs_report: Reply, carol):
    [link] = set(LINK.findall(bobs_report.content))
    bob = open_webui.accounts["bob"]
    assert bob.download(link).content == b"bob,1\n"
    assert open_webui.admin.download(link).content == b"bob,1\n"
    assert carol.download(link).status_code == 404
    assert httpx.get(open_webui.url + link, timeout=30).status_code == 401  # no login at all


def test_each_file_is_an_attachment_of_the_message_once(open_webui: OpenWebUI, bobs_report: Reply):
    bob = open_webui.accounts["bob"]
    files = attached(bob, bobs_report)
    assert sorted(files) == ["bob.csv", "notes.txt"]
    item, unnamed = files["bob.csv"], files["notes.txt"]
    assert item["type"] == "file" and item["url"] == f"/api/v1/files/{item['id']}/content"
    assert LINK.findall(bobs_report.content) == [item["url"]]  # linked once, where the reply names it
    assert bob.download(item["url"]).content == b"bob,1\n"
    # The file the reply did not name is not in the text, and reaches bob as an attachment.
    assert "notes.txt" not in bobs_report.content.split("</details>")[-1]
    assert bob.download(unnamed["url"]).content == b"n"


def test_a_shared_chat_lets_the_user_it_is_shared_with_open_its_files(
    open_webui: OpenWebUI, bobs_report: Reply, carol: Account
) -> None:
    bob = open_webui.accounts["bob"]
    [link] = set(LINK.findall(bobs_report.content))
    assert carol.download(link).status_code == 404
    assert bob.post(f"/api/v1/chats/{bobs_report.chat_id}/share").status_code == 200
    assert carol.download(link).status_code == 404  # a share link alone grants nothing
    grant = {
        "access_grants": [{"principal_type": "user", "principal_id": carol.user_id, "permission": "read"}],
        "share_mode": None,
    }
    response = bob.post(f"/api/v1/chats/shared/{bobs_report.chat_id}/access/update", grant)
    assert response.status_code == 200, response.text
    assert carol.download(link).content == b"bob,1\n"
    assert carol.download(attached(bob, bobs_report)["notes.txt"]["url"]).content == b"n"  # not named, too
    assert open_webui.accounts["admin"].download(link).status_code == 200


def test_an_image_is_stored_as_an_image_and_a_page_as_a_download(open_webui: OpenWebUI):
    """Only passive images keep their type; an admin's HTML never comes back as HTML (Open WebUI serves
    admin-owned files inline at /content/html, guessing the type from the stored name)."""
    admin = open_webui.admin
    page = "<html><script>document.title='ran'</script></html>"
    reply = admin.say(run(f"open('/mnt/data/page.html', 'w').write({page!r})", "Page: /mnt/data/page.html"))
    [link] = set(LINK.findall(reply.content))
    for route in ("", "/page.html", "/html"):  # every route that serves a file's bytes
        response = admin.download(link + route)
        assert response.status_code == 200, (route, response.status_code)
        assert response.headers["content-type"] == "application/octet-stream", (route, response.headers)
        assert response.content == page.encode()
    assert admin.download(link).headers["content-disposition"].startswith("attachment")
    # A figure left open is saved and shown inline, and keeps its own type.
    drawn = admin.say(run("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])"))
    [image] = re.findall(r"!\[figure-\d+\.png\]\((/api/v1/files/[^)]+/content)\)", drawn.content)
    shown = admin.download(image)
    assert shown.status_code == 200 and shown.headers["content-type"] == "image/png", shown.headers
    assert shown.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_deleted_chats_and_users_and_expired_chats_take_their_files_within_minutes(
    open_webui: OpenWebUI,
) -> None:
    admin = open_webui.admin
    bob = open_webui.accounts["bob"]
    dave = open_webui.account(f"dave-{uuid.uuid4().hex[:6]}@example.com", "Dave-Passw0rd", admin=False)
    open_webui.set_valves(cleanup_interval_minutes=1, temporary_idle_minutes=1)
    try:
        doomed = bob.say(run("open('/mnt/data/doomed.txt', 'w').write('d')", "Doomed: /mnt/data/doomed.txt"))
        kept = bob.say(run("open('/mnt/data/kept.txt', 'w').write('k')", "Kept: /mnt/data/kept.txt"))
        daves = dave.say(run("open('/mnt/data/dave.txt', 'w').write('v')", "Dave's: /mnt/data/dave.txt"))
        temporary = _temporary_chat(
            open_webui, bob, run("open('/mnt/data/t.txt', 'w').write('t')", "T: /mnt/data/t.txt")
        )
        gone_links = [set(LINK.findall(r)).pop() for r in (doomed.content, daves.content, temporary)]
        kept_link = set(LINK.findall(kept.content)).pop()
        folders = [
            folder(open_webui, bob.user_id, doomed.chat_id),
            folder(open_webui, dave.user_id, daves.chat_id),
        ]
        assert all(f.is_dir() for f in folders)
        assert bob.delete(f"/api/v1/chats/{doomed.chat_id}").status_code == 200
        assert admin.delete(f"/api/v1/users/{dave.user_id}").status_code == 200
        started = time.monotonic()
        while time.monotonic() - started < 180:
            records = [admin.get(f"/api/v1/files/{file_id(link)}").status_code for link in gone_links]
            if all(code == 404 for code in records) and not any(f.exists() for f in folders):
                break
            time.sleep(5)
        took = time.monotonic() - started
        assert [admin.get(f"/api/v1/files/{file_id(link)}").status_code for link in gone_links] == [404] * 3
        assert not any(f.exists() for f in folders), f"folders still there after {took:.0f} s"
        uploads = open_webui.data_dir / "uploads"
        assert not [p for p in uploads.iterdir() if any(file_id(link) in p.name for link in gone_links)]
        assert bob.download(kept_link).content == b"k"  # another chat's link still works
        print(f"deleted chats, a deleted user and an expired temporary chat: gone within {took:.0f} s")
    finally:
        open_webui.set_valves(cleanup_interval_minutes=30, temporary_idle_minutes=60)


def test_a_link_whose_stored_bytes_were_lost_is_dropped_and_the_next_answer_links_afresh(
    open_webui: OpenWebUI,
) -> None:
    """Open WebUI's copy of a file lost its bytes (its uploads folder was cleaned, a disk replaced): the
    periodic cleanup asks Open WebUI which copies are gone, drops their links, and the next answer that
    names the file publishes it again, so the user never gets a dead link twice."""
    bob = open_webui.accounts["bob"]
    first = bob.say(run("open('/mnt/data/lost.txt', 'w').write('kept')", "Lost: /mnt/data/lost.txt"))
    [lost] = set(LINK.findall(first.content))
    uploads = open_webui.data_dir / "uploads"
    [stored] = [p for p in uploads.iterdir() if file_id(lost) in p.name]
    stored.unlink()
    assert bob.download(lost).status_code != 200
    open_webui.set_valves(cleanup_interval_minutes=1)
    try:
        started, links = time.monotonic(), {lost}
        while time.monotonic() - started < 180 and links == {lost}:
            time.sleep(10)
            again = bob.say(run("pass", "Again: /mnt/data/lost.txt"), previous=first)
            links = set(LINK.findall(again.content))
        assert links != {lost}, "the dead link was still handed out after 3 minutes of cleanups"
        [fresh] = links
        assert bob.download(fresh).content == b"kept"
    finally:
        open_webui.set_valves(cleanup_interval_minutes=30)


def _temporary_chat(server: OpenWebUI, account: Account, text: str) -> str:
    """A message in a temporary chat (Open WebUI saves nothing of it): the answer's text."""
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "stream": False,
        "chat_id": f"local:{uuid.uuid4()}",
    }
    response = account.post("/api/chat/completions", payload)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]
