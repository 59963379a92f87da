"""Files that arrive in pieces (upload links): staged outside the chat's folder, checked against the
per-file limit and the quota as they stream, put in place whole and indexed; and the links themselves
(one use, an expiry, a sentence for each refusal)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from storage import (
    FileExists,
    InvalidPath,
    LinkRefused,
    Policy,
    QuotaExceeded,
    Quotas,
    Store,
    UploadLinks,
)

MiB = 1024 * 1024


def _chunks(total: int, size: int = 256 * 1024) -> list[bytes]:
    out, n = [], 0
    while n < total:
        piece = bytes([(n // size) % 251]) * min(size, total - n)
        out.append(piece)
        n += len(piece)
    return out


async def test_a_file_received_in_pieces_lands_whole_and_indexed(store: Store):
    session = await store.session("u1", "c1")
    incoming = await session.files.incoming("in/export.bin")
    pieces = _chunks(3 * MiB + 17)
    for piece in pieces[:-1]:
        await incoming.write(piece)
    # Not visible in the folder while it arrives (no half file), nor in the index.
    assert not (session.path / "in").exists()
    assert [e.path for e in await session.files.list()] == []
    await incoming.write(pieces[-1])
    async with session.lock():
        assert await incoming.finish() == "in/export.bin"
    assert (session.path / "in" / "export.bin").read_bytes() == b"".join(pieces)
    [entry] = await session.files.list()
    assert (entry.path, entry.size) == ("in/export.bin", 3 * MiB + 17)
    assert (await session.user_usage()).bytes == 3 * MiB + 17
    assert os.listdir(store.root / "incoming") == []  # nothing staged is left


async def test_the_per_file_limit_stops_the_upload_while_it_streams(store: Store):
    policy = Policy(Quotas(max_file_bytes=1 * MiB))
    session = await store.session("u1", "c1", policy=policy)
    incoming = await session.files.incoming("big.bin")
    await incoming.write(b"x" * MiB)
    with pytest.raises(QuotaExceeded, match=r"stopped at 1\.0 MiB.*per-file limit.*Nothing was saved"):
        await incoming.write(b"x")
    await incoming.discard()
    assert not (session.path / "big.bin").exists()
    assert os.listdir(store.root / "incoming") == []


async def test_the_quota_counts_what_the_user_has_across_chats(store: Store):
    policy = Policy(Quotas(max_bytes_per_user=2 * MiB))
    other = await store.session("u1", "elsewhere", policy=policy)
    await other.files.write("old.bin", b"o" * MiB)
    session = await store.session("u1", "c1", policy=policy)
    incoming = await session.files.incoming("new.bin")
    await incoming.write(b"n" * MiB)  # exactly the room left
    with pytest.raises(QuotaExceeded, match=r"storage limit across your chats leaves room for 1 MiB"):
        await incoming.write(b"n")
    await incoming.discard()


async def test_a_run_that_fills_the_quota_meanwhile_refuses_the_finish(store: Store):
    policy = Policy(Quotas(max_bytes_per_user=2 * MiB))
    session = await store.session("u1", "c1", policy=policy)
    incoming = await session.files.incoming("late.bin")
    await incoming.write(b"a" * MiB)
    await session.files.write("meanwhile.bin", b"b" * (MiB + 1))  # the room is gone now
    with pytest.raises(QuotaExceeded):
        async with session.lock():
            await incoming.finish()
    assert not (session.path / "late.bin").exists()
    assert [e.path for e in await session.files.list()] == ["meanwhile.bin"]
    assert os.listdir(store.root / "incoming") == []


async def test_an_upload_never_replaces_a_file(store: Store):
    session = await store.session("u1", "c1")
    await session.files.write("taken.csv", b"mine")
    with pytest.raises(FileExists, match="never replaces"):
        await session.files.incoming("taken.csv")
    incoming = await session.files.incoming("later.csv")
    await incoming.write(b"theirs")
    await session.files.write("later.csv", b"made meanwhile")
    with pytest.raises(FileExists, match="nothing was replaced"):
        async with session.lock():
            await incoming.finish()
    assert (session.path / "later.csv").read_bytes() == b"made meanwhile"


@pytest.mark.parametrize("path", ["../escape", "/etc/passwd", "a//b", "x\x00y", ""])
async def test_a_bad_path_is_refused_before_anything_is_written(store: Store, path: str):
    session = await store.session("u1", "c1")
    with pytest.raises(InvalidPath):
        await session.files.incoming(path)


async def test_a_symlinked_folder_in_the_path_is_not_followed(store: Store, tmp_path: Path):
    session = await store.session("u1", "c1")
    await session.files.write("seed.txt", b"s")
    outside = tmp_path / "outside"
    outside.mkdir()
    (session.path / "link").symlink_to(outside)
    incoming = await session.files.incoming("link/x.bin")
    await incoming.write(b"payload")
    with pytest.raises(InvalidPath):
        async with session.lock():
            await incoming.finish()
    assert list(outside.iterdir()) == []


async def test_a_link_is_used_once_and_refused_after_with_a_sentence(tmp_path: Path):
    links = UploadLinks(tmp_path / "links")
    token, grant = await links.mint("u1", "c1", "./in/a.csv", ttl_s=60, where={"root": "/r"})
    assert grant.path == "in/a.csv"
    assert (await links.peek(token)).where == {"root": "/r"}
    assert (await links.claim(token)).chat_id == "c1"
    with pytest.raises(LinkRefused, match="used already"):
        await links.claim(token)
    with pytest.raises(LinkRefused, match="not valid"):
        await links.claim("A" * 43)
    with pytest.raises(LinkRefused, match="incomplete or mistyped"):
        await links.claim("../../etc/passwd")
    # Only root can read the records, and no record names a token.
    assert oct((tmp_path / "links").stat().st_mode & 0o777) == "0o700"
    assert all(token not in p.name for p in (tmp_path / "links").iterdir())


async def test_two_uses_at_once_only_one_wins(tmp_path: Path):
    links = UploadLinks(tmp_path / "links")
    token, _ = await links.mint("u1", "c1", "a.csv", ttl_s=60)
    results = await asyncio.gather(*(links.claim(token) for _ in range(8)), return_exceptions=True)
    assert sum(not isinstance(r, BaseException) for r in results) == 1
    assert all(isinstance(r, LinkRefused) for r in results if isinstance(r, BaseException))


async def test_an_expired_link_says_when_it_expired(tmp_path: Path):
    now = [1000.0]
    links = UploadLinks(tmp_path / "links", clock=lambda: now[0])
    token, _ = await links.mint("u1", "c1", "a.csv", ttl_s=15 * 60)
    now[0] += 16 * 60
    with pytest.raises(LinkRefused, match=r"expired 1m ago \(links last 15m\)"):
        await links.claim(token)


async def test_a_bad_path_makes_no_link(tmp_path: Path):
    with pytest.raises(InvalidPath):
        await UploadLinks(tmp_path / "links").mint("u1", "c1", "../x", ttl_s=60)


async def test_the_limits_given_are_the_ones_applied_not_the_stores(store: Store):
    # The session's own limits (another message's) are not an upload's: it keeps its link's.
    session = await store.session("u1", "c1", policy=Policy(Quotas(max_file_bytes=1)))
    incoming = await session.files.incoming("a.bin", policy=Policy(Quotas(max_file_bytes=4 * MiB)))
    await incoming.write(b"x" * MiB)
    async with session.lock():
        assert await incoming.finish() == "a.bin"
    strict = await session.files.incoming("b.bin", policy=Policy(Quotas(max_file_bytes=10)))
    with pytest.raises(QuotaExceeded, match="per-file limit"):
        await strict.write(b"x" * 11)
    await strict.discard()
