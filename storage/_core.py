"""The storage core every internal module works with, and nothing in it imports back up.

* `ChatRef`: which session (the untrusted ids, the folder keys made from them, the folder).
* `Core`: the context of one store: the database backend (with recovery from a damaged index), where
  things live (`Layout`), who owns what the store creates, the `Policy`, the `Publisher`.

`Store` and `Session` (the public faces) hold a Core and refs; `_reconcile`, `_publish`, `_expiry` and
`_repair` are functions over (Core, ChatRef).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from . import _index
from ._backend import Backend, Lock, Tx
from ._fsops import make_dir
from ._keys import id_key
from ._layout import Layout, write_sidecar
from .errors import DiskFull, IndexDamaged, StorageError
from .models import RebuildReport, Reconcile
from .policy import Policy
from .publishing import Publisher

log = logging.getLogger("code_sessions.storage")

T = TypeVar("T")
Owner = tuple[int, int] | None
# Whether a chat id names a temporary chat, which expires sooner (Expiry.temporary_idle_s). The host
# knows its ids' formats; storage does not.
TemporaryChat = Callable[[str], bool]
ENSURED_FOR_S = 30.0
MAX_ID_CHARS = 512  # the index keeps ids whole (unique, indexed): within every backend's key limit


@dataclass(frozen=True, slots=True)
class ChatRef:
    """Which chat's session: the ids as given (untrusted strings), the keys of its folder, the folder itself.

    The keys are normally made from the ids; a folder found on disk (rebuild, a lost sidecar) keeps
    its keys whatever its ids hash to: the folder decides where the files are."""

    user_id: str
    chat_id: str
    user_key: str
    chat_key: str
    temporary: bool
    path: Path


class Core:
    def __init__(
        self,
        root: Path,
        backend: Backend,
        *,
        publisher: Publisher | None,
        owner: Owner,
        record_settings: bool = True,
        temporary_chat: TemporaryChat | None = None,
        reconcile: Callable[[Reconcile], Awaitable[RebuildReport | None]] | None = None,
    ) -> None:
        self.root = root
        self.layout = Layout(root)
        self.backend = backend
        self.publisher = publisher
        self.owner = owner
        self.temporary_chat: TemporaryChat = temporary_chat or _never_temporary
        # The CLI turns this off: it applies the recorded settings and must not overwrite them.
        self.record_settings = record_settings
        # The Store's (Store.reconcile): REBUILD after a damaged index was replaced, AFTER_FULL_DISK by
        # the first write that has room again.
        self.reconcile = reconcile
        # Sessions that went on without their sidecar or index row because the disk was full; written,
        # and their folders indexed, by the first write that succeeds afterwards.
        self.unsaved: dict[tuple[str, str], ChatRef] = {}
        self.repairs_put_off = False  # the store opened on a full disk, without its start-up repairs
        self._reconciling_after_full_disk = False
        self._remembered: dict[str, str] = {}
        self._remembered_policy: Policy | None = None
        self._generation = 0  # how many times the database was replaced while open
        self._recovery: asyncio.Lock | None = None
        self._recovering = False
        self._ensured: dict[tuple[str, str], float] = {}  # sessions made sure of (and touched) lately
        # The trash's emptying, in the background (storage/_expiry.py): the task, and whether more was
        # put there since it last looked.
        self.trash_task: asyncio.Task[None] | None = None
        self.trash_wanted = False

    @property
    def generation(self) -> int:
        """How many times the database was replaced while open (a damaged index, rebuilt)."""
        return self._generation

    def forget_ensured(self, user_key: str, chat_key: str) -> None:
        """The session was deleted: the next use makes sure of it again."""
        self._ensured.pop((user_key, chat_key), None)

    # ------------------------------------------------------------------ refs and locks

    def ref(self, user_id: str, chat_id: str) -> ChatRef:
        if not isinstance(user_id, str) or not isinstance(chat_id, str):
            raise StorageError("user_id and chat_id must be str")
        if len(user_id) > MAX_ID_CHARS or len(chat_id) > MAX_ID_CHARS:
            # Open WebUI's ids are 36-character UUIDs; a client can send any chat id through the API.
            raise StorageError(f"a user or chat id longer than {MAX_ID_CHARS} characters is not accepted")
        return self.ref_at(user_id, chat_id, id_key(user_id), id_key(chat_id))

    def ref_at(
        self, user_id: str, chat_id: str, user_key: str, chat_key: str, *, recorded_temporary: bool = False
    ) -> ChatRef:
        """`recorded_temporary`: what the chat's sidecar or index row says (a rebuild's source)."""
        return ChatRef(
            user_id,
            chat_id,
            user_key,
            chat_key,
            recorded_temporary or self.temporary_chat(chat_id),
            self.layout.session_dir(user_key, chat_key),
        )

    def lock_of(self, ref: ChatRef) -> Lock:
        return self.backend.chat_lock(ref.user_key, ref.chat_key)

    # ------------------------------------------------------------------ transactions

    async def read(self, fn: Callable[[Tx], Coroutine[Any, Any, T]]) -> T:
        return await self._guarded(self.backend.read, fn)

    async def write(self, fn: Callable[[Tx], Coroutine[Any, Any, T]]) -> T:
        return await self._guarded(self.backend.write, fn)

    async def _guarded(
        self,
        run: Callable[[Callable[[Tx], Coroutine[Any, Any, T]]], Awaitable[T]],
        fn: Callable[[Tx], Coroutine[Any, Any, T]],
    ) -> T:
        generation = self._generation
        try:
            return await run(fn)
        except IndexDamaged as damage:
            if self._recovering:
                raise
            await self._recover(generation, damage)
        return await run(fn)

    async def _recover(self, generation: int, damage: IndexDamaged) -> None:
        """Replace a damaged index and rebuild it from the folders, once, while every other caller
        that met the damage waits and then retries on the new one."""
        if self._recovery is None:
            self._recovery = asyncio.Lock()
        async with self._recovery:
            if self._generation != generation:
                return  # someone recovered it while we waited
            self._recovering = True
            try:
                opened = await self.backend.recover()
                self._generation += 1
                self._remembered, self._remembered_policy = {}, None
                rebuilt = (
                    await self.reconcile(Reconcile.REBUILD)
                    if opened.fresh and self.reconcile is not None
                    else None
                )
            finally:
                self._recovering = False
            moved = f"moved it to {opened.moved_aside}, " if opened.moved_aside else ""
            done = (
                f"rebuilt it from the folders: {rebuilt.summary()}" if rebuilt is not None else "reconnected"
            )
            log.warning("the index was damaged (%s): %s%s", damage, moved, done)

    # ------------------------------------------------------------------ sessions

    async def ensure(self, ref: ChatRef, *, touch: bool, cached: bool = False) -> bool:
        """The session's folder, sidecar and index row, created if missing; `touch` marks it used.

        `cached`: a session this process made sure of moments ago, whose folder is still there, is not
        written again (expiry counts in hours and days; a step should not pay a transaction for it).
        On a full disk an existing session is still usable (a run may be what frees the space); its
        sidecar and row are written by the first write that has room again.

        True when this session went on without its index on a full disk until now: what its runs
        wrote then is not in the index, and only a full listing finds it (the catch-up skips a
        session its caller holds)."""
        key = (ref.user_key, ref.chat_key)
        seen = self._ensured.get(key)
        if cached and seen is not None and time.monotonic() - seen < ENSURED_FOR_S and ref.path.is_dir():
            # Nothing to write for this session; what a full disk left for later may have room now.
            await self.catch_up()
            return False
        try:
            created = await asyncio.to_thread(self.make_dirs, ref)
            now = time.time()
            await self.write(lambda tx: self.session_id(tx, ref, created, now if touch else None))
        except (DiskFull, OSError) as error:
            full = isinstance(error, DiskFull) or error.errno in (errno.ENOSPC, errno.EDQUOT)
            if not full or not ref.path.is_dir():
                raise DiskFull() if full else error from None
            if key not in self.unsaved:
                log.warning(
                    "the disk is full: chat %r of user %r goes on without updating its index row",
                    ref.chat_id,
                    ref.user_id,
                )
            if len(self.unsaved) < 100_000:
                self.unsaved[key] = ref
            return False
        was_unsaved = self.unsaved.pop(key, None) is not None
        if touch:
            if len(self._ensured) > 10_000:
                self._ensured.clear()
            self._ensured[key] = time.monotonic()
        await self.catch_up()
        return was_unsaved

    async def catch_up(self) -> None:
        """What a full disk put off, if anything (the sessions used meanwhile, the start-up repairs):
        done now, if the disk has room again (Reconcile.AFTER_FULL_DISK; it stops quietly when not).
        Called by every `ensure`, a warm step's too (it writes nothing of its own), and by the
        background tick: once space is freed, the next step of any chat, or the next tick, does it."""
        if (
            (self.unsaved or self.repairs_put_off)
            and self.reconcile is not None
            and not self._reconciling_after_full_disk
        ):
            self._reconciling_after_full_disk = True
            try:
                await self.reconcile(Reconcile.AFTER_FULL_DISK)
            finally:
                self._reconciling_after_full_disk = False

    async def session_id(self, tx: Tx, ref: ChatRef, created_at: float, used_at: float | None = None) -> int:
        """The session's row id inside a transaction, creating the row if it is missing."""
        return await _index.ensure_session(
            tx,
            user_id=ref.user_id,
            chat_id=ref.chat_id,
            user_key=ref.user_key,
            chat_key=ref.chat_key,
            temporary=ref.temporary,
            created_at=created_at,
            used_at=used_at,
        )

    def make_dirs(self, ref: ChatRef) -> float:
        """Create the session folder, its state folder and sidecar; returns the creation time."""
        layout = self.layout
        now = time.time()
        for attempt in range(5):
            try:
                make_dir(layout.sessions / ref.user_key)
                if not make_dir(ref.path, self.owner) and self.owner is not None:
                    _chown_existing(ref.path, self.owner)
                make_dir(layout.state / ref.user_key)
                sidecar = layout.sidecar_path(ref.user_key, ref.chat_key)
                if not sidecar.exists():
                    write_sidecar(sidecar, ref.user_id, ref.chat_id, now, ref.temporary)
                return now
            except FileNotFoundError:
                # A cleanup removed an empty parent folder between two of our steps: go again.
                if attempt == 4:
                    raise
        return now

    # ------------------------------------------------------------------ bookkeeping

    async def log(
        self,
        event: str,
        user_id: str | None = None,
        chat_id: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        now = time.time()
        await self.write(lambda tx: _index.log_activity(tx, now, event, user_id, chat_id, detail))

    async def remember_settings(self, policy: Policy) -> None:
        """Record the quotas and expiry an operation ran with, so the CLI can show and apply the same
        ones (a record for the CLI: no operation of the store reads it back)."""
        if not self.record_settings or policy is self._remembered_policy:
            return
        values = {
            "quotas": json.dumps(policy.quotas.to_dict(), sort_keys=True),
            "expiry": json.dumps(policy.expiry.to_dict(), sort_keys=True),
        }
        if values == self._remembered:
            return

        async def write(tx: Tx) -> None:
            for key, value in values.items():
                if await _index.get_meta(tx, key) != value:
                    await _index.set_meta(tx, key, value)

        try:
            await self.write(write)
        except DiskFull:
            return  # only the CLI reads these; the next call tries again
        self._remembered = values
        self._remembered_policy = policy


def _never_temporary(chat_id: str) -> bool:
    return False


def _chown_existing(path: Path, owner: tuple[int, int]) -> None:
    if os.geteuid() != 0:
        return
    st = os.stat(path, follow_symlinks=False)
    if (st.st_uid, st.st_gid) != owner:
        with contextlib.suppress(OSError):
            os.chown(path, owner[0], owner[1], follow_symlinks=False)
