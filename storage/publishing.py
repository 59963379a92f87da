"""Where published copies go: the `Publisher` protocol, and the folder publisher storage ships.

Storage decides *what* is published and when a copy can be reused (same bytes), and keeps the links
in its index; a publisher only stores bytes and says where the browser fetches them. The web
server's own file store (Open WebUI's Files API, with its access rules) is a publisher the adapter
supplies; `DirectoryPublisher` writes into a folder the web server serves under a URL prefix.

A link row remembers which publisher (`kind`) holds its copy, so copies made by an earlier publisher
keep working and are removed correctly after the admin switches to another.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import secrets
import stat
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ._fsops import copy_fd, fd_closing, remove_tree
from .errors import DiskFull

__all__ = ["Copy", "DirectoryPublisher", "Published", "Publisher"]


@dataclass(frozen=True, slots=True)
class Copy:
    """One file to publish. `fd` is open for reading (read it from offset 0, do not close it); its
    bytes were checked to be a regular file of the session, reached without any symlink."""

    fd: int
    size: int
    name: str  # safe for a URL and a Content-Disposition header (see _names.publish_name)
    content_type: str | None  # guessed from the name; None when unknown
    inline: bool  # a passive image or medium a browser may show inline; everything else downloads
    path: str  # relative to the session folder
    user_id: str
    chat_id: str
    sha256: str


@dataclass(frozen=True, slots=True)
class Published:
    ref: str  # the publisher's id of the copy (at most 200 characters)
    url: str


class Publisher(Protocol):
    kind: str  # recorded with each link: which publisher holds its copy

    async def put(self, copy: Copy) -> Published:
        """Store the bytes; raise StorageError (DiskFull for no room) with a sentence on failure."""

    async def remove(self, refs: Sequence[str]) -> None:
        """Delete these copies; ones already gone are fine."""

    async def missing(self, refs: Sequence[str]) -> set[str]:
        """Which of these copies are gone (check)."""

    async def strays(self, known: set[str], older_than_s: float) -> list[str]:
        """Copies of ours, older than this, that are not in `known` (a crash between storing the
        bytes and writing the link); `remove` deletes them."""


TOKEN_BYTES = 24  # 192 random bits
TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{32}")
STAGING_PREFIX = ".staging-"


class DirectoryPublisher:
    """Copies under `directory/<token>/<name>`, served by the web server at `url_prefix`.

    The token is 192 random bits. The copy is written into a staging folder that is renamed into
    place only when complete, so the web server never serves a partial file. Whoever has the URL can
    fetch it (the web server's folder route checks login at most): see the security model."""

    kind = "directory"

    def __init__(self, directory: Path | str, url_prefix: str) -> None:
        self.directory = Path(directory)
        self.url_prefix = url_prefix if url_prefix.endswith("/") else url_prefix + "/"

    def __repr__(self) -> str:
        return f"DirectoryPublisher({str(self.directory)!r}, {self.url_prefix!r})"

    async def put(self, copy: Copy) -> Published:
        token = secrets.token_urlsafe(TOKEN_BYTES)
        await asyncio.to_thread(_copy_into, copy.fd, self.directory, token, copy.name, copy.path)
        return Published(token, self.url_prefix + token + "/" + urllib.parse.quote(copy.name))

    async def remove(self, refs: Sequence[str]) -> None:
        await asyncio.to_thread(remove_directory_copies, [(self.directory, r) for r in refs])

    async def missing(self, refs: Sequence[str]) -> set[str]:
        def look() -> set[str]:
            return {r for r in refs if not _folder_present(self.directory / r)}

        return await asyncio.to_thread(look)

    async def strays(self, known: set[str], older_than_s: float) -> list[str]:
        return await asyncio.to_thread(stray_folders, self.directory, known, older_than_s)

    def present(self, ref: str, name: str) -> bool:
        return copy_present(self.directory, ref, name)


def copy_present(directory: Path, token: str, name: str) -> bool:
    try:
        st = os.stat(directory / token / name, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode)


def _folder_present(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.stat(path, follow_symlinks=False).st_mode)
    except OSError:
        return False


def remove_directory_copies(copies: Sequence[tuple[str | Path, str]]) -> None:
    """remove_directory_copy for each (directory, token): one thread hop for many."""
    for directory, token in copies:
        remove_directory_copy(directory, token)


def remove_directory_copy(directory: str | Path, token: str) -> None:
    """Delete a published copy (or an abandoned staging folder); refuses anything that is not one of
    our token folders."""
    if not _ours(token):
        return
    with contextlib.suppress(OSError):
        remove_tree(Path(directory) / token)


def stray_folders(directory: Path, known: set[str], older_than_s: float) -> list[str]:
    """Token and staging folders of ours in `directory` that no link names, older than the grace."""
    now = time.time()
    strays: list[str] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if not _ours(name) or name in known or not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(FileNotFoundError):
                if now - entry.stat(follow_symlinks=False).st_mtime > older_than_s:
                    strays.append(name)
    return strays


def _ours(name: str) -> bool:
    return bool(TOKEN_RE.fullmatch(name.removeprefix(STAGING_PREFIX)))


def _copy_into(src: int, directory: Path, token: str, name: str, rel: str) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    staging = directory / f"{STAGING_PREFIX}{token}"
    try:
        os.mkdir(staging, 0o700)
        out = os.open(
            staging / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with fd_closing(out):
            os.lseek(src, 0, os.SEEK_SET)
            copy_fd(src, out)
        os.rename(staging, directory / token)
    except BaseException as exc:
        remove_tree(staging)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"Not enough disk space to publish {rel}; nothing was published.") from exc
        raise
