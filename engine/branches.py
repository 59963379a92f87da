"""Workspaces that follow the conversation: each answer continues from the files and Python state of
the message it continues from, also after a regenerate, an edit, or a switch to another branch.

A chat is a tree of messages. At the end of an answer that changed the folder, its state is saved
(`end_turn`: the folder's files, storage's `session.history`, and a copy of the live kernel, runner's
`KernelPool.snapshot`). Before an answer first changes anything (`ensure`, under the chat's lock, before
each run and each upload), the folder and kernel are checked against the message it continues from:

* continuing the newest answer (the tip) costs nothing;
* another branch: the folder and kernel are put back to that message's state, and the answer says so;
* a message whose state is no longer kept: the answer continues from the latest state, and says so.

The message the answer continues from is the nearest message above it in the chat's tree that has a
state (messages that ran nothing have none: theirs is their parent's). An answer interrupted by another
branch's step (two tabs on one chat) gets its own half-done state back the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from runner import KernelPool
from storage import HistoryError, Session, StorageError

from .settings import Settings

__all__ = ["RESTORED", "Branches", "Lineage", "Turn"]

log = logging.getLogger("code_sessions.engine")

RESTORED = "Restored the files and Python state of the message you are continuing from."
RESTORED_FILES = (
    "Restored the files of the message you are continuing from; its Python state is no longer kept."
)
RESTORED_FILES_ONLY = "Restored the files of the message you are continuing from."
NOT_KEPT = (
    "The files and Python state of the message you are continuing from are no longer kept ({why}); this "
    "answer continues from the chat's latest files and state."
)
_FRESH_PYTHON = "the message you are continuing from kept its files but not its Python state"
# What `_continues_from` says of a branch whose states above are all gone (a lineage read whole).
_GONE = "\0gone"
_REMEMBERED = 1000  # answers whose branch sentences wait for their first run, at most
_START = "the start of the conversation"


Lineage = Callable[[], Awaitable[tuple[Sequence[str], bool]]]


@dataclass(frozen=True, slots=True)
class Turn:
    """Where an answer is in the conversation: its own message's id; the message its user message
    continues (when the request said); and `lineage`, which asks the host for the ids above it,
    nearest first (its user message, the answer that one continues, and so on up), with whether
    they reach the conversation's start: asked only when the answer does not continue the newest."""

    message_id: str
    lineage: Lineage
    continues: str | None = None


class _Services(Protocol):
    """What following the branches needs of the services (engine/service.py Engine)."""

    kernels: KernelPool | None
    lock_timeout_s: float


class _Chat(Protocol):
    """What following the branches needs of a chat (engine/service.py ChatSession)."""

    session: Session
    settings: Settings
    turn: Turn | None
    follows: str | None  # the message whose state this answer was found to continue from

    @property
    def kernel_key(self) -> str: ...


class Branches:
    """The branch-following of one set of services (Engine.branches)."""

    def __init__(self, services: _Services) -> None:
        self._services = services
        self._ending: set[asyncio.Task[None]] = set()
        # What following an answer's branch said, until the answer's first run tells the model: the
        # Filter's inlet restores, the Tool's run (another ChatSession of the same answer) says it.
        self._said: dict[tuple[str, str, str], list[str]] = {}

    def take_said(self, chat: _Chat) -> list[str]:
        """What following this answer's branch said and no run has told the model yet; then forgotten."""
        if chat.turn is None:
            return []
        return self._said.pop((chat.session.user_key, chat.session.chat_key, chat.turn.message_id), [])

    def _remember(self, chat: _Chat, said: list[str]) -> list[str]:
        if said and chat.turn is not None:
            if len(self._said) >= _REMEMBERED:
                self._said.pop(next(iter(self._said)))  # the oldest: its answer never ran code here
            self._said[(chat.session.user_key, chat.session.chat_key, chat.turn.message_id)] = said
        return said

    async def ensure(self, chat: _Chat, *, changing: bool) -> list[str]:
        """Under the chat's lock: put the folder and kernel at the state the answer continues from;
        `changing`: the answer is about to change them (a run, an upload), so the folder becomes its.
        Returns what to say (nothing when it continues the newest answer)."""
        turn, settings = chat.turn, chat.settings.branches
        if turn is None or settings.states == 0:
            return []
        history = chat.session.history
        head = await history.head()
        if head.message_id == turn.message_id and not head.restoring:
            return []  # this answer's own state: a later run of it
        if chat.follows == head.message_id and not (head.dirty or head.restoring):
            if changing:  # the state this answer was found to continue from, still in place
                await history.claim(turn.message_id)
            return []
        target = await self._continues_from(chat, turn, head.message_id)
        if head.restoring and target in (None, _GONE):
            target = head.message_id  # a restore that did not finish (a crash): finished now
        if target in (None, _GONE) and not head.restoring:  # unknown, or gone: it goes on as it is
            chat.follows = head.message_id
            if changing:
                await history.claim(turn.message_id)
            gone = target == _GONE and head.message_id
            return self._remember(
                chat, [NOT_KEPT.format(why="only the newest answers' states are kept")] if gone else []
            )
        if target == head.message_id and not head.restoring:
            if head.dirty and head.message_id:  # the newest answer ended without its state saved
                await self._save(chat, head.message_id)
            chat.follows = head.message_id
            if changing:
                await history.claim(turn.message_id)
            return []
        if head.message_id and head.dirty and not head.restoring:
            await self._save(chat, head.message_id)  # the branch we leave keeps its work
        said = await self._restore(chat, target, known=bool(head.message_id))
        chat.follows = (await history.head()).message_id
        if changing:
            await history.claim(turn.message_id)
        return self._remember(chat, said)

    async def _continues_from(self, chat: _Chat, turn: Turn, head: str) -> str | None:
        """The message whose state this answer continues from: its own (it was interrupted), the
        nearest above it with a state or holding the folder now, "" for the start of the chat, _GONE
        when the states above it are no longer kept, or None when the host cannot say."""
        history = chat.session.history
        if await history.has(turn.message_id):
            return turn.message_id
        if turn.continues is not None and turn.continues == head:
            return head  # the newest answer, continued: no need to read the chat's tree
        try:
            ids, complete = await turn.lineage()
        except Exception as error:  # the host's database: continue as things are
            log.warning("code-sessions: the chat's messages could not be read: %s", error)
            return None
        above = [m for m in ids if m and m != turn.message_id]
        for message in above:
            if message == head or await history.has(message):
                return message
        # Nothing above has a state: the start of the conversation when the answer's user message is
        # its first message; else the states it continues from are no longer kept.
        if not complete:
            return None
        return "" if len(above) <= 1 else _GONE

    async def _restore(self, chat: _Chat, target: str | None, *, known: bool) -> list[str]:
        session = chat.session
        history = session.history
        if target is None or target == _GONE:  # a restore that was under way, where the host cannot say
            return [NOT_KEPT.format(why="the chat's messages could not be read")] if known else []
        if target == "" and not known:
            return []  # the first answer of a chat the history never saw: nothing to restore
        try:
            if target == "":
                await history.restore_empty(chat.turn.message_id if chat.turn else "")
            else:
                await history.restore(target)
        except HistoryError as error:
            return [NOT_KEPT.format(why=str(error))]
        except (StorageError, OSError) as error:
            log.warning("code-sessions: a state could not be restored: %s", error)
            return [NOT_KEPT.format(why=f"it could not be read back: {error}")]
        await session.reconcile(enforce_quotas=False)  # the index follows the disk (kept: no quota)
        kernels = self._services.kernels
        if kernels is None:  # kernel=fresh: every run starts anew anyway
            return [RESTORED_FILES_ONLY if target else _start_sentence()]
        image = await history.kernel_of(target) if target else None
        reason = _FRESH_PYTHON if target else ""
        if target == "":
            await kernels.stop(chat.kernel_key, _START, forget=True, state_dir=session.state_path)
        else:
            await kernels.rewind(chat.kernel_key, session.state_path, image, reason)
        if not target:
            return [_start_sentence()]
        return [RESTORED if image is not None else RESTORED_FILES]

    # ------------------------------------------------------------------ the end of an answer

    def end_turn_soon(self, chat: _Chat) -> None:
        """The answer is over: save its state in the background (the chat's next step waits for it on
        the chat's lock)."""
        if chat.turn is None or chat.settings.branches.states == 0:
            return
        task = asyncio.ensure_future(self.end_turn(chat))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def end_turn(self, chat: _Chat) -> None:
        turn = chat.turn
        if turn is None or chat.settings.branches.states == 0:
            return
        try:
            async with chat.session.lock(timeout=self._services.lock_timeout_s):
                head = await chat.session.history.head()
                if head.message_id == turn.message_id and head.dirty and not head.restoring:
                    await self._save(chat, turn.message_id)
        except Exception as error:  # a state not saved is a branch that says so later, never a crash
            log.warning("code-sessions: the state of message %r was not saved: %s", turn.message_id, error)

    async def settle(self) -> None:
        """Wait for the states being saved (a process going away, a test)."""
        if self._ending:
            await asyncio.gather(*list(self._ending), return_exceptions=True)

    async def _save(self, chat: _Chat, message_id: str) -> None:
        """Save the folder and the kernel as `message_id`'s state (under the chat's lock)."""
        session, settings = chat.session, chat.settings
        history = session.history
        room = await _room(chat)
        kernels = self._services.kernels
        if kernels is not None and settings.branches.python_states > 0:
            into = await asyncio.to_thread(history.kernel_dir, message_id)
            image, why = await kernels.snapshot(
                chat.kernel_key, into, state_dir=session.state_path, max_bytes=room
            )
            if not image:
                log.info("code-sessions: no Python state kept for message %r: %s", message_id, why)
                await history.drop_kernel(message_id)
        try:
            saved = await history.save(
                message_id,
                keep_states=settings.branches.states,
                keep_kernels=settings.branches.python_states,
                room_bytes=room,
            )
        except (HistoryError, StorageError, OSError) as error:
            log.warning("code-sessions: the state of message %r was not saved: %s", message_id, error)
            with contextlib.suppress(Exception):
                await history.drop_kernel(message_id)
            return
        log.info(
            "code-sessions: state of message %r saved (%d files, %d copied, %d B of history)",
            message_id,
            saved.files,
            saved.copied_files,
            saved.history_bytes,
        )


async def _room(chat: _Chat) -> int | None:
    """What the chat's history may take: what the user's storage limit leaves after their files and
    download copies (None: no limit). The history yields to files, never the other way."""
    limit = chat.settings.policy.quotas.max_bytes_per_user
    if limit is None:
        return None
    usage = await chat.session.user_usage()
    return max(0, limit - usage.bytes)


def _start_sentence() -> str:
    return "Started again from an empty /mnt/data and a new Python state, as at the start of this chat."
