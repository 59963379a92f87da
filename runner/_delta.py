"""A kernel's memory pages stored against the template it was resumed from: only the pages that differ.

A chat that imported pandas started from the warm-start template (runner/_warm.py), and most of its
memory is still the template's: of a data kernel's 20,463 pages, 16,961 were found in the template's
(at other offsets as often as not). So its `pages.img` is stored as a delta: runs of pages, each
either a run of the template's pages (by page number) or the chat's own pages, written after the run
table; the whole stream compressed by zstd (`pages.img.delta.zst`). 78 MiB became 3.3 MiB (17.5 with
zstd alone), and unpacking copies the template's pages in the kernel (`copy_file_range`) instead of
decompressing them: 2.4 times faster than unpacking the zstd file.

The template's pages are the *base*, named by their sha256. An image records its base; unpacking needs
that very file: the host's template when it is the same (it is hot in the page cache: every warm start
reads it), else a copy kept beside the kernels' registry (`<registry>/bases/<sha256>.img`, written once
per template, shared by the hosts that share the registry). A base that is gone, or whose bytes are
not its name's, is a lost state said in a sentence, never a wrong one.

Stream: MAGIC, the page size and the number of runs (two u64), the runs (count, base page; -1 for the
chat's own pages; two i64 each), then the chat's own pages in order. Blocking file work: call it from
a thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

MAGIC = b"CSDELTA1"
PAGE = 4096
_HEAD = struct.Struct("<8sQQ")
_RUN = struct.Struct("<qq")
_CHUNK = 4 << 20  # bytes read at a time (never the whole memory of a kernel at once)
_MAX_RUNS = 1 << 24
_PAGE_MAPS: dict[str, dict[bytes, int]] = {}  # base digest -> page hash -> its first page number
_CHECKED: dict[str, tuple[int, int, int]] = {}  # base path -> (inode, size, mtime) when its digest held


class DeltaError(Exception):
    """The delta cannot be written or read back; the message says why."""


@dataclass(frozen=True)
class Base:
    """A template's pages file, named by its sha256."""

    digest: str
    path: Path
    size: int


def _page_hash(page: bytes | memoryview) -> bytes:
    return hashlib.blake2b(page, digest_size=16).digest()


def _pages(path: Path) -> Iterator[tuple[int, memoryview]]:
    """(page number, page) of a file, read a chunk at a time; a short last page as it is."""
    with open(path, "rb", buffering=0) as fh:
        number = 0
        while chunk := fh.read(_CHUNK):
            view = memoryview(chunk)
            for start in range(0, len(view), PAGE):
                yield number, view[start : start + PAGE]
                number += 1


def page_map(base: Base) -> dict[bytes, int]:
    """Each distinct page of the base by its hash (built once per base in this process)."""
    found = _PAGE_MAPS.get(base.digest)
    if found is None:
        found = {}
        for number, page in _pages(base.path):
            if len(page) == PAGE:
                found.setdefault(_page_hash(page), number)
        _PAGE_MAPS.clear()  # one base at a time: a template changes with its environment
        _PAGE_MAPS[base.digest] = found
    return found


def encode(raw: Path, base: Base, out: Path, zstd: list[str]) -> None:
    """Write `raw` as a delta against `base` into `out`, compressed by the zstd command `zstd` (its
    argv up to the output: `[zstd, -3, -q, -c]`). A page is taken from the base only if its bytes are
    the base page's, not only its hash."""
    known = page_map(base)
    runs: list[list[int]] = []
    with open(base.path, "rb", buffering=0) as base_fh:
        for _number, page in _pages(raw):
            at = known.get(_page_hash(page)) if len(page) == PAGE else None
            if at is not None and os.pread(base_fh.fileno(), PAGE, at * PAGE) != page:
                at = None
            where = -1 if at is None else at
            last = runs[-1] if runs else None
            if last is not None and (
                (where < 0 and last[1] < 0) or (where >= 0 and last[1] >= 0 and last[1] + last[0] == where)
            ):
                last[0] += 1
            else:
                runs.append([1, where])
    with open(out, "wb") as out_fh:
        job = subprocess.Popen(zstd, stdin=subprocess.PIPE, stdout=out_fh, stderr=subprocess.PIPE)
        assert job.stdin is not None
        try:
            job.stdin.write(_HEAD.pack(MAGIC, PAGE, len(runs)))
            job.stdin.write(b"".join(_RUN.pack(count, where) for count, where in runs))
            with open(raw, "rb", buffering=0) as raw_fh:
                page_number = 0
                for count, where in runs:
                    if where < 0:
                        with contextlib.suppress(BrokenPipeError):
                            job.stdin.write(os.pread(raw_fh.fileno(), count * PAGE, page_number * PAGE))
                    page_number += count
            job.stdin.close()
            assert job.stderr is not None
            err = job.stderr.read()
            job.wait(timeout=120)
        except BaseException:
            job.kill()
            job.wait()
            raise
    if job.returncode != 0:
        words = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {job.returncode}"]
        raise DeltaError(f"zstd failed writing the delta: {words[0][:200]}")


def decode(delta: Path, base: Base, out: Path, size: int, zstd: list[str]) -> None:
    """Write the pages the delta `delta` (zstd-compressed) describes into `out`, the base's runs
    copied in the kernel; `size` is what they must come to (checked before anything is written)."""
    job = subprocess.Popen(
        [*zstd, str(delta)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert job.stdout is not None
    with contextlib.suppress(OSError):  # room for zstd to decompress ahead while pages are copied
        fcntl.fcntl(job.stdout.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)
    try:
        magic, page, count = _HEAD.unpack(_read_exactly(job.stdout, _HEAD.size))
        if magic != MAGIC or page != PAGE or count > _MAX_RUNS:
            raise DeltaError("its pages' delta has an unknown format")
        table = _read_exactly(job.stdout, count * _RUN.size)
        runs = [_RUN.unpack_from(table, i * _RUN.size) for i in range(count)]
        if sum(n for n, _ in runs) * PAGE < size or (sum(n for n, _ in runs) - 1) * PAGE >= size:
            raise DeltaError("its pages' delta does not add up to the size recorded")
        base_pages = (base.size + PAGE - 1) // PAGE
        if any(n <= 0 or (where >= 0 and where + n > base_pages) for n, where in runs):
            raise DeltaError("its pages' delta names pages its base does not have")
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with open(base.path, "rb", buffering=0) as base_fh:
                position = 0
                for n, where in runs:
                    length = min(n * PAGE, size - position)
                    if where >= 0:
                        _copy(base_fh.fileno(), where * PAGE, fd, position, length)
                    else:
                        os.pwrite(fd, _read_exactly(job.stdout, length), position)
                    position += length
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        if job.stdout.read(1):
            raise DeltaError("its pages' delta goes on past its last run")
        _, err = job.communicate(timeout=120)
        if job.returncode != 0:
            words = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {job.returncode}"]
            raise DeltaError(f"zstd failed reading its pages' delta: {words[0][:200]}")
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def _read_exactly(stream: IO[bytes], length: int) -> bytes:
    parts, left = [], length
    while left:
        part = stream.read(left)
        if not part:
            raise DeltaError("its pages' delta ends too soon")
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _copy(src: int, src_at: int, dst: int, dst_at: int, length: int) -> None:
    """`length` bytes from src to dst at these offsets, in the kernel where it can."""
    while length > 0:
        try:
            done = os.copy_file_range(src, dst, length, src_at, dst_at)
        except OSError:  # an older kernel, or file systems it cannot copy between
            data = os.pread(src, min(length, _CHUNK), src_at)
            done = os.pwrite(dst, data, dst_at) if data else 0
        if done <= 0:
            raise DeltaError("its base ends before the pages the delta takes from it")
        src_at, dst_at, length = src_at + done, dst_at + done, length - done


def digest_of(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def keep_copy(source: Path, digest: str, bases: Path) -> Path:
    """A copy of a base in the shared folder `bases` (`<sha256>.img`), written once (to a temporary
    name, then renamed), so that any host sharing it can unpack the images stored against it."""
    target = bases / f"{digest}.img"
    if target.exists():
        return target
    bases.mkdir(mode=0o700, parents=True, exist_ok=True)
    temporary = bases / f".{digest}.{os.getpid()}"
    try:
        shutil.copyfile(source, temporary)
        with open(temporary, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(temporary, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return target


def checked(base: Base) -> bool:
    """The base's bytes are its name's sha256: read whole the first time this process uses the file,
    and again only if it was replaced or rewritten since (its inode, size or modification time)."""
    try:
        st = base.path.stat()
    except OSError:
        return False
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    if _CHECKED.get(str(base.path)) == stamp:
        return True
    if st.st_size != base.size or digest_of(base.path) != base.digest:
        return False
    _CHECKED[str(base.path)] = stamp
    return True


def find(digest: str, size: int, places: list[Path]) -> Base | None:
    """The first of `places` holding the base `digest` whole (see `checked`), or None."""
    for place in places:
        base = Base(digest, place, size)
        if checked(base):
            return base
    return None
