"""The Store: a root folder of chat sessions plus the SQLite index that tracks them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path
from types import TracebackType

from ._db import Database, Tx
from ._fsops import make_dir
from ._index import (
    all_sessions,
    get_meta,
    log_activity,
    session_by_keys,
    set_meta,
    user_totals,
)
from ._keys import id_key
from ._layout import Layout, write_sidecar
from ._lock import FileLock
from .errors import StorageError
from .models import (
    ActivityEntry,
    CleanupReport,
    Drift,
    Expiry,
    LinkInfo,
    Publisher,
    Purge,
    Quotas,
    RebuildReport,
    SessionInfo,
    Usage,
    UserUsage,
)
from .session import Session

log = logging.getLogger("code_sessions.storage")

Owner = tuple[int, int] | None


class Store:
    """Chat sessions under `root`, with quotas, expiry and publishing.

    `quotas` and `expiry` are plain attributes: replace them at any time (e.g. when an admin changes
    settings); each operation reads the current value. `owner=(uid, gid)`: when running as root, every
    folder and file the store creates inside session folders is given to that user (the sandbox's).
    `busy_timeout_s`: how long an operation waits for a busy index before raising StorageBusy.
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
    ) -> None:
        self.root = Path(root).absolute()
        self.quotas = quotas if quotas is not None else Quotas()
        self.expiry = expiry if expiry is not None else Expiry()
        self.publisher = publisher
        self.owner = owner
        self._layout = Layout(self.root)
        self._db = Database(self._layout.db_path, busy_total_s=busy_timeout_s)
        self._opened = False
        self._remembered: dict[str, str] = {}
        # The CLI turns this off: it applies the recorded settings and must not overwrite them.
        self._record_settings = True

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        if self._opened:
            return
        await asyncio.to_thread(self._make_root)
        opened = await self._db.open()
        self._opened = True
        try:
            if self.publisher is not None:
                from ._publish import remember_publisher

                await remember_publisher(self._db, self.publisher)
            if opened.fresh and await asyncio.to_thread(self._layout.session_keys_on_disk):
                log.warning("the index %s is new but session folders exist: rebuilding it", self._db.path)
                report = await self.rebuild()
                log.warning("index rebuilt: %s", report.summary())
            if opened.moved_aside is not None:
                await self._log("corrupt_index", detail={"moved_to": str(opened.moved_aside)})
            await self._recover_interrupted_runs()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        self._opened = False
        await self._db.close()

    async def __aenter__(self) -> Store:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _make_root(self) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for path in (self._layout.sessions, self._layout.state, self._layout.trash, self._layout.running):
            make_dir(path)

    async def _recover_interrupted_runs(self) -> None:
        """Index the folders of runs whose process ended before their reconcile (a crash, a kill):
        their files would otherwise stay out of the index, the quotas and expiry until the chat's next
        run. A run still going on in another process holds its lock and is left alone."""
        for user_key, chat_key in await asyncio.to_thread(self._layout.running_markers):
            lock = FileLock(self._layout.lock_path(user_key, chat_key))
            if not lock.try_acquire():
                continue
            try:
                row = await self._db.read(lambda tx, u=user_key, c=chat_key: session_by_keys(tx, u, c))
                if row is None or not self._layout.session_dir(user_key, chat_key).is_dir():
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._layout.running_marker(user_key, chat_key))
                    continue
                session = Session._at_keys(self, row.user_id, row.chat_id, user_key, chat_key)
                # Like rebuild, recovery never deletes files: the totals count them, so a user over a
                # limit is refused at the next run (and this needs no quota settings, which the CLI
                # only loads after opening).
                report = await session.reconcile(enforce_quotas=False)
            finally:
                lock.release()
            log.warning(
                "a run in chat %r of user %r ended with its process before its files were indexed; "
                "indexed them now: %s",
                row.chat_id,
                row.user_id,
                report.summary(),
            )
            await self._log("interrupted_run", row.user_id, row.chat_id, {"summary": report.summary()})

    # ------------------------------------------------------------------ sessions

    async def session(self, user_id: str, chat_id: str) -> Session:
        """The session of (user_id, chat_id): creates its folder and index row if needed and marks it
        used now. Ids are untrusted strings; any value maps to a safe folder name."""
        if not isinstance(user_id, str) or not isinstance(chat_id, str):
            raise StorageError("user_id and chat_id must be str")
        session = Session(self, user_id, chat_id)
        await self._ensure(session, touch=True)
        return session

    async def _ensure(self, session: Session, *, touch: bool) -> None:
        created = await asyncio.to_thread(self._make_dirs, session)
        now = time.time()
        await self._db.write(lambda tx: session._session_id(tx, created, now if touch else None))

    def _make_dirs(self, session: Session) -> float:
        """Create the session folder, its state folder and sidecar; returns the creation time."""
        layout = self._layout
        now = time.time()
        for attempt in range(5):
            try:
                make_dir(layout.sessions / session.user_key)
                if not make_dir(session.path, self.owner) and self.owner is not None:
                    _chown_existing(session.path, self.owner)
                make_dir(layout.state / session.user_key)
                sidecar = layout.sidecar_path(session.user_key, session.chat_key)
                if not sidecar.exists():
                    write_sidecar(sidecar, session.user_id, session.chat_id, now)
                return now
            except FileNotFoundError:
                # A cleanup removed an empty parent folder between two of our steps: go again.
                if attempt == 4:
                    raise
        return now

    def _session_for(self, info: SessionInfo) -> Session:
        """A Session object for an existing row, without touching it (CLI, maintenance)."""
        return Session._at_keys(self, info.user_id, info.chat_id, info.user_key, info.chat_key)

    async def user_usage(self, user_id: str) -> Usage:
        """Files and bytes of a user across all chats, as last reconciled (one indexed SUM)."""
        return await self._usage_of(id_key(user_id))

    async def _usage_of(self, key: str) -> Usage:
        async def read(tx: Tx) -> Usage:
            _, files, size = await user_totals(tx, key)
            return Usage(files, size)

        return await self._db.read(read)

    async def users_usage(self) -> list[UserUsage]:
        async def read(tx: Tx) -> list[UserUsage]:
            rows = await tx.all(
                "SELECT user_id, count(*), coalesce(sum(file_count), 0), coalesce(sum(bytes), 0)"
                " FROM sessions GROUP BY user_key ORDER BY user_id"
            )
            return [UserUsage(*r) for r in rows]

        return await self._db.read(read)

    async def sessions(self, user_id: str | None = None) -> list[SessionInfo]:
        async def read(tx: Tx) -> list[SessionInfo]:
            if user_id is None:
                rows = await all_sessions(tx)
            else:
                rows = await all_sessions(tx, "WHERE user_key = ?", (id_key(user_id),))
            return [
                SessionInfo(
                    r.user_id,
                    r.chat_id,
                    r.user_key,
                    r.chat_key,
                    r.temporary,
                    r.created_at,
                    r.last_used_at,
                    r.file_count,
                    r.bytes,
                )
                for r in rows
            ]

        return await self._db.read(read)

    async def links(self, *, user_id: str | None = None, chat_id: str | None = None) -> list[LinkInfo]:
        return await self._links(
            id_key(user_id) if user_id is not None else None, id_key(chat_id) if chat_id is not None else None
        )

    async def _links(self, user_key: str | None, chat_key: str | None) -> list[LinkInfo]:
        where, params = [], []
        if user_key is not None:
            where.append("s.user_key = ?")
            params.append(user_key)
        if chat_key is not None:
            where.append("s.chat_key = ?")
            params.append(chat_key)
        sql = (
            "SELECT l.token, s.user_id, s.chat_id, l.path, l.name, l.url, l.size, l.created_at, l.expires_at"
            " FROM links l LEFT JOIN sessions s ON s.id = l.session_id"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY l.created_at"
        )

        async def read(tx: Tx) -> list[LinkInfo]:
            return [LinkInfo(*r) for r in await tx.all(sql, params)]

        return await self._db.read(read)

    async def activity(self, limit: int = 50) -> list[ActivityEntry]:
        """The newest audit-trail entries (cleanups, quota removals, rejected entries, rebuilds)."""

        async def read(tx: Tx) -> list[ActivityEntry]:
            rows = await tx.all(
                "SELECT at, event, user_id, chat_id, detail FROM activity ORDER BY at DESC, id DESC LIMIT ?",
                (limit,),
            )
            return [ActivityEntry(at, ev, u, c, _json(detail)) for at, ev, u, c, detail in rows]

        return await self._db.read(read)

    # ------------------------------------------------------------------ maintenance

    async def cleanup(self, purge: Purge | None = None, *, dry_run: bool = False) -> CleanupReport:
        """Apply the expiry policy (purge=None), or delete the sessions a Purge selects.

        Sessions whose lock is held (a run in progress) are skipped and counted as in use. dry_run
        reports what would go and changes nothing."""
        from ._cleanup import cleanup

        if purge is None and not dry_run:
            await self._remember_settings()
        return await cleanup(self, purge, dry_run=dry_run)

    async def rebuild(self) -> RebuildReport:
        """Rebuild the index from the session folders (ids from the sidecars); never enforces quotas."""
        from ._rebuild import rebuild

        return await rebuild(self)

    async def check(self) -> list[Drift]:
        """Differences between the index and the disk; changes nothing. Sessions in use are skipped."""
        from ._rebuild import check

        return await check(self)

    # ------------------------------------------------------------------ internals

    async def _log(
        self, event: str, user_id: str | None = None, chat_id: str | None = None, detail: dict | None = None
    ) -> None:
        now = time.time()

        async def write(tx: Tx) -> None:
            await log_activity(tx, now, event, user_id, chat_id, detail)

        await self._db.write(write)

    async def _remember_settings(self) -> None:
        """Store the quotas and expiry in use, so the CLI can show and apply the same ones."""
        if not self._record_settings:
            return
        values = {
            "quotas": json.dumps(self.quotas.to_dict(), sort_keys=True),
            "expiry": json.dumps(self.expiry.to_dict(), sort_keys=True),
        }
        if values == self._remembered:
            return

        async def write(tx: Tx) -> None:
            for key, value in values.items():
                if await get_meta(tx, key) != value:
                    await set_meta(tx, key, value)

        await self._db.write(write)
        self._remembered = values

    async def _meta(self, key: str) -> str | None:
        async def read(tx: Tx) -> str | None:
            return await get_meta(tx, key)

        return await self._db.read(read)


def _chown_existing(path: Path, owner: tuple[int, int]) -> None:
    if os.geteuid() != 0:
        return
    st = os.stat(path, follow_symlinks=False)
    if (st.st_uid, st.st_gid) != owner:
        with contextlib.suppress(OSError):
            os.chown(path, owner[0], owner[1], follow_symlinks=False)


def _json(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {"raw": text}
    return value if isinstance(value, dict) else {"value": value}
