"""A file that arrives in pieces (an upload link's POST), kept out of the chat's folder until it is whole.

The bytes are written under `<root>/incoming/`, beside the sessions and on the same filesystem, never
inside the folder the sandbox sees: a run during the upload finds no half file, and the index never
lists one. Every piece is checked against the per-file limit and the room the user's quota leaves
(the room is read again from the index every `RECHECK_BYTES`, so a run that fills the quota meanwhile
stops the upload early). `finish` (under the chat's lock) links the whole file into place, never over
an existing one, and indexes it in one transaction that checks the quota again: two uploads at once
cannot both take the last room.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import stat
import time
from collections.abc import Awaitable, Callable

from ._core import ChatRef, Core
from ._format import human_bytes
from ._fsops import DIR_MODE, FILE_MODE, chown, fd_closing, lstat_at, open_dir, walk_dirs
from ._index import user_usage
from .errors import DiskFull, FileExists, InvalidPath, QuotaExceeded, SessionGone, StorageError
from .models import Usage
from .policy import CLEAR_FILES_COMMAND, Policy

__all__ = ["Incoming"]

# The user's room is read again from the index after this many bytes (a run may fill it meanwhile).
RECHECK_BYTES = 32 * 1024 * 1024
# Staged files nobody finished (a worker that died mid-upload) are removed once this old.
STALE_S = 24 * 3600.0
_WAY_OUT = (
    f"Delete some files or old chats (or send {CLEAR_FILES_COMMAND} in a chat to empty its folder), "
    "then ask for a new upload link."
)
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

Index = Callable[[str, os.stat_result], Awaitable[None]]


class Incoming:
    """One file being received for a chat. Make it with `ChatFiles.incoming`; then `write` each piece,
    and `finish` (under the session's lock) or `discard`. Every refusal is a QuotaExceeded, DiskFull or
    StorageError whose message is the sentence for the sender."""

    def __init__(
        self, core: Core, ref: ChatRef, parts: tuple[str, ...], index: Index, policy: Policy
    ) -> None:
        self._core = core
        self._policy = policy
        self._ref = ref
        self._parts = parts
        self._index = index
        self._fd: int | None = None
        self._staged = ""
        self.received = 0
        self._bound: int | None = None  # the most bytes this file may have, as last read
        self._checked_at = 0  # `received` when the room was last read

    @property
    def path(self) -> str:
        return "/".join(self._parts)

    async def open(self) -> None:
        """Stage an empty file and read the room this file may take (refused at once if none)."""
        folder = self._core.layout.root / "incoming"
        name = f"{self._ref.user_key}.{self._ref.chat_key}.{secrets.token_hex(8)}"

        def work() -> int:
            folder.mkdir(mode=DIR_MODE, exist_ok=True)
            _remove_stale(folder)
            with fd_closing(open_dir(folder)) as dir_fd:
                return os.open(name, _NEW, FILE_MODE, dir_fd=dir_fd)

        self._fd = await asyncio.to_thread(work)
        self._staged = str(folder / name)
        try:
            await self._read_room()
        except BaseException:
            await self.discard()
            raise

    async def write(self, data: bytes) -> None:
        """Add one piece. Refused (QuotaExceeded) as soon as the file passes the per-file limit or the
        room the user's quota leaves; the caller then discards it."""
        if not data:
            return
        if self._fd is None:
            raise StorageError("this upload is already finished")
        self.received += len(data)
        if self.received - self._checked_at >= RECHECK_BYTES:
            await self._read_room()
        self._refuse_beyond_bound()
        fd = self._fd
        try:
            await asyncio.to_thread(_write_all, fd, data)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull() from error
            raise

    async def finish(self) -> str:
        """Put the whole file at its path and index it; returns the path. Call it under the chat's
        lock. The staged copy is gone afterwards, whatever happens."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise StorageError("this upload is already finished")
        core, parts = self._core, self._parts
        try:
            await self._read_room()  # the final word is the index's, in `index` below
            self._refuse_beyond_bound()

            def place() -> os.stat_result:
                os.fsync(fd)
                chown(fd, core.owner)
                if not self._ref.path.is_dir():
                    # The chat's session went while the file arrived (deleted, purged, expired): it is
                    # not made again for the file.
                    raise SessionGone(
                        "This chat no longer exists (it was deleted or has expired), so the upload was "
                        "not saved."
                    )
                with (
                    fd_closing(open_dir(self._ref.path)) as root,
                    fd_closing(walk_dirs(root, parts[:-1], create=True, owner=core.owner)) as parent,
                ):
                    try:
                        os.link(self._staged, parts[-1], dst_dir_fd=parent, follow_symlinks=False)
                    except FileExistsError:
                        raise FileExists(
                            f"/mnt/data/{self.path} exists already (it was made after the upload link "
                            "was); the upload was not saved, so nothing was replaced"
                        ) from None
                    except OSError as error:
                        if error.errno == errno.EXDEV:
                            raise StorageError(
                                "the chats' folders are on another filesystem than the storage root, so "
                                "an upload cannot be moved into place; an admin must keep them on one"
                            ) from error
                        raise
                    st = lstat_at(parent, parts[-1])
                    if st is None or not stat.S_ISREG(st.st_mode):
                        raise InvalidPath(f"/mnt/data/{self.path} changed while it was saved")
                    return st

            st = await asyncio.to_thread(place)
            try:
                await self._index(self.path, st)
            except BaseException:
                await asyncio.shield(asyncio.to_thread(self._unplace))
                raise
            return self.path
        finally:
            await asyncio.shield(asyncio.to_thread(self._unstage, fd))

    async def finish_aside(self, put: Callable[[str, int], None]) -> str:
        """Hand the whole file to `put` (blocking, run in a thread: the path and the staged file opened
        for reading) instead of putting it in the folder: a file that belongs to a saved state of the
        chat rather than to its folder as it is now. Checked against the quota as `finish` is; returns
        the path. Call it under the chat's lock. The staged copy is gone afterwards, whatever happens."""
        fd, self._fd = self._fd, None
        if fd is None:
            raise StorageError("this upload is already finished")
        try:
            await self._read_room()
            self._refuse_beyond_bound()

            def work() -> None:
                os.fsync(fd)
                with fd_closing(os.open(self._staged, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)) as src:
                    put(self.path, src)

            await asyncio.to_thread(work)
            return self.path
        finally:
            await asyncio.shield(asyncio.to_thread(self._unstage, fd))

    async def discard(self) -> None:
        """Drop what was received (a refusal, a sender that went away)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            await asyncio.shield(asyncio.to_thread(self._unstage, fd))

    # ---- internals -------------------------------------------------------------------------------------

    async def _read_room(self) -> None:
        core, ref = self._core, self._ref
        usage = await core.read(lambda tx: user_usage(tx, ref.user_key))
        policy = self._policy
        # The file is not indexed yet: it will add one file and `received` bytes to these totals.
        full = policy.over_quota(Usage(usage.files + 1, usage.bytes))
        if full is not None:
            raise QuotaExceeded(f"Nothing can be uploaded now: you are {full}. {_WAY_OUT}")
        limits = [x for x in (policy.max_file_bytes, policy.room(usage)) if x is not None]
        self._bound = min(limits) if limits else None
        self._checked_at = self.received

    def _refuse_beyond_bound(self) -> None:
        if self._bound is None or self.received <= self._bound:
            return
        policy = self._policy
        too_large = policy.file_too_large(self.received)
        if too_large is not None:
            raise QuotaExceeded(
                f"The upload was stopped at {human_bytes(self.received)}: the file is {too_large}. "
                "Nothing was saved."
            )
        raise QuotaExceeded(
            f"The upload was stopped at {human_bytes(self.received)}: your storage limit across your chats "
            f"leaves room for {human_bytes(self._bound)}. Nothing was saved. {_WAY_OUT}"
        )

    def _unstage(self, fd: int) -> None:
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self._staged)

    def _unplace(self) -> None:
        with (
            contextlib.suppress(OSError),
            fd_closing(open_dir(self._ref.path)) as root,
            fd_closing(walk_dirs(root, self._parts[:-1])) as parent,
        ):
            os.unlink(self._parts[-1], dir_fd=parent)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _remove_stale(folder: os.PathLike[str] | str) -> None:
    """Staged files of uploads that were never finished (their worker died) go after a day."""
    cutoff = time.time() - STALE_S
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.path)
