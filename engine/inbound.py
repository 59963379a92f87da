"""Files in and out of a chat beyond its runs: upload links (a file POSTed straight into /mnt/data) and
Save to Knowledge (a file of the chat copied into one of the user's Knowledge bases).

What the host does (the HTTP route, Open WebUI's Knowledge API) is handed in; the checks
that are the project's (the path, the per-file limit, the quota, a file never replaced, one use, the
expiry) are made here and in storage, each refusal a sentence the user and the model can read.
"""

from __future__ import annotations

import logging
import posixpath
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from storage import (
    HistoryError,
    Incoming,
    InvalidPath,
    LinkRefused,
    Policy,
    Session,
    StorageBusy,
    StorageError,
    Store,
    UploadGrant,
    UploadLinks,
    Usage,
    human_bytes,
    human_duration,
    split_path,
)

from .markup import code_span, escape_text
from .service import ChatSession
from .settings import LOCK_WAIT_S

log = logging.getLogger("code_sessions.engine")

__all__ = [
    "SAVE_COMMAND",
    "ChatExists",
    "Inbound",
    "Knowledge",
    "NewLink",
    "StoreFor",
    "chat_path",
    "save_command",
    "save_to_knowledge",
]

# What a user types in a chat to copy one of its files into a Knowledge base.
SAVE_COMMAND = "!save-to-knowledge"
_SAVE_USAGE = (
    f"Type {SAVE_COMMAND} <file> <Knowledge base>, for example "
    f"`{SAVE_COMMAND} /mnt/data/report.csv Research` (the base's name or id)."
)

# The store a link's `where` names, and the limits the link was made under (the valves of the message
# that made it: the store's own are the latest message's of whichever worker receives the upload).
StoreFor = Callable[[dict[str, Any]], Awaitable[tuple[Store, Policy]]]
# Whether the host still has this user's chat (user_id, chat_id): an upload link of a chat deleted in
# the host is dead, even before the background maintenance removes the chat's folder.
ChatExists = Callable[[str, str], Awaitable[bool]]
_GONE = (
    "This upload link's chat no longer exists (it was deleted, or it has expired), so the link takes "
    "nothing. Ask for a new link in a chat that exists."
)


# The host's Knowledge, for one user's message: (target, name, data) -> the sentence for the user.
# `target` is a base's name or id; "" asks for the sentence that names the bases the user may add to
# (engine.Host.save_to_knowledge, bound to the message's request and user).
Knowledge = Callable[[str, str, bytes], Awaitable[str]]


def chat_path(path: str) -> str:
    """A path as the model or the user writes it (`/mnt/data/a.csv`, `a.csv`), relative to the folder.
    Raises InvalidPath with the sentence."""
    path = path.strip().strip("`'\"")
    for prefix in ("/mnt/data/", "mnt/data/"):
        if path.startswith(prefix):
            path = path[len(prefix) :]
            break
    if path.startswith("/"):
        raise InvalidPath(f"{path} is outside /mnt/data; only this chat's files can be used")
    return "/".join(split_path(path))


def save_command(text: str) -> tuple[str, str] | None:
    """(file, Knowledge base) when the message is the save command (either may be empty), else None."""
    text = text.strip()
    if text != SAVE_COMMAND and not text.startswith(SAVE_COMMAND + " "):
        return None
    rest = text[len(SAVE_COMMAND) :].strip()
    try:
        words = shlex.split(rest)
    except ValueError:
        words = rest.split()
    if not words:
        return "", ""
    target = words[1:]
    if target and target[0].lower() in ("to", "into"):
        target = target[1:]
    return words[0], " ".join(target)


async def save_to_knowledge(chat: ChatSession, path: str, target: str, knowledge: Knowledge) -> str:
    """Copy one of the chat's files into a Knowledge base of the user's (`!save-to-knowledge`); returns
    the sentence for the user."""
    if not path:
        return f"{_SAVE_USAGE} {escape_text(await knowledge('', '', b''))}"
    try:
        rel = chat_path(path)
    except InvalidPath as error:
        return f"Not saved to Knowledge: {error}."
    shown = code_span("/mnt/data/" + rel)
    if not target:
        listing = escape_text(await knowledge("", "", b""))
        return f"Not saved: say which Knowledge base {shown} goes into. {_SAVE_USAGE} {listing}"
    policy = chat.settings.policy
    try:
        async with chat.session.lock(timeout=chat.lock_timeout_s):  # not mid-run: a whole file
            entries = {entry.path: entry for entry in await chat.session.files.list()}
            if rel not in entries or not await chat.session.files.exists(rel):
                return f"Not saved to Knowledge: {shown} is not a file of this chat."
            size = entries[rel].size
            too_large = policy.file_too_large(size)
            if too_large is not None:
                return f"Not saved to Knowledge: {shown} is {human_bytes(size)}, {too_large}."
            over = policy.over_quota(await chat.session.user_usage())
            if over is not None:
                return f"Not saved to Knowledge: you are {over}. Delete some files first."
            data = await chat.session.files.read(rel)
    except StorageBusy:
        return "Not saved to Knowledge: this chat is busy with a step; try again when it has finished."
    except StorageError as error:
        return f"Not saved to Knowledge: {escape_text(str(error))}"
    # The host's sentence quotes names users chose (the file's, the base's): shown as plain text.
    return escape_text(await knowledge(target, posixpath.basename(rel), data))


@dataclass(frozen=True, slots=True)
class NewLink:
    token: str  # for the URL, and nowhere else
    grant: UploadGrant
    room: int | None  # bytes the user's quota leaves now (None: no byte limit)

    def sentence(self, url: str, max_file_bytes: int | None) -> str:
        """What the model (and through it the user) is told about the link."""
        limits = []
        if max_file_bytes is not None:
            limits.append(f"at most {human_bytes(max_file_bytes)}")
        if self.room is not None:
            limits.append(f"{human_bytes(self.room)} left in the user's storage")
        bound = f" ({', '.join(limits)})" if limits else ""
        grant = self.grant
        minutes = human_duration(round(grant.expires_at - grant.made_at))
        return (
            f"Upload link for /mnt/data/{grant.path}: {url}\n"
            f"It takes one file{bound}, once, within {minutes}. Give the user this link: they open it in "
            "a browser to pick the file, or send it from anywhere as a multipart form field named file, "
            f"for example: curl -F file=@{posixpath.basename(grant.path)} {url}\n"
            "Once it has arrived the file is in /mnt/data; a refused upload tells the sender why."
        )


class Inbound:
    """Upload links and Save to Knowledge for one store of links. `stores` finds the store a link's
    `where` names (the maker's note: a worker that never served the chat may receive the upload)."""

    def __init__(
        self,
        links: UploadLinks,
        stores: StoreFor,
        *,
        chat_exists: ChatExists | None = None,
        lock_timeout_s: float = LOCK_WAIT_S,
    ) -> None:
        self.links = links
        self._stores = stores
        self._chat_exists = chat_exists
        self._lock_timeout_s = lock_timeout_s

    # ---- upload links --------------------------------------------------------------------------------

    async def make_link(
        self, chat: ChatSession, path: str, *, ttl_s: float, where: dict[str, Any]
    ) -> NewLink | str:
        """A link for one file at `path` in this chat: (token, grant), or the sentence why not."""
        try:
            rel = chat_path(path)
        except InvalidPath as error:
            return f"No upload link: {error}."
        files = chat.session.files
        if await files.exists(rel):
            return (
                f"No upload link: {code_span('/mnt/data/' + rel)} exists already, and an upload never "
                "replaces a file. Choose another path."
            )
        policy = chat.settings.policy
        usage = await chat.session.user_usage()
        over = policy.over_quota(Usage(usage.files + 1, usage.bytes))
        if over is not None:
            return f"No upload link: a new file would be {over}. Delete some files first."
        # The file will belong to this answer's state, whatever branch the chat is on when it arrives.
        message_id = await chat.claim_place()
        token, grant = await self.links.mint(
            chat.session.user_id, chat.session.chat_id, rel, ttl_s=ttl_s, where=where, message_id=message_id
        )
        return NewLink(token, grant, policy.room(usage))

    async def peek(self, token: str) -> UploadGrant:
        """What the link grants, if it is alive: LinkRefused when it is unknown, used, expired, or its
        chat is gone (deleted in the host, or its session no longer here); nothing is created."""
        grant = await self.links.peek(token)
        if self._chat_exists is not None:
            try:
                exists = await self._chat_exists(grant.user_id, grant.chat_id)
            except Exception as error:  # the host's database: the link is not used up for it
                raise StorageBusy(f"it could not be checked that the chat still exists ({error})") from error
            if not exists:
                raise LinkRefused(_GONE, "gone")
        await self._session(grant)
        return grant

    async def claim(self, token: str) -> UploadGrant:
        return await self.links.claim(token)

    async def begin(self, grant: UploadGrant) -> Incoming:
        """Start receiving the link's file (the quota and the per-file limit checked as it streams)."""
        _, policy = await self._stores(grant.where)
        session = await self._session(grant)
        return await session.files.incoming(grant.path, policy=policy)

    async def _session(self, grant: UploadGrant) -> Session:
        """The link's chat's session, never made again: LinkRefused when it is gone."""
        store, _ = await self._stores(grant.where)
        session = await store.existing_session(grant.user_id, grant.chat_id)
        if session is None:
            raise LinkRefused(_GONE, "gone")
        return session

    async def finish(self, grant: UploadGrant, incoming: Incoming) -> str:
        """Put the whole file in place under the chat's lock; returns the sentence for the sender.

        The file belongs to the state of the answer that offered the link (`grant.message_id`), like
        the files its runs wrote. The folder takes it when it holds that answer's state, or a state
        that continues from it (the user went on under that answer); the answer's saved state takes
        it too, so that going back to that answer finds it. When the chat is on another branch now (the
        user regenerated or edited an earlier message), only the answer's saved state takes it: the
        other branch's folder is left as it is, and the file is there when the conversation continues
        from that answer. Either way the folder's state is marked as changed, to be saved when its
        branch is left."""
        session = await self._session(grant)
        size = human_bytes(incoming.received)
        async with session.lock(timeout=self._lock_timeout_s):
            history = session.history
            head = await history.head()
            offered = grant.message_id
            on_branch = (
                not offered
                or head.message_id in ("", offered)
                or await history.descends(head.message_id, offered)
            )
            if not on_branch:
                try:
                    path = await history.receive(offered, incoming)
                except HistoryError:  # that answer's state is no longer kept: the chat's files take it
                    pass
                else:
                    return (
                        f"Saved {size} as /mnt/data/{path} with the answer that offered this link. The "
                        "chat shows another branch of the conversation now: the file is there when it "
                        "continues from that answer."
                    )
            path = await incoming.finish()
            if head.message_id:  # the folder changed for the state it holds: saved when its branch is left
                await history.claim(head.message_id)
                if offered and head.message_id != offered:
                    try:
                        await history.keep_too(offered, path)
                    except StorageError as error:  # the folder has it: kept
                        log.info("code-sessions: upload %r not added to message %r: %s", path, offered, error)
        return f"Saved {size} as /mnt/data/{path} in the chat."
