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

Anything unusual falls back to listing the whole folder (logged at debug level): more than MAX_PATHS paths,
a path that `_names.split_path` refuses or would rewrite (not clean, not UTF-8, too deep), a parent that is
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

from . import _index
from ._backend import Tx
from ._core import ChatRef, Core
from ._fsops import DIR_FLAGS, kind_of, lstat_at, walk_dirs
from ._names import split_path
from ._reconcile import Differences, apply, reconcile_folder
from ._scan import Scan, reject, scan_folder
from .errors import FileMissing, InvalidPath
from .models import ReconcileReport
from .policy import Policy

log = logging.getLogger("code_sessions.storage")

MAX_PATHS = 5000  # beyond this many paths, listing the folder is about as cheap


class _Fallback(Exception):
    """Something is unusual: list the whole folder instead."""


async def reconcile_changed(
    core: Core, ref: ChatRef, changed: Collection[str], *, quotas: Policy | None
) -> ReconcileReport:
    """Reconcile the given paths only; the whole folder when anything is unusual."""
    found = Scan()
    try:
        scopes = _scopes(changed)
        if not scopes:  # nothing changed (print(1)): nothing to read; write the totals, report
            return await apply(core, ref, Differences(found, full=False), quotas=None)
        # The disk and the index are read at once (neither needs the other): on PostgreSQL the index's
        # round trip then costs the step nothing while the thread looks at the files.
        looked, index = await asyncio.gather(
            asyncio.to_thread(_look, ref.path, scopes, found),
            _read_index(core, ref, scopes),
            return_exceptions=True,
        )
        for outcome in (looked, index):
            if isinstance(outcome, BaseException):
                raise outcome
        assert isinstance(index, dict)
        return await _apply(core, ref, found, index, quotas=quotas)
    except _Fallback as why:
        log.debug(
            "reconcile of %s: full listing instead of %d changed paths: %s", ref.path, len(changed), why
        )
    # Entries the attempt already rejected or renamed are gone from disk; the report still names them.
    return await reconcile_folder(core, ref, quotas=quotas, prior=found)


def _scopes(changed: Collection[str]) -> list[str]:
    """Validated paths, sorted, without those under another changed path (its scan covers them)."""
    if len(changed) > MAX_PATHS:
        raise _Fallback(f"more than {MAX_PATHS} paths")
    paths = set()
    for path in changed:
        try:
            canonical = "/".join(split_path(path))
        except InvalidPath as why:
            raise _Fallback(str(why)) from None
        if canonical != path:
            raise _Fallback(f"not a clean relative path: {path!r}")
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
        root = os.open(session_dir, DIR_FLAGS)
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
        reject(parent, name, path, kind_of(st.st_mode), True, found)


# Written through one name, the other names of such a file change without an event naming them (and
# the written name may be gone by now).
_LINKED = "the session holds files with several hard links"


async def _read_index(core: Core, ref: ChatRef, scopes: list[str]) -> dict[str, tuple[int, int]]:
    """The index rows at and under each scope (path -> size, mtime)."""

    async def read(tx: Tx) -> dict[str, tuple[int, int]]:
        row = await _index.session_by_keys(tx, ref.user_key, ref.chat_key)
        if row is None:
            raise _Fallback("the session has no index row")  # nothing to compare with
        if row.linked_files:
            raise _Fallback(_LINKED)
        return await _index.rows_at_and_under(tx, row.id, scopes)

    async def read_one(tx: Tx) -> dict[str, tuple[int, int]]:
        # The usual case (a few paths): one statement, so one round trip on PostgreSQL.
        found = await _index.session_rows_at_and_under(tx, ref.user_key, ref.chat_key, scopes)
        if found is None:
            raise _Fallback("the session has no index row")  # nothing to compare with
        if found[1]:
            raise _Fallback(_LINKED)
        return found[2]

    return await core.read(read_one if len(scopes) <= _index.CHUNK else read)


async def _apply(
    core: Core, ref: ChatRef, found: Scan, index: dict[str, tuple[int, int]], *, quotas: Policy | None
) -> ReconcileReport:
    listing = found.files
    differences = Differences(found, full=False)
    differences.added = [p for p in listing if p not in index]
    differences.changed = [p for p, seen in listing.items() if p in index and index[p] != seen]
    differences.removed = [p for p in index if p not in listing and not found.is_unreadable(p)]
    differences.old_sizes = {p: index[p][0] for p in (*differences.changed, *differences.removed)}
    differences.old_mtimes = {p: index[p][1] for p in differences.removed}
    return await apply(core, ref, differences, quotas=quotas)
