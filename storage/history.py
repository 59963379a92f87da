"""A chat's history by message, as callers see it (`session.history`): save the folder's state at the
end of an answer, and put an earlier answer's state back when the conversation branches from it.

Every call is made holding the chat's lock (`session.lock()`); the file work runs in a thread
(storage/_history.py has the layout, the records and the rules). States live in the chat's saved-state
folder, outside /mnt/data, and go with the session. What goes wrong is a StorageError: HistoryError
when a state cannot be kept or put back, DiskFull or StorageError for the disk's own errors (never a
raw OSError).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from . import _index
from ._backend import Lock, Tx
from ._core import ChatRef, Core
from ._fsops import Owner
from ._history import History, Restored, Saved, digest
from ._history_import import CloneStart, Imported, Room, import_state, read_start, write_start
from ._history_runs import AnswerRuns, RunRecords, run_entry
from ._incoming import Incoming
from ._layout import Layout
from .errors import HistoryError, disk_error

__all__ = [
    "HISTORY_DIR",
    "ChatHistory",
    "CloneStart",
    "HistoryError",
    "HistoryHead",
    "Imported",
    "Restored",
    "Room",
    "Saved",
]

HISTORY_DIR = "history"
# Whether a chat's start from another (a clone) was done: beside the history, not in it, so that a chat
# that is no clone gets no history folder for it (the bound across a user's chats lists those).
ORIGIN = "origin.json"
_T = TypeVar("_T")


async def _on_disk(work: Callable[[], _T], what: str = "the chat's saved states could not be used") -> _T:
    """Run blocking history work in a thread, its OSError turned into a StorageError."""
    try:
        return await asyncio.to_thread(work)
    except OSError as error:
        raise disk_error(error, what) from error


@dataclass(frozen=True, slots=True)
class HistoryHead:
    """Which message's state the folder holds ("" when no state was ever recorded), and whether it may
    have changed since that state was saved."""

    message_id: str
    dirty: bool
    restoring: bool


class ChatHistory:
    """The states of one chat's folder, by message. See the module's docstring."""

    def __init__(self, core: Core, ref: ChatRef) -> None:
        self._core = core
        self._ref = ref

    @property
    def folder(self) -> Path:
        return self._core.layout.saved_state(self._ref.user_key, self._ref.chat_key) / HISTORY_DIR

    def _files(self) -> History:
        return History(self.folder, self._ref.path, self._core.owner)

    async def head(self) -> HistoryHead:
        head = await _on_disk(self._files().read_head)
        return HistoryHead(head.message_id, head.dirty, head.restoring)

    async def claim(self, message_id: str) -> None:
        """The folder is about to change for `message_id`'s answer (a run, an upload)."""
        await _on_disk(lambda: self._files().claim(message_id))

    async def has(self, message_id: str) -> bool:
        return await _on_disk(lambda: self._files().has_state(message_id))

    async def descends(self, message_id: str, ancestor: str) -> bool:
        """Whether `message_id`'s state (the head's, or a saved one) was made, through the states it
        came from, from `ancestor`'s (or is it). False when that cannot be told (a state not kept)."""
        return await _on_disk(lambda: self._files().descends(message_id, ancestor))

    async def receive(self, message_id: str, incoming: Incoming) -> str:
        """Put a file that arrived whole (an upload link's) into `message_id`'s saved state rather
        than the folder: it belongs to that message, and the folder holds another branch now. Returns
        its path. HistoryError when that state is no longer kept (the upload is still staged then);
        FileExists when the state has that path already."""
        files = self._files()
        if not await _on_disk(lambda: files.has_state(message_id)):
            raise HistoryError("its saved files are no longer kept")
        try:
            return await incoming.finish_aside(lambda path, src: files.add_file(message_id, path, src))
        except OSError as error:
            raise disk_error(error, "the file could not be added to that message's saved files") from error

    async def keep_too(self, message_id: str, path: str) -> None:
        """The folder's file at `path` belongs to `message_id`'s saved state as well (an upload for that
        message that arrived on a branch continuing it). HistoryError when that state is not kept."""
        what = "the file could not be added to that message's saved files"
        await _on_disk(lambda: self._files().add_live_file(message_id, path), what)

    async def save(
        self, message_id: str, *, keep_states: int, keep_kernels: int, room_bytes: int | None
    ) -> Saved:
        """Record the folder (and the chat's imports) as `message_id`'s state; older states of this
        chat beyond `keep_states`, and Python states beyond `keep_kernels`, go. Then the states of all
        of the user's chats must fit in `room_bytes` (what the user's storage limit leaves after their
        files; None: no bound): the oldest Python states go first, then the oldest states, whichever
        chat they belong to, never the one just saved. HistoryError (with why) when it cannot be kept;
        DiskFull or StorageError for the disk's own."""
        ref = self._ref
        imports = await self._core.read(lambda tx: _index.import_rows(tx, ref.user_key, ref.chat_key))
        files = self._files()
        saved = await _on_disk(
            lambda: files.save(message_id, imports, keep_states=keep_states, keep_kernels=keep_kernels),
            "the answer's state could not be saved",
        )
        if room_bytes is None:
            return saved
        shed, charge = await self._bound_user(room_bytes, digest(message_id))
        return dataclasses.replace(saved, dropped=saved.dropped + shed, history_bytes=charge)

    async def _bound_user(self, room_bytes: int, keep: str) -> tuple[int, int]:
        """Drop states of the user's chats, oldest first (their Python states before them), until all
        of them together take at most `room_bytes`; never the state `keep` of this chat. Another chat
        busy with a step (its lock held) is left alone: its own next save bounds it. Returns how many
        states went, and what this chat's states take now. Called holding this chat's lock."""
        ref, core = self._ref, self._core

        def measure() -> tuple[dict[str, History], dict[str, int]]:
            found = user_histories(core.layout, ref.user_key, core.owner)
            found.setdefault(ref.chat_key, self._files())
            return found, {chat: history.charge() for chat, history in found.items()}

        histories, charges = await _on_disk(measure)  # one stats file per chat
        if sum(charges.values()) <= room_bytes:
            return 0, charges[ref.chat_key]
        own = histories[ref.chat_key]

        def order() -> list[tuple[bool, float, str, str]]:
            found: list[tuple[bool, float, str, str]] = []
            for chat, history in histories.items():
                for age, state, python in history.sheddable():
                    if python:
                        found.append((False, age, chat, state))  # Python states first, oldest first
                    if not (chat == ref.chat_key and state == keep):
                        found.append((True, age, chat, state))
            return sorted(found)

        candidates = await _on_disk(order)
        held: dict[str, Lock | None] = {}
        shed = 0
        try:
            for whole, _, chat, state in candidates:
                if sum(charges.values()) <= room_bytes:
                    break
                history = histories[chat]
                if history is not own:
                    if chat not in held:
                        lock = core.backend.chat_lock(ref.user_key, chat)
                        held[chat] = lock if await lock.try_acquire() else None
                    if held[chat] is None:
                        continue
                charges[chat] = await _on_disk(functools.partial(history.shed, state, python_only=not whole))
                shed += whole
        finally:
            for taken in held.values():
                if taken is not None:
                    await taken.release()
        return shed, charges[ref.chat_key]

    async def restore(self, message_id: str) -> Restored:
        """Put `message_id`'s state back into the folder, and the chat's imports as they were then.
        HistoryError (with why) when it is no longer kept or is damaged; the folder is then as it was.
        The caller brings the index in line (`session.reconcile()`)."""
        files = self._files()
        what = "the saved state could not be put back"
        state = await _on_disk(lambda: files.begin_restore(message_id), what)
        restored = await _on_disk(lambda: files.restore(state), what)
        await self._set_imports(list(state.imports))
        return restored

    async def restore_empty(self, message_id: str) -> Restored:
        """The folder as a new chat has it (empty), recorded as `message_id`'s."""
        restored = await _on_disk(
            lambda: self._files().restore_empty(message_id), "the folder could not be emptied"
        )
        await self._set_imports([])
        return restored

    async def _set_imports(self, rows: list[tuple[str, str]]) -> None:
        core, ref = self._core, self._ref
        now = time.time()

        async def write(tx: Tx) -> None:
            sid = await core.session_id(tx, ref, now)
            await _index.replace_imports(tx, sid, rows, now)

        await core.write(write)

    async def kernel_dir(self, message_id: str) -> Path:
        """Where the Python state of `message_id`'s state goes (the folder made, private)."""
        return await _on_disk(lambda: self._files().kernel_dir(message_id))

    async def kernel_of(self, message_id: str) -> Path | None:
        """The folder holding the Python state saved with `message_id`'s state, if there is one."""
        return await _on_disk(lambda: self._files().kernel_of(message_id))

    async def drop_kernel(self, message_id: str) -> None:
        await _on_disk(lambda: self._files().drop_kernel(message_id))

    async def bytes_on_disk(self) -> int:
        return await _on_disk(self._files().bytes_on_disk)

    # ---- the runs' records (storage/_history_runs.py) ------------------------------------------------

    async def add_run(
        self,
        message_id: str,
        *,
        language: str,
        code: str,
        outcome: str,
        stdout: str,
        stderr: str,
        figures: list[str],
    ) -> None:
        """Record one run of `message_id`'s answer, its figures read from the folder now."""
        files = self._files()

        def work() -> None:
            entry = run_entry(
                files.live_dir,
                language=language,
                code=code,
                outcome=outcome,
                stdout=stdout,
                stderr=stderr,
                figures=figures,
            )
            RunRecords(files.folder).add(message_id, entry)

        await _on_disk(work, "the run's record could not be kept")

    async def runs(self, message_ids: list[str]) -> dict[str, AnswerRuns]:
        """The records of these answers' runs that are kept, by message id."""
        return await _on_disk(lambda: RunRecords(self.folder).runs_of(message_ids))

    # ---- a clone's start (storage/_history_import.py) -------------------------------------------------

    async def origin(self) -> CloneStart | None:
        """What `note_origin` recorded, or None: this chat never took a state from another."""
        return await _on_disk(lambda: read_start(self.folder.parent / ORIGIN))

    async def note_origin(self, start: CloneStart) -> None:
        """This chat's start from another chat happened (whatever it brought): never again."""
        await _on_disk(
            lambda: write_start(self.folder.parent / ORIGIN, start), "the clone's start could not be noted"
        )

    async def import_from(
        self, source: ChatHistory, candidates: list[str], room: Room, *, python: bool, records: bool
    ) -> Imported:
        """Copy the source chat's state of the first of `candidates` (nearest first) that it keeps into
        this chat's history as that message's state: the files that fit `room`, its Python state when
        `python`, and the records of the runs of `candidates` when `records`. Called holding both
        chats' locks; the caller restores the state into the folder (`restore`)."""
        mine, theirs = self._files(), source._files()

        def work() -> Imported:
            imported = import_state(theirs, mine, candidates, room, python=python)
            if records and imported.message_id:
                copied = RunRecords(mine.folder)
                RunRecords(theirs.folder).copy_to(copied, candidates)
                mine.note_run_bytes(copied.bound())  # counted now: the clone's first save may be a while off
            return imported

        return await _on_disk(work, "the state of the chat this one was cloned from could not be copied")


def user_histories(layout: Layout, user_key: str, owner: Owner) -> dict[str, History]:
    """The histories of every chat of one user that has one, by chat key (blocking)."""
    found: dict[str, History] = {}
    folder = layout.state / user_key
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return found
    for name in names:
        if not name.endswith(".kernel"):
            continue
        chat_key = name[: -len(".kernel")]
        history = folder / name / HISTORY_DIR
        if history.is_dir() and not history.is_symlink():
            found[chat_key] = History(history, layout.session_dir(user_key, chat_key), owner)
    return found
