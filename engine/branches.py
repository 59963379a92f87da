"""Workspaces that follow the conversation: each answer continues from the files and Python state of
the message it continues from, also after a regenerate, an edit, or a switch to another branch.

A chat is a tree of messages. At the end of an answer that changed the folder, its state is saved
(`save_answer`: the folder's files, storage's `session.history`, and a copy of the live kernel, runner's
`KernelPool.snapshot`). Before an answer first changes anything (`ensure`, under the chat's lock, before
each run and each upload), the folder and kernel are checked against the message it continues from:

* continuing the newest answer (the tip) costs nothing;
* another branch: the folder and kernel are put back to that message's state, and the answer says so;
* a message whose state is no longer kept: the answer continues from the latest state, and says so;
* a place the tree does not prove (an API caller's answer, filed with no parent; a request whose
  earlier turns the tree does not hold): the answer continues from the latest state. Files are
  removed only when the tree positively places the answer on another branch.

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

from storage import HistoryError, Session, StorageError

from .clones import OriginCall, StateChat, StateServices, start_clone
from .settings import Settings

__all__ = ["RESTORED", "Branches", "Lineage", "Place", "said_by_branches"]

log = logging.getLogger("code_sessions.engine")

# What following a branch says: one sentence, in the status line as the answer starts, then under
# the answer's first run (the Pipe's text; the status does not repeat it, engine/loop.py) and to the
# model. A lost Python state is said here alone: the kernel starts anew without a sentence of its own.
RESTORED = "Restored the files and Python state of the message you are continuing from."
RESTORED_FILES = (
    "Restored the files of the message you are continuing from, but not its Python state, which is no "
    "longer kept ({why}): Python starts afresh."
)
RESTORED_FILES_ONLY = "Restored the files of the message you are continuing from."
NOT_KEPT = (
    "The files and Python state of the message you are continuing from are no longer kept ({why}); this "
    "answer continues from the chat's latest files and state."
)
_SAID = (RESTORED, RESTORED_FILES.split("{", 1)[0], RESTORED_FILES_ONLY, NOT_KEPT.split("{", 1)[0])
# What `_continues_from` says of a branch whose states above are all gone (a lineage read whole).
_GONE = "\0gone"
_REMEMBERED = 1000  # answers whose branch sentences wait for their first run, at most
_START = "the start of the conversation"


Lineage = Callable[[], Awaitable[tuple[Sequence[str], bool]]]


@dataclass(frozen=True, slots=True)
class Place:
    """Where an answer is in the conversation: its own message's id; the message its user message
    continues (when the request said); and `lineage`, which asks the host for the ids above it,
    nearest first (its user message, the answer that one continues, and so on up), with whether
    they reach the conversation's start: asked only when the answer does not continue the newest.

    `opens`: the request itself says its user message opens the conversation (it names that message,
    with no parent, and carries no earlier turn). Only then does a tree that ends at that user message
    send the folder back to empty: a tree that says "no parent" because the request left it out (an
    API caller's) is missing information, and files are never removed on it."""

    message_id: str
    lineage: Lineage
    continues: str | None = None
    opens: bool = False
    # Whether the chat is a clone, and of what (the host's word, checked by it: engine/clones.py);
    # asked once, at the first answer that finds no state in the chat's folder.
    origin: OriginCall | None = None


class _Chat(StateChat, Protocol):
    """What following the branches needs of a chat (engine/service.py ChatSession)."""

    place: Place | None
    follows: str | None  # the message whose state this answer was found to continue from


class Branches:
    """The branch-following of one set of services (Engine.branches)."""

    def __init__(self, services: StateServices) -> None:
        self._services = services
        self._ending: set[asyncio.Task[None]] = set()
        # What following an answer's branch said, until the answer's first run tells the model: the
        # Filter's inlet restores, the Tool's run (another ChatSession of the same answer) says it.
        self._said: dict[tuple[str, str, str], list[str]] = {}

    def take_said(self, chat: _Chat) -> list[str]:
        """What following this answer's branch said and no run has told the model yet; then forgotten."""
        if chat.place is None:
            return []
        return self._said.pop((chat.session.user_key, chat.session.chat_key, chat.place.message_id), [])

    def _remember(self, chat: _Chat, said: list[str]) -> list[str]:
        if said and chat.place is not None:
            if len(self._said) >= _REMEMBERED:
                self._said.pop(next(iter(self._said)))  # the oldest: its answer never ran code here
            self._said[(chat.session.user_key, chat.session.chat_key, chat.place.message_id)] = said
        return said

    async def ensure(self, chat: _Chat, *, changing: bool) -> list[str]:
        """Under the chat's lock: put the folder and kernel at the state the answer continues from;
        `changing`: the answer is about to change them (a run, an upload), so the folder becomes its.
        A clone's first answer starts from its source's state (engine/clones.py). Returns what to say
        (nothing when it continues the newest answer)."""
        place = chat.place
        if place is None or chat.settings.branches.states == 0:
            return []
        cloned: list[str] = []
        if place.origin is not None:
            head = await chat.session.history.head()
            if not head.message_id and not head.dirty:  # no state yet: the chat's first answer here

                async def save_source(session: Session, message_id: str) -> None:
                    # The source's folder (its lock held) saved as its answer's end would save it.
                    await self._save(_SourceChat(session, chat.settings), message_id)

                cloned = await start_clone(self._services, chat, place.origin, save_source)
        said = await self._follow(chat, place, changing=changing)
        return self._remember(chat, [*cloned, *said]) if cloned else said

    async def _follow(self, chat: _Chat, place: Place, *, changing: bool) -> list[str]:
        history = chat.session.history
        head = await history.head()
        if head.message_id == place.message_id and not head.restoring:
            return []  # this answer's own state: a later run of it
        if chat.follows == head.message_id and not (head.dirty or head.restoring):
            if changing:  # the state this answer was found to continue from, still in place
                await history.claim(place.message_id)
            return []
        target = await self._continues_from(chat, place, head.message_id)
        if head.restoring and target in (None, _GONE):
            target = head.message_id  # a restore that did not finish (a crash): finished now
        if target in (None, _GONE) and not head.restoring:  # unknown, or gone: it goes on as it is
            chat.follows = head.message_id
            if changing:
                await history.claim(place.message_id)
            gone = target == _GONE and head.message_id
            return self._remember(
                chat, [NOT_KEPT.format(why="only the newest answers' states are kept")] if gone else []
            )
        if target == head.message_id and not head.restoring:
            if head.dirty and head.message_id:  # the newest answer ended without its state saved
                await self._save(chat, head.message_id)
            chat.follows = head.message_id
            if changing:
                await history.claim(place.message_id)
            return []
        if head.message_id and head.dirty and not head.restoring:
            await self._save(chat, head.message_id)  # the branch we leave keeps its work
        said = await self._restore(chat, target, known=bool(head.message_id))
        chat.follows = (await history.head()).message_id
        if changing:
            await history.claim(place.message_id)
        return self._remember(chat, said)

    async def _continues_from(self, chat: _Chat, place: Place, head: str) -> str | None:
        """The message whose state this answer continues from: its own (it was interrupted), the
        nearest above it with a state or holding the folder now, "" for the start of the chat, _GONE
        when the states above it are no longer kept, or None when the host cannot say."""
        history = chat.session.history
        if await history.has(place.message_id):
            return place.message_id
        if place.continues is not None and place.continues == head:
            return head  # the newest answer, continued: no need to read the chat's tree
        try:
            ids, complete = await place.lineage()
        except Exception as error:  # the host's database: continue as things are
            log.warning("code-sessions: the chat's messages could not be read: %s", error)
            return None
        above = [m for m in ids if m and m != place.message_id]
        for message in above:
            if message == head or await history.has(message):
                return message
        # Nothing above has a state: the start of the conversation when the answer's user message is
        # its first message and the request agrees; else the states it continues from are no longer
        # kept. An answer with no user message above it (Open WebUI files an API caller's answer so,
        # with no parent) is not placed by the tree at all: it goes on from the newest state.
        if not complete or not above:
            return None
        if len(above) == 1:
            return "" if place.opens else None
        return _GONE

    async def _restore(self, chat: _Chat, target: str | None, *, known: bool) -> list[str]:
        session = chat.session
        history = session.history
        if target is None or target == _GONE:  # a restore that was under way, where the host cannot say
            return [NOT_KEPT.format(why="the chat's messages could not be read")] if known else []
        if target == "" and not known:
            return []  # the first answer of a chat the history never saw: nothing to restore
        try:
            if target == "":
                await history.restore_empty(chat.place.message_id if chat.place else "")
            else:
                await history.restore(target)
        except HistoryError as error:
            return [NOT_KEPT.format(why=str(error))]
        except StorageError as error:
            log.warning("code-sessions: a state could not be restored: %s", error)
            return [NOT_KEPT.format(why=f"it could not be read back: {error}")]
        await session.reconcile(enforce_quotas=False)  # the index follows the disk (kept: no quota)
        kernels = self._services.kernels
        if kernels is None:  # kernel=fresh: every run starts anew anyway
            return [RESTORED_FILES_ONLY if target else _start_sentence()]
        image = await history.kernel_of(target) if target else None
        if image is None:  # a new kernel, said here alone (its next run says nothing of it)
            await kernels.stop(chat.kernel_key, _START, forget=True, state_dir=session.state_path)
        else:
            await kernels.rewind(chat.kernel_key, session.state_path, image, "")
        if not target:
            return [_start_sentence()]
        if image is not None:
            return [RESTORED]
        return [RESTORED_FILES.format(why=_python_kept(chat.settings))]

    # ------------------------------------------------------------------ the end of an answer

    def save_answer_soon(self, chat: _Chat) -> None:
        """The answer is over: save its state in the background (the chat's next step waits for it on
        the chat's lock)."""
        if chat.place is None or chat.settings.branches.states == 0:
            return
        task = asyncio.ensure_future(self.save_answer(chat))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def save_answer(self, chat: _Chat) -> None:
        place = chat.place
        if place is None or chat.settings.branches.states == 0:
            return
        try:
            async with chat.session.lock(timeout=self._services.lock_timeout_s):
                head = await chat.session.history.head()
                if head.message_id == place.message_id and head.dirty and not head.restoring:
                    await self._save(chat, place.message_id)
        except Exception as error:  # a state not saved is a branch that says so later, never a crash
            log.warning("code-sessions: the state of message %r was not saved: %s", place.message_id, error)

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
            into = await history.kernel_dir(message_id)
            image, why = await kernels.snapshot(
                chat.kernel_key, into, state_dir=session.state_path, max_bytes=room, settings=settings.kernels
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
        except StorageError as error:
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


@dataclass
class _SourceChat:
    """A clone's source as `_save` needs it: its session and settings, with no answer of its own."""

    session: Session
    settings: Settings
    place: Place | None = None
    follows: str | None = None

    @property
    def kernel_key(self) -> str:
        return f"{self.session.user_key}/{self.session.chat_key}"  # as engine/service.py's _kernel_key


async def _room(chat: _Chat) -> int | None:
    """What the states of all of the user's chats may take together: what the user's storage limit
    leaves after their files and download copies (None: no limit). States yield to files, never the
    other way; the oldest of any chat go first (storage's `history.save`)."""
    limit = chat.settings.policy.quotas.max_bytes_per_user
    if limit is None:
        return None
    usage = await chat.session.user_usage()
    return max(0, limit - usage.bytes)


def _python_kept(settings: Settings) -> str:
    """Which answers keep their Python state, for the sentence of one that did not."""
    count = settings.branches.python_states
    if count == 0 or settings.kernels.max_image_bytes == 0:
        return "this server keeps no Python state of earlier answers"
    return f"a chat keeps the Python states of its newest {count} answers, as far as your storage allows"


def said_by_branches(sentence: str) -> bool:
    """Whether a sentence is one that following a branch says (said in the status as the answer starts:
    a run's status does not say it again)."""
    return sentence.startswith(_SAID) or sentence == _start_sentence()


def _start_sentence() -> str:
    return "Started again from an empty /mnt/data and a new Python state, as at the start of this chat."
