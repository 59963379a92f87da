"""Whether a chat is a clone, and of what, by Open WebUI 0.12.4's own rules.

Open WebUI's clone and fork (`routers/chats.py`: `clone_chat_by_id`, `clone_shared_chat_by_id`,
`fork_chat_by_id`) write `originalChatId` and `branchPointMessageId` into the new chat's JSON. That JSON
is the user's to write (`POST /api/v1/chats/new` takes any), so the two fields are a claim: this module
proves it or drops it.

* The clone must be the user's own chat.
* `originalChatId` is a chat id, or a share's id (a clone or fork of a shared snapshot records the
  share's token, the id of the snapshot it read).
* The user owns the source: its files and Python state may come (`python`).
* The source is shared with the user the way Open WebUI lets them read its files
  (`utils/access_control/files.py has_access_to_file`: a read grant on the shared chat for the user, a
  group of theirs or every user; or `Chats.get_accessible_chat_by_id`: an admin with admin chat access,
  a share in "continue" mode, a shared folder): its files may come, never its Python state.
* Anything else: None, and nothing is said.

The branch point must be a message of the tree the user may see (the snapshot's, for a snapshot they
were given; the chat's own otherwise); the lineage is walked in that tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .access import read_granted

__all__ = ["CloneSource", "clone_source", "walk_up"]

# Messages walked up a chat's tree at most (a longer chat is followed no further).
_MAX_LINEAGE = 100_000


@dataclass(frozen=True, slots=True)
class CloneSource:
    """The source chat, its owner, the branch point and the messages above it (nearest first), whether
    its Python state may come, and whether it is gone (then only `chat_id` and `owner_id`, the
    cloner's own id, mean anything)."""

    chat_id: str
    owner_id: str
    lineage: tuple[str, ...]
    python: bool
    deleted: bool = False


async def clone_source(chat_id: str, user_id: str) -> CloneSource | None:
    from open_webui.models.chats import Chats
    from open_webui.models.shared_chats import SharedChats
    from open_webui.models.users import Users

    chat = await Chats.get_chat_by_id_and_user_id(chat_id, user_id)
    if chat is None:
        return None
    data = chat.chat or {}
    claimed, point = data.get("originalChatId"), data.get("branchPointMessageId")
    if not isinstance(claimed, str) or not isinstance(point, str) or not claimed or not point:
        return None
    if claimed == chat_id:
        return None
    shared = await SharedChats.get_by_id(claimed)  # a snapshot's token, as a shared clone records it
    source_id = shared.chat_id if shared is not None else claimed
    source = await Chats.get_chat_by_id(source_id)
    if source is None:
        # Gone: only the cloner's own chat may be said to be (our store tells whose it was).
        return CloneSource(source_id, user_id, (point,), True, deleted=True)
    if source.user_id == user_id:
        messages = await _live_messages(source)
        return _with_lineage(source_id, user_id, messages, point, python=True)
    user = await Users.get_user_by_id(user_id)
    if user is None:
        return None
    if await Chats.get_accessible_chat_by_id(source_id, user) is not None:
        return _with_lineage(source_id, source.user_id, await _live_messages(source), point, python=False)
    snapshot = shared if shared is not None else await SharedChats.get_by_chat_id(source_id)
    # A read grant on the shared chat is what lets them open its files (a link alone does not).
    if snapshot is None or not await read_granted(user_id, "shared_chat", source_id):
        return None
    history = (snapshot.chat or {}).get("history") or {}
    messages = history.get("messages") if isinstance(history, dict) else None
    return _with_lineage(source_id, source.user_id, messages, point, python=False)


async def _live_messages(source: Any) -> dict[str, Any] | None:
    from open_webui.models.chats import Chats

    messages = await Chats.get_messages_map_by_chat_id(source.id)
    if messages:
        return dict(messages)
    history = (source.chat or {}).get("history") or {}
    found = history.get("messages") if isinstance(history, dict) else None
    return found if isinstance(found, dict) else None


def _with_lineage(
    source_id: str, owner_id: str, messages: dict[str, Any] | None, point: str, *, python: bool
) -> CloneSource | None:
    if not isinstance(messages, dict) or not isinstance(messages.get(point), dict):
        return None  # not a message of the tree the user may see
    chain, _ = walk_up(messages, point)
    return CloneSource(source_id, owner_id, tuple(chain), python)


def walk_up(messages: dict[str, Any], message_id: str) -> tuple[list[str], bool]:
    """`message_id` (a message of `messages`) and the messages above it, nearest first, and whether
    the walk reached the conversation's start. A cycle or the cap ends it; a set keeps it linear."""
    chain, seen = [message_id], {message_id}
    current = messages[message_id].get("parentId")
    while isinstance(current, str) and current and current not in seen and len(chain) < _MAX_LINEAGE:
        chain.append(current)
        seen.add(current)
        above = messages.get(current)
        if not isinstance(above, dict):
            return chain, False  # a message the chat no longer holds: the start is unknown
        current = above.get("parentId")
    return chain, current is None
