"""The Store: a root folder of chat sessions, plus the index that tracks them (a thin face)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from pathlib import Path
from types import TracebackType
from typing import Literal, overload

from . import _expiry, _index, _index_links, _repair
from ._backend import Backend, Lock, Tx
from ._core import Core, Owner, TemporaryChat
from ._fsops import make_dir
from ._keys import id_key
from ._postgres import PostgresBackend, is_postgres_url, redact_url
from ._sqlite import SQLiteBackend
from .errors import DiskFull, StorageError
from .history import user_histories
from .models import (
    ActivityEntry,
    ChatInfo,
    CleanupReport,
    Drift,
    Expiry,
    LinkInfo,
    Purge,
    Quotas,
    RebuildReport,
    Reconcile,
    UserUsage,
)
from .policy import Policy
from .publishing import DirectoryPublisher, Publisher
from .session import Session

log = logging.getLogger("code_sessions.storage")


class Store:
    """Chat sessions under `root`, with quotas, expiry and publishing.

    `policy` (or its parts `quotas` and `expiry`) may be replaced at any time (e.g. when an admin
    changes settings); each operation reads the current value. `owner=(uid, gid)`: when running as
    root, every folder and file the store creates inside session folders is given to that user (the
    sandbox's). `busy_timeout_s`: how long an operation waits for a busy index before StorageBusy.
    `database_url`: where the index lives: None or "" (or an `sqlite:` URL) for an SQLite file under
    root; `postgresql://...` (also `postgres://`, `postgresql+psycopg://`) for tables in a schema of
    their own in that PostgreSQL database, shared by every host that mounts root. `backend`: a
    database backend given directly (overrides database_url). `record_settings=False` (the CLI):
    never write the policy in use into the index. `repair_at_open=False` (the CLI's listings and
    check): open without the start-up repairs (rebuilding a new index from the folders, indexing what
    dead runs left), so they show the index as it is. `temporary_chat(chat_id)`: whether a chat id
    names a temporary chat, whose session expires after `Expiry.temporary_idle_s` (the host knows its
    ids; without it no chat is temporary).
    """

    def __init__(
        self,
        root: Path | str,
        *,
        quotas: Quotas | None = None,
        expiry: Expiry | None = None,
        publisher: Publisher | None = None,
        owner: Owner = None,
        busy_timeout_s: float = 60.0,
        backend: Backend | None = None,
        record_settings: bool = True,
        database_url: str | None = None,
        repair_at_open: bool = True,
        temporary_chat: TemporaryChat | None = None,
    ) -> None:
        self.root = Path(root).absolute()
        # The policy of what is not given one (the CLI, a script): each message's own travels with
        # its session (`session(policy=)`), and expiry's with `cleanup(policy=)`.
        self._policy = Policy(quotas or Quotas(), expiry or Expiry())
        self._core = Core(
            self.root,
            backend or _backend_for(self.root, database_url, busy_timeout_s),
            publisher=publisher,
            owner=owner,
            record_settings=record_settings,
            temporary_chat=temporary_chat,
            reconcile=self.reconcile,
        )
        self._rebuild_put_off = False
        self._repair_at_open = repair_at_open
        self._opened = False

    # ------------------------------------------------------------------ settings

    @property
    def policy(self) -> Policy:
        """The store's own policy (the constructor's): what an operation given none applies."""
        return self._policy

    @property
    def publisher(self) -> Publisher | None:
        return self._core.publisher

    @property
    def owner(self) -> Owner:
        return self._core.owner

    @property
    def backend(self) -> Backend:
        return self._core.backend

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        if self._opened:
            return
        core = self._core
        await asyncio.to_thread(self._make_root)
        opened = await core.backend.open()
        self._opened = True
        try:
            if opened.moved_aside is not None:
                # The one line that says so (the backend's own is at INFO; Core._recover says it
                # for a damage found while open).
                log.warning(
                    "the index %s is corrupt: moved it to %s, and rebuilding it from the folders",
                    core.backend.where,
                    opened.moved_aside,
                )
                with contextlib.suppress(DiskFull):
                    await core.log("corrupt_index", detail={"moved_to": opened.moved_aside})
            if not self._repair_at_open:
                return
            try:
                await self._startup_repairs(rebuild=opened.fresh, moved_aside=opened.moved_aside is not None)
            except DiskFull:
                # Open anyway: every step then says the disk is full, and one that frees space works;
                # the first write that succeeds afterwards does these repairs (Reconcile.AFTER_FULL_DISK).
                log.warning(
                    "the disk holding %s is full: the store opened without its start-up repairs", self.root
                )
                self._rebuild_put_off = opened.fresh
                core.repairs_put_off = True
        except BaseException:
            await self.close()
            raise

    async def _startup_repairs(self, *, rebuild: bool, moved_aside: bool = False) -> None:
        core = self._core
        await self._remember_publisher()
        if rebuild and bool(await asyncio.to_thread(core.layout.session_keys_on_disk)):
            if not moved_aside:
                log.warning(
                    "the index %s is new but session folders exist: rebuilding it", core.backend.where
                )
            report = await self.reconcile(Reconcile.REBUILD)
            log.warning("index rebuilt: %s", report.summary())
        await self.reconcile(Reconcile.INTERRUPTED)

    async def _reconcile_after_full_disk(self) -> None:
        """What a full disk put off, done by the first write that had room again: the sessions used
        meanwhile get their sidecar, row and file rows; the start-up repairs run."""
        core = self._core
        with contextlib.suppress(DiskFull):
            await _repair.reconcile_unsaved(core)
            if core.repairs_put_off:
                await self._startup_repairs(rebuild=self._rebuild_put_off)
                core.repairs_put_off = False
                log.warning("the disk has room again: the start-up repairs of %s are done", self.root)

    async def catch_up(self) -> None:
        """What a full disk put off (sessions used meanwhile without their index row, the start-up
        repairs), done now if the disk has room again; nothing when nothing waits."""
        await self._core.catch_up()

    async def close(self) -> None:
        self._opened = False
        await self.trash_emptied()  # (unlinks in a thread: they would outlive the event loop)
        await self._core.backend.close()

    async def trash_emptied(self) -> None:
        """Wait until the trash that cleanups move expired files into is empty, if its emptying (in the
        background) is under way."""
        await _expiry.trash_emptied(self._core)

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _make_root(self) -> None:
        layout = self._core.layout
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for path in (layout.sessions, layout.state, layout.trash, layout.running, layout.links):
            make_dir(path)

    async def _remember_publisher(self) -> None:
        """Record where folder copies go, so the CLI can clean them without the application."""
        publisher = self._core.publisher
        if not isinstance(publisher, DirectoryPublisher) or not self._core.record_settings:
            return
        directory, prefix = str(publisher.directory), publisher.url_prefix

        async def write(tx: Tx) -> None:
            await _index.set_meta(tx, "publish_dir", directory)
            await _index.set_meta(tx, "url_prefix", prefix)

        await self._core.write(write)

    async def recorded_settings(self) -> tuple[Policy | None, DirectoryPublisher | None]:
        """The policy and folder publisher the application last recorded (for the CLI)."""

        async def read(tx: Tx) -> dict[str, str | None]:
            keys = ("quotas", "expiry", "publish_dir", "url_prefix")
            return {k: await _index.get_meta(tx, k) for k in keys}

        meta = await self._core.read(read)
        policy = None
        try:
            if meta["quotas"] and meta["expiry"]:
                policy = Policy(Quotas(**json.loads(meta["quotas"])), Expiry(**json.loads(meta["expiry"])))
        except (TypeError, ValueError):
            policy = None
        publisher = None
        if meta["publish_dir"] and meta["url_prefix"]:
            publisher = DirectoryPublisher(meta["publish_dir"], meta["url_prefix"])
        return policy, publisher

    def use_publisher(self, publisher: Publisher | None) -> None:
        """Publish through another publisher from now on (links made earlier keep their own)."""
        self._core.publisher = publisher

    # ------------------------------------------------------------------ sessions

    async def session(
        self, user_id: str, chat_id: str, *, policy: Policy | None = None, cached: bool = False
    ) -> Session:
        """The session of (user_id, chat_id): creates its folder and index row if needed and marks it
        used now. `policy`: the quotas its operations apply (a message's; None: the store's own).
        `cached`: not written again when this process marked it used within ENSURED_FOR_S (a chat's
        step: expiry counts in hours and days, and a warm step should not pay a thread's hop and a
        transaction for it). Ids are untrusted strings; any value maps to a safe folder name."""
        ref = self._core.ref(user_id, chat_id)
        unindexed = await self._core.ensure(ref, touch=True, cached=cached)
        return Session(self._core, ref, policy or self._policy, unindexed=unindexed)

    async def existing_session(
        self, user_id: str, chat_id: str, *, policy: Policy | None = None
    ) -> Session | None:
        """The session of (user_id, chat_id) if its folder exists, marked used now; None when it does
        not. Nothing is created: what comes for a chat that is gone (an upload link's file, after the
        chat was deleted) must not bring back its folder or its index row."""
        core = self._core
        ref = core.ref(user_id, chat_id)
        if not await asyncio.to_thread(ref.path.is_dir):
            return None
        now = time.time()
        # A folder without its row is a session a full disk left unsaved: it exists, and the first
        # write with room indexes it.
        await core.write(lambda tx: _index.touch_session(tx, ref.user_key, ref.chat_key, now))
        return Session(core, ref, policy or self._policy)

    async def indexed_session(self, user_id: str, chat_id: str) -> Session | None:
        """The session of (user_id, chat_id) if the index has it, creating and touching nothing:
        another chat's, read from (a clone's source; its operations apply the store's own policy). Its
        `lock()` would create it again: take `chat_lock` instead."""
        ref = self._core.ref(user_id, chat_id)
        row = await self._core.read(lambda tx: _index.session_by_keys(tx, ref.user_key, ref.chat_key))
        return None if row is None else Session(self._core, ref, self._policy)

    def chat_lock(self, session: Session) -> Lock:
        """The lock of a session's chat, taken without re-creating the session (see `indexed_session`)."""
        return self._core.backend.chat_lock(session.user_key, session.chat_key)

    def session_at(self, info: ChatInfo) -> Session:
        """The Session of a listed session row (by its folder keys), without touching it."""
        return Session(
            self._core,
            self._core.ref_at(
                info.user_id, info.chat_id, info.user_key, info.chat_key, recorded_temporary=info.temporary
            ),
            self._policy,
        )

    def lock(self, name: str) -> Lock:
        """A named lock shared by every process of this store (e.g. one background cleanup at a time)."""
        return self._core.backend.named_lock(name)

    def saved_state_path(self, user_key: str, chat_key: str) -> Path:
        """A session's saved-state folder by its keys (see Session.state_path), for a session that
        may already be gone."""
        return self._core.layout.saved_state(user_key, chat_key)

    async def users_usage(self) -> list[UserUsage]:
        """Per user: sessions, files and bytes (from the index), and the bytes of their sessions'
        saved states (from the disk: the index does not track them)."""
        users = await self._core.read(_index.users_usage)
        saved = await asyncio.to_thread(self._core.layout.saved_states)
        rows = await self._core.read(_index.all_sessions)
        owner = {(r.user_key, r.chat_key): r.user_id for r in rows}
        by_user: dict[str, int] = {}
        for user_key, chat_key, size in saved:
            user_id = owner.get((user_key, chat_key))
            if user_id is not None:
                by_user[user_id] = by_user.get(user_id, 0) + size
        layout, core_owner = self._core.layout, self._core.owner

        def branch_states() -> dict[str, tuple[int, int]]:
            counted: dict[str, tuple[int, int]] = {}
            for user_key in {key for key, _, _ in saved}:
                for chat_key, history in user_histories(layout, user_key, core_owner).items():
                    user_id = owner.get((user_key, chat_key))
                    if user_id is not None:
                        states, size = counted.get(user_id, (0, 0))
                        counted[user_id] = (states + len(history.sheddable()), size + history.charge())
            return counted

        branches = await asyncio.to_thread(branch_states)
        return [
            dataclasses.replace(
                u,
                saved_state_bytes=by_user.get(u.user_id, 0),
                branch_states=branches.get(u.user_id, (0, 0))[0],
                branch_state_bytes=branches.get(u.user_id, (0, 0))[1],
            )
            for u in users
        ]

    async def sessions(self, user_id: str | None = None) -> list[ChatInfo]:
        key = None if user_id is None else id_key(user_id)
        rows = await self._core.read(lambda tx: _index.all_sessions(tx, key))
        return [r.info() for r in rows]

    async def chats(self) -> list[tuple[str, str, float, bool]]:
        """(user_id, chat_id, created_at, temporary) of every session: cheap, for bulk checks."""
        rows = await self._core.read(_index.session_ids)
        return [(u, c, created, temporary) for u, c, _, created, temporary in rows]

    async def links(self, *, user_id: str | None = None, chat_id: str | None = None) -> list[LinkInfo]:
        user_key = id_key(user_id) if user_id is not None else None
        chat_key = id_key(chat_id) if chat_id is not None else None
        return await self._core.read(lambda tx: _index_links.link_listing(tx, user_key, chat_key))

    async def activity(self, limit: int = 50) -> list[ActivityEntry]:
        """The newest audit-trail entries (cleanups, quota removals, rejected entries, rebuilds)."""
        return await self._core.read(lambda tx: _index.newest_activity(tx, limit))

    # ------------------------------------------------------------------ maintenance

    async def cleanup(
        self, purge: Purge | None = None, *, policy: Policy | None = None, dry_run: bool = False
    ) -> CleanupReport:
        """Apply the expiry of `policy` (None: the store's own) when purge is None, or delete the
        sessions a Purge selects.

        Sessions whose lock is held (a run in progress) are skipped and counted as in use. dry_run
        reports what would go and changes nothing."""
        rules = policy or self._policy
        if purge is None and not dry_run:
            await self._core.remember_settings(rules)
        return await _expiry.cleanup(self._core, purge, rules, dry_run=dry_run)

    async def delete_chats(self, chats: list[tuple[str, str]], reason: str) -> CleanupReport:
        """Delete the sessions of these (user_id, chat_id) pairs now, in one pass (chats deleted in
        the web UI). A session in use is skipped and counted; call again later for those."""
        keys = [(id_key(u), id_key(c)) for u, c in chats]
        return await _expiry.delete_sessions(self._core, keys, reason)

    async def mark_missing(self, missing: list[tuple[str, str]], *, after_s: float) -> list[tuple[str, str]]:
        """Of these (user_id, chat_id) sessions, whose chat the web UI no longer has, those that were
        already missing at an earlier look at least `after_s` ago and were not used since: they can
        go. The others are marked now; sessions marked earlier and not in `missing` are unmarked (their
        chat is back, or the earlier answer was wrong). Two looks a while apart must agree, so a chat
        being created (or a database that answered wrongly once) never loses its folder."""
        now = time.time()
        wanted = {(id_key(u), id_key(c)): (u, c) for u, c in missing}

        async def write(tx: Tx) -> list[tuple[str, str]]:
            marked = {(u, c): (since, used) for u, c, since, used in await _index.sessions_missing(tx)}
            await _index.set_missing_since(tx, [k for k in marked if k not in wanted], None)
            await _index.set_missing_since(tx, [k for k in wanted if k not in marked], now)
            return [
                wanted[k]
                for k, (since, used) in marked.items()
                if k in wanted and since <= now - after_s and used <= now - after_s
            ]

        return await self._core.write(write)

    async def claim(self, task: str, every_s: float) -> bool:
        """True (and noted) if `task` last ran at least `every_s` ago, by any process of this store:
        a periodic task several workers share runs once per interval."""
        now = time.time()
        key = f"last_run:{task}"

        async def write(tx: Tx) -> bool:
            # Read, then write what was read: one process at a time (on PostgreSQL a transaction lock
            # on the key, which has a ':' no user key has; SQLite's writer is alone already).
            await tx.serialise_user(key)
            last = await _index.get_meta(tx, key)
            try:
                due = last is None or now - float(last) >= every_s
            except ValueError:
                due = True
            if due:
                await _index.set_meta(tx, key, repr(now))
            return due

        return await self._core.write(write)

    @overload
    async def reconcile(self, mode: Literal[Reconcile.REBUILD] = ...) -> RebuildReport: ...

    @overload
    async def reconcile(self, mode: Reconcile) -> RebuildReport | None: ...

    async def reconcile(self, mode: Reconcile = Reconcile.REBUILD) -> RebuildReport | None:
        """Bring the index in line with the disk for the whole store (see `Reconcile`): REBUILD
        (returns its report), INTERRUPTED or AFTER_FULL_DISK. Never enforces quotas. The modes of one
        chat, CHANGED and FOLDER, are `Session.reconcile`'s."""
        if mode is Reconcile.REBUILD:
            return await _repair.reconcile_rebuild(self._core)
        if mode is Reconcile.INTERRUPTED:
            await _repair.reconcile_interrupted(self._core)
        elif mode is Reconcile.AFTER_FULL_DISK:
            await self._reconcile_after_full_disk()
        else:
            raise ValueError(f"{mode} is the mode of one chat: use Session.reconcile")
        return None

    async def check(self) -> list[Drift]:
        """Differences between the index and the disk; changes nothing. Sessions in use are skipped."""
        return await _repair.check(self._core)


def _backend_for(root: Path, database_url: str | None, busy_timeout_s: float) -> Backend:
    """The index database a URL names (see Store). The session folders stay under root either way."""
    url = (database_url or "").strip()
    if is_postgres_url(url):
        return PostgresBackend(url, busy_total_s=busy_timeout_s)
    scheme = url.partition(":")[0].lower()
    if url and scheme != "sqlite" and not scheme.startswith("sqlite+"):
        raise StorageError(
            f"unsupported database URL {redact_url(url)!r}: use postgresql://... or leave it empty for "
            "an SQLite index under the store's root"
        )
    # An `sqlite:` URL (Open WebUI's own database when it runs on SQLite, `sqlite+sqlcipher:` too) means
    # our embedded index:
    # the store never writes into another application's SQLite file.
    return SQLiteBackend(root / "index.sqlite3", root / "state", busy_total_s=busy_timeout_s)
