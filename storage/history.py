"""A chat's history by message, as callers see it (`session.history`): save the folder's state at the
end of an answer, and put an earlier answer's state back when the conversation branches from it.

Every call is made holding the chat's lock (`session.lock()`); the file work runs in a thread
(storage/_history.py has the layout and the rules). States live in the chat's saved-state folder,
outside /mnt/data, and go with the session.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from . import _index
from ._backend import Tx
from ._core import ChatRef, Core
from ._history import History, HistoryError, Restored, Saved

__all__ = ["HISTORY_DIR", "ChatHistory", "HistoryError", "HistoryHead", "Restored", "Saved"]

HISTORY_DIR = "history"


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
        head = await asyncio.to_thread(self._files().read_head)
        return HistoryHead(head.message_id, head.dirty, head.restoring)

    async def claim(self, message_id: str) -> None:
        """The folder is about to change for `message_id`'s answer (a run, an upload)."""
        await asyncio.to_thread(self._files().claim, message_id)

    async def has(self, message_id: str) -> bool:
        return await asyncio.to_thread(self._files().has_state, message_id)

    async def save(
        self, message_id: str, *, keep_states: int, keep_kernels: int, room_bytes: int | None
    ) -> Saved:
        """Record the folder (and the chat's imports) as `message_id`'s state; older states beyond
        `keep_states`, kernels beyond `keep_kernels`, and the oldest while the history takes more than
        `room_bytes` go. HistoryError (with why) when it cannot be kept; OSError for the disk's own."""
        ref = self._ref
        imports = await self._core.read(lambda tx: _index.import_rows(tx, ref.user_key, ref.chat_key))
        files = self._files()
        return await asyncio.to_thread(
            files.save,
            message_id,
            imports,
            keep_states=keep_states,
            keep_kernels=keep_kernels,
            room_bytes=room_bytes,
        )

    async def restore(self, message_id: str) -> Restored:
        """Put `message_id`'s state back into the folder, and the chat's imports as they were then.
        HistoryError (with why) when it is no longer kept or is damaged; the folder is then as it was.
        The caller brings the index in line (`session.reconcile()`)."""
        files = self._files()
        state = await asyncio.to_thread(files.begin_restore, message_id)
        restored = await asyncio.to_thread(files.restore, message_id, state)
        await self._set_imports(files.imports_of(state))
        return restored

    async def restore_empty(self, message_id: str) -> Restored:
        """The folder as a new chat has it (empty), recorded as `message_id`'s."""
        restored = await asyncio.to_thread(self._files().restore_empty, message_id)
        await self._set_imports([])
        return restored

    async def _set_imports(self, rows: list[tuple[str, str]]) -> None:
        core, ref = self._core, self._ref
        now = time.time()

        async def write(tx: Tx) -> None:
            sid = await core.session_id(tx, ref, now)
            await _index.replace_imports(tx, sid, rows, now)

        await core.write(write)

    def kernel_dir(self, message_id: str) -> Path:
        """Where the Python state of `message_id`'s state goes (blocking: makes the folder)."""
        return self._files().kernel_dir(message_id)

    async def kernel_of(self, message_id: str) -> Path | None:
        """The folder holding the Python state saved with `message_id`'s state, if there is one."""
        return await asyncio.to_thread(self._files().kernel_of, message_id)

    async def drop_kernel(self, message_id: str) -> None:
        await asyncio.to_thread(self._files().drop_kernel, message_id)

    async def bytes_on_disk(self) -> int:
        return await asyncio.to_thread(self._files().bytes_on_disk)

