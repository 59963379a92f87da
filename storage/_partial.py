"""Change-driven reconcile: look only at the paths a run changed, not at the whole folder.

The caller (the engine, from the runner's inotify watch) names the paths the run created, changed,
removed or renamed. Each is judged with the rules of the full scan and becomes authoritative for
itself and everything under it:

* gone: its index row and every row under `path/` are removed;
* a regular file: (re)indexed, rows under `path/` removed;
* a folder: its whole subtree is scanned (`_scan.scan_folder`, the full scan's own code: O_NOFOLLOW,
  special files unlinked and reported, bad names renamed, too deep removed);
* anything else (symlink, FIFO, socket, device): unlinked without being opened, and reported.

Each path is reached from the session folder's fd, component by component with O_NOFOLLOW. Index rows
are read per path (the exact path, and the `path/` range of the primary key), never the whole session.
Quota enforcement and the report are the full reconcile's (`_reconcile.apply`).

Anything unusual falls back to the full reconcile (logged at debug level): more than MAX_PATHS paths,
a path that is not a clean relative path or not valid UTF-8, deeper than MAX_DEPTH, a parent that is
missing or not a real folder (a symlink swapped in), a regular file with more than one link (a write
through another name changes it without an event on this one), a session whose last full listing
found such files (`sessions.linked_files`: written through a name that is then removed, the others
change and nothing names them), no index row for the session yet.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
from collections.abc import Collection
from typing import TYPE_CHECKING

from . import _reconcile
from ._db import Tx
from ._fsops import _DIR_FLAGS, kind_of, lstat_at, walk_dirs
from ._index import session_by_keys, user_totals
from ._names import MAX_DEPTH
from ._scan import Scan, _reject, scan_folder
from .errors import FileMissing, InvalidPath
from .models import Quotas, ReconcileReport

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("code_sessions.storage")

MAX_PATHS = 5000  # beyond this many paths, listing the folder is about as cheap
_CHUNK = 500  # paths per index query (two bound parameters each for the ranges)


class _Fallback(Exception):
    """Something is unusual: do the full reconcile instead."""


async def reconcile(
    session: Session, changed: Collection[str], *, enforce_quotas: bool, quotas: Quotas
) -> ReconcileReport:
    """Reconcile the given paths only; the full reconcile when anything is unusual."""
    found = Scan()
    try:
        scopes = _scopes(changed)
        if not scopes:  # nothing changed (print(1)): nothing to read; write the totals, report
            return await _reconcile.apply(
                session,
                found,
                [],
                [],
                [],
                enforce_quotas=False,
                quotas=quotas,
                user_files=0,
                user_bytes=0,
                full=False,
            )
        await asyncio.to_thread(_look, session.path, scopes, found)
        return await _apply(session, scopes, found, enforce_quotas=enforce_quotas, quotas=quotas)
    except _Fallback as why:
        log.debug("reconcile of %s: full listing instead of %d changed paths: %s", session, len(changed), why)
    # Entries the attempt already rejected or renamed are gone from disk; the report still names them.
    return await _reconcile.reconcile(session, enforce_quotas=enforce_quotas, quotas=quotas, prior=found)


def _scopes(changed: Collection[str]) -> list[str]:
    """Validated paths, sorted, without those under another changed path (its scan covers them)."""
    if len(changed) > MAX_PATHS:
        raise _Fallback(f"more than {MAX_PATHS} paths")
    paths = set()
    for path in changed:
        parts = path.split("/")
        if len(parts) > MAX_DEPTH:
            raise _Fallback(f"deeper than {MAX_DEPTH} components: {path!r}")
        if not path or "\x00" in path or any(p in ("", ".", "..") for p in parts):
            raise _Fallback(f"not a clean relative path: {path!r}")
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise _Fallback(f"not valid UTF-8: {path!r}") from None
        paths.add(path)
    scopes = []
    for path in sorted(paths):
        parts = path.split("/")
        if not any("/".join(parts[:i]) in paths for i in range(1, len(parts))):
            scopes.append(path)
    return scopes


def _look(session_dir: os.PathLike[str], scopes: list[str], found: Scan) -> None:
    """Put what is on disk now at each scope (and under it) into `found`, fixing what a full scan
    fixes. Runs in a worker thread."""
    try:
        root = os.open(session_dir, _DIR_FLAGS)
    except OSError as exc:
        raise _Fallback(f"cannot open the session folder: {exc}") from None
    parent_path: str | None = None
    parent = -1
    try:
        for path in scopes:
            folder, _, name = path.rpartition("/")
            if folder != parent_path:  # sorted: siblings come together, so one walk per folder
                if parent >= 0:
                    os.close(parent)
                    parent = -1
                parent_path = folder
                parent = _open_parent(root, folder)
            _look_at(parent, name, path, found)
        if found.linked:
            raise _Fallback(f"{found.linked[0]} has several hard links")
    finally:
        if parent >= 0:
            os.close(parent)
        os.close(root)


def _open_parent(root: int, folder: str) -> int:
    if not folder:
        return os.dup(root)
    try:
        return walk_dirs(root, folder.split("/"))
    except FileMissing:
        # Its removal would have been an event naming the folder, which covers this path.
        raise _Fallback(f"the folder {folder} vanished without an event") from None
    except InvalidPath:
        raise _Fallback(f"{folder} is not a real folder") from None
    except OSError as exc:
        if exc.errno == errno.EACCES:
            raise _Fallback(f"cannot read the folder {folder}") from None
        raise


def _look_at(parent: int, name: str, path: str, found: Scan) -> None:
    st = lstat_at(parent, name)
    if st is None:
        return  # gone: nothing on disk, so every row at and under it goes
    if stat.S_ISREG(st.st_mode):
        if st.st_nlink > 1:
            raise _Fallback(f"{path} has several hard links")
        found.files[path] = (st.st_size, st.st_mtime_ns)
    elif stat.S_ISDIR(st.st_mode):
        scan_folder(parent, name, path, fix=True, result=found)
    else:
        _reject(parent, name, path, kind_of(st.st_mode), True, found)


async def _apply(
    session: Session, scopes: list[str], found: Scan, *, enforce_quotas: bool, quotas: Quotas
) -> ReconcileReport:
    listing = found.files

    async def read(tx: Tx) -> tuple[dict[str, tuple[int, int]], list[str], int, int]:
        row = await session_by_keys(tx, session.user_key, session.chat_key)
        if row is None:
            raise _Fallback("the session has no index row")  # nothing to compare with
        if row.linked_files:
            # Written through one name, the other names of such a file change without an event
            # naming them (and the written name may be gone by now).
            raise _Fallback("the session holds files with several hard links")
        index: dict[str, tuple[int, int]] = {}
        for i in range(0, len(scopes), _CHUNK):
            chunk = scopes[i : i + _CHUNK]
            marks = ", ".join("?" * len(chunk))
            for path, size, mtime_ns in await tx.all(
                f"SELECT path, size, mtime_ns FROM files WHERE session_id = ? AND path IN ({marks})",
                (row.id, *chunk),
            ):
                index[path] = (size, mtime_ns)
            # `path/` up to `path0` ('0' follows '/'): exactly the rows under the folder, found
            # through the (session_id, path) primary key.
            values = ", ".join("(?, ?)" for _ in chunk)
            bounds = [b for p in chunk for b in (p + "/", p + "0")]
            for path, size, mtime_ns in await tx.all(
                f"WITH q(lo, hi) AS (VALUES {values}) SELECT f.path, f.size, f.mtime_ns"
                " FROM q JOIN files f ON f.session_id = ? AND f.path >= q.lo AND f.path < q.hi",
                (*bounds, row.id),
            ):
                index[path] = (size, mtime_ns)
        removed = [p for p in index if p not in listing and not found.is_unreadable(p)]
        _, files, size = await user_totals(tx, session.user_key)
        return index, removed, files, size

    index, removed, user_files, user_bytes = await session._store._db.read(read)
    added = [p for p in listing if p not in index]
    changed = [p for p, seen in listing.items() if p in index and index[p] != seen]
    # The user's totals with the session as it is on disk now: the indexed totals, corrected by
    # what differs in the looked-at paths (the rest of the session is as indexed).
    user_files += len(added) - len(removed)
    user_bytes += (
        sum(listing[p][0] for p in added)
        + sum(listing[p][0] - index[p][0] for p in changed)
        - sum(index[p][0] for p in removed)
    )
    return await _reconcile.apply(
        session,
        found,
        added,
        changed,
        removed,
        enforce_quotas=enforce_quotas,
        quotas=quotas,
        user_files=user_files,
        user_bytes=user_bytes,
        full=False,
    )
