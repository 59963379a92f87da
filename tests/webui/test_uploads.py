"""An upload link's POST through its whole path but the HTTP framing (webui/uploads.py's receive_upload:
the multipart reader, engine.Inbound, the store's Incoming), on a real store:

* a hostile or big body keeps the event loop free (tests/support/loop_lag.py): 64 MiB of file data full
  of near-delimiters, 16 MiB of empty fields before the file, a 200 KiB header block in one piece;
* a link whose chat is gone (deleted in the host, or its session purged) answers as a dead link and
  creates nothing. The same through a real Open WebUI: tests/e2e/test_inbound.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engine import Inbound
from storage import LinkRefused, Purge, Store, UploadLinks
from tests.support.loop_lag import LoopLag
from webui.uploads import receive_upload

MiB = 1024 * 1024
BOUNDARY = "cs-upload-test"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
CHUNK = 64 * 1024  # what a web server hands on at once, usually (its flow control's high-water mark)
BIG_CHUNK = 256 * 1024  # the most one read of asyncio's transport gives it at once


class Host:
    """Which chats the host (Open WebUI) still has."""

    def __init__(self) -> None:
        self.deleted: set[tuple[str, str]] = set()

    async def chat_exists(self, user_id: str, chat_id: str) -> bool:
        return (user_id, chat_id) not in self.deleted


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    found = Store(tmp_path / "root")
    await found.open()
    yield found
    await found.close()


@pytest.fixture
def host() -> Host:
    return Host()


@pytest.fixture
def inbound(tmp_path: Path, store: Store, host: Host) -> Inbound:
    async def stores(where: dict) -> tuple:
        return store, store.policy

    return Inbound(UploadLinks(tmp_path / "links"), stores, chat_exists=host.chat_exists)


async def link(inbound: Inbound, store: Store, path: str = "in/export.bin") -> str:
    await store.session("alice", "chat-1")  # the chat the link was made in
    token, _ = await inbound.links.mint("alice", "chat-1", path, ttl_s=600)
    return token


def part(data: bytes, name: str = "file", filename: str = "export.bin") -> bytes:
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n\r\n'
    return head.encode() + data + b"\r\n"


def in_chunks(pieces: Iterator[bytes], size: int = CHUNK) -> AsyncIterator[bytes]:
    """The body as a web server hands it on: in pieces of `size` bytes, each once it has arrived (a
    server's receive() suspends when what it buffered is read)."""

    async def stream() -> AsyncIterator[bytes]:
        held = b""
        for piece in pieces:
            data = memoryview(held + piece)
            cut = len(data) - len(data) % size
            for at in range(0, cut, size):
                yield bytes(data[at : at + size])
                await asyncio.sleep(0)
            held = bytes(data[cut:])
        if held:
            yield held

    return stream()


async def post(inbound: Inbound, token: str, body: AsyncIterator[bytes]) -> tuple[int, str, dict]:
    """What the route does with a POST that carries no login (webui/uploads.py's _endpoint)."""
    try:
        await inbound.peek(token)
    except LinkRefused as refused:
        return (404 if refused.kind == "unknown" else 410), str(refused), {}
    return await receive_upload(inbound, token, CONTENT_TYPE, body)


def near_delimiters(size: int) -> Iterator[bytes]:
    """`size` bytes of file data that keep looking like the start of the closing delimiter."""
    unit = (b"\r\n--" + BOUNDARY.encode()[:-1] + b"x\r\n-\r\n--") * 64
    for _ in range(size // len(unit)):
        yield unit
    yield b"z" * (size % len(unit))


# ---- the event loop


async def test_a_big_file_full_of_near_delimiters_keeps_the_loop_free(inbound: Inbound, store: Store):
    token = await link(inbound, store)
    size = 64 * MiB
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="e.bin"\r\n\r\n'.encode()
    tail = f"\r\n--{BOUNDARY}--\r\n".encode()
    body = in_chunks(iter([head, *near_delimiters(size), tail]))
    async with LoopLag() as lag:
        status, sentence, extra = await post(inbound, token, body)
    print(lag.summary())
    lag.assert_quiet()
    assert (status, extra["size"]) == (201, size), sentence
    session = await store.session("alice", "chat-1")
    assert (session.path / "in" / "export.bin").stat().st_size == size


@pytest.mark.parametrize("hostile", ["empty fields", "a long header block"])
async def test_a_hostile_form_is_refused_and_keeps_the_loop_free(
    inbound: Inbound, store: Store, hostile: str
):
    token = await link(inbound, store)
    if hostile == "empty fields":  # 16 MiB of fields before the file: their headers count too
        empty = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="x"\r\n\r\n\r\n'.encode()
        pieces, size = [empty * (16 * MiB // len(empty)), part(b"data")], CHUNK
        expected = "first megabyte"
    else:  # a 200 KiB header block, whole in one piece
        block = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"\r\nX-A: '.encode()
        pieces, size = [block + b"a" * 200 * 1024 + b"\r\n\r\ndata\r\n"], BIG_CHUNK
        expected = "too many headers"
    body = in_chunks(iter([*pieces, f"--{BOUNDARY}--\r\n".encode()]), size)
    async with LoopLag() as lag:
        status, sentence, _ = await post(inbound, token, body)
    print(lag.summary())
    lag.assert_quiet()
    assert status == 400 and expected in sentence, sentence
    session = await store.session("alice", "chat-1")
    assert not (session.path / "in").exists()


# ---- a link whose chat is gone


@pytest.mark.parametrize("gone", ["deleted in the host", "deleted and forgotten", "purged"])
async def test_a_link_of_a_chat_that_is_gone_is_dead_and_creates_nothing(
    inbound: Inbound, store: Store, host: Host, gone: str
):
    token = await link(inbound, store)
    if gone.startswith("deleted"):
        host.deleted.add(("alice", "chat-1"))
    if gone != "deleted in the host":  # the maintenance (or a purge) removed the chat's session
        await store.cleanup(Purge(chat_id="chat-1"))
    body = in_chunks(iter([part(b"data"), f"--{BOUNDARY}--\r\n".encode()]))
    status, sentence, _ = await post(inbound, token, body)
    assert status == 410 and "chat no longer exists" in sentence, sentence
    folders = list((store.root / "sessions").rglob("chat-1-*"))
    if gone == "deleted in the host":  # its folder waits for the maintenance, without the file
        [folder] = folders
        assert not (folder / "in").exists()
    else:  # neither its folder nor its index row made again
        assert folders == [] and await store.sessions() == []
    assert await store.check() == []


async def test_a_chat_purged_while_its_file_arrives_is_not_made_again(inbound: Inbound, store: Store):
    token = await link(inbound, store)
    grant = await inbound.claim(token)
    incoming = await inbound.begin(grant)
    await incoming.write(b"data")
    await store.cleanup(Purge(chat_id="chat-1"))
    with pytest.raises(LinkRefused, match="chat no longer exists"):
        await inbound.finish(grant, incoming)
    await incoming.discard()
    assert await store.sessions() == []
    assert not list((store.root / "sessions").rglob("chat-1-*"))
    assert os.listdir(store.root / "incoming") == []
