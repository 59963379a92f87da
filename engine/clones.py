"""A cloned chat starts where its source was: at the clone's first answer, the files and Python state of
the message it was cloned at (the nearest state at or above it in the source's tree) are copied into the
clone's own folder and state, so that later changes on either side never reach the other.

What the host says of a clone is a claim checked by the host against its own access rules
(`Origin`, made by webui's `OpenWebUI.clone_origin`): the clone's owner owns the source (its files and
Python state come), or the source is shared with them so that its files are theirs to read (the files
come, never the Python state: it may hold what its owner typed). Anything else is not a clone here:
nothing is copied and nothing is said. Each clone starts once (`ChatHistory.note_origin`), says what it
brought in one sentence, and the engine's branch-following goes on from there (engine/branches.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Protocol

from runner import KernelPool
from storage import CloneStart, Imported, Room, Session, StorageError, Store, human_bytes

from .settings import Settings

__all__ = ["Origin", "OriginCall", "start_clone"]

log = logging.getLogger("code_sessions.engine")

_EMPTY = "an empty /mnt/data and a new Python state"
_DELETED = f"This chat was cloned from a chat that has since been deleted: it starts with {_EMPTY}."
_NOT_KEPT = (
    "This chat was cloned, but the files of the message it was cloned at are no longer kept: it starts "
    f"with {_EMPTY}."
)


class Origin(Protocol):
    """Where a cloned chat comes from, as the host proved it (`Host.clone_origin`; webui's
    `CloneSource`). `chat_id` and `owner_id`: the source chat and whose files they are; `lineage`: the
    message it was cloned at and the messages above it in the source's tree as the cloner may see it,
    nearest first; `python`: the cloner owns the source, so its Python state comes too; `deleted`: the
    source is gone (the cloner's own chat, deleted)."""

    @property
    def chat_id(self) -> str: ...

    @property
    def owner_id(self) -> str: ...

    @property
    def lineage(self) -> Sequence[str]: ...

    @property
    def python(self) -> bool: ...

    @property
    def deleted(self) -> bool: ...


OriginCall = Callable[[], Awaitable[Origin | None]]


class StateServices(Protocol):
    """What moving a chat's files and Python state needs of the services (engine/service.py Engine):
    a clone's start here, following the branches in engine/branches.py."""

    store: Store
    kernels: KernelPool | None
    lock_timeout_s: float


class StateChat(Protocol):
    """What moving a chat's files and Python state needs of the chat (engine/service.py ChatSession)."""

    session: Session
    settings: Settings

    @property
    def kernel_key(self) -> str: ...


SaveSource = Callable[[Session, str], Awaitable[None]]


async def start_clone(
    services: StateServices, chat: StateChat, origin_of: OriginCall, save_source: SaveSource
) -> list[str]:
    """Under the chat's lock, at an answer of a chat whose folder holds no state yet: when the chat is
    a clone (`origin_of`, the host's word), copy its source's state in and restore it. Returns what to
    say (one sentence, or none). `save_source` saves the source's folder as its head's state (what its
    own answer's end does) when that state is the one to copy and is not saved yet."""
    history = chat.session.history
    if await history.origin() is not None:
        return []
    try:
        origin = await origin_of()
    except Exception as error:  # the host's database: not now; the next answer asks again
        log.warning("code-sessions: whether this chat is a clone could not be read: %s", error)
        return []
    if origin is None:
        await history.note_origin(CloneStart())
        return []
    note = CloneStart(origin.chat_id, origin.python)
    if origin.deleted:
        own = await services.store.indexed_session(chat.session.user_id, origin.chat_id)
        await history.note_origin(replace(note, why="deleted"))
        return [] if own is None else [_DELETED]
    if await chat.session.files.list():
        await history.note_origin(replace(note, why="the folder has files already"))
        return []  # files came in before its first state (branch states were off): never replaced
    source = await services.store.indexed_session(origin.owner_id, origin.chat_id)
    if source is None:
        await history.note_origin(replace(note, why="not kept"))
        return [_NOT_KEPT]
    lock = services.store.chat_lock(source)
    await lock.acquire(services.lock_timeout_s, what="the chat this one was cloned from")
    try:
        head = await source.history.head()
        if head.dirty and not head.restoring and head.message_id in origin.lineage:
            await save_source(source, head.message_id)  # the source's newest answer, not saved yet
        imported = await history.import_from(
            source.history,
            list(origin.lineage),
            await _room(chat),
            python=origin.python and _python_kept(services, chat),
            records=origin.python,
        )
    except StorageError as error:
        log.warning("code-sessions: a clone's start could not be copied: %s", error)
        imported = Imported()
    finally:
        await lock.release()
    why = "" if imported.message_id else "not kept"
    await history.note_origin(replace(note, state=imported.message_id, files=imported.files, why=why))
    if not imported.message_id:
        return [_NOT_KEPT]
    try:
        await history.restore(imported.message_id)
        await chat.session.reconcile(enforce_quotas=False)  # what fits was chosen before the copy
        kernels = services.kernels
        if kernels is not None and imported.python:
            image = await history.kernel_of(imported.message_id)
            await kernels.rewind(chat.kernel_key, chat.session.state_path, image, "")
    except StorageError as error:
        log.warning("code-sessions: a clone's start could not be restored: %s", error)
        return [_NOT_KEPT]
    return [_sentence(origin, imported)]


def _python_kept(services: StateServices, chat: StateChat) -> bool:
    settings = chat.settings
    return (
        services.kernels is not None
        and settings.branches.python_states > 0
        and settings.kernels.max_image_bytes != 0
    )


async def _room(chat: StateChat) -> Room:
    """What the cloner's storage still takes: files, bytes, the largest file, and for the Python
    state what is left after the files (states yield to files)."""
    quotas = chat.settings.policy.quotas
    usage = await chat.session.user_usage()
    files = None if quotas.max_files_per_user is None else max(0, quotas.max_files_per_user - usage.files)
    room = None if quotas.max_bytes_per_user is None else max(0, quotas.max_bytes_per_user - usage.bytes)
    return Room(
        files=files,
        bytes=room,
        file_bytes=quotas.max_file_bytes,
        python_bytes=room,
        image_bytes=chat.settings.kernels.max_image_bytes,
    )


def _sentence(origin: Origin, imported: Imported) -> str:
    """What a clone's first answer says of its start, in one sentence."""
    files = f"{imported.files} files" if imported.files != 1 else "1 file"
    if imported.skipped:
        files += (
            f" of {imported.files + imported.skipped} (the other {imported.skipped}, "
            f"{human_bytes(imported.skipped_bytes)}, do not fit in your storage)"
        )
    if not origin.python:
        return (
            f"This chat is a clone of a chat shared with you: it starts from its {files} at the message it "
            "was cloned at, copied here, but not its Python state, which stays with its owner (it may hold "
            "what they typed)."
        )
    if imported.python:
        return (
            f"This chat is a clone: it starts from the {files} and the Python state of the chat it was "
            "cloned from, as they were at the message it was cloned at, copied here (changes on either "
            "side stay on that side)."
        )
    why = "does not fit in your storage" if imported.python_why == "too large" else "is no longer kept"
    return (
        f"This chat is a clone: it starts from the {files} of the chat it was cloned from, as they were at "
        f"the message it was cloned at, copied here, and a new Python state (that message's {why})."
    )
