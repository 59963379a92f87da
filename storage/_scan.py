"""Listing a session folder: one lstat per entry, never a file's contents, never a symlink followed.

With `fix=True` (reconcile) anything that is not a regular file or a directory is unlinked (never
opened: opening a FIFO blocks), names that are not valid UTF-8 are renamed, and content deeper than
MAX_DEPTH, or at a path longer than MAX_PATH_BYTES, is deleted; each is reported. With `fix=False`
(check) the same things are only reported.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ._fsops import DIR_FLAGS, fd_closing, kind_of, lstat_at, remove_tree_at
from ._names import MAX_DEPTH, MAX_PATH_BYTES, display, is_utf8, numbered
from .models import Rejected, Renamed

log = logging.getLogger("code_sessions.storage")

# path -> (size, mtime_ns)
Listing = dict[str, tuple[int, int]]


@dataclass(slots=True)
class Scan:
    files: Listing = field(default_factory=dict)
    rejected: list[Rejected] = field(default_factory=list)
    renamed: list[Renamed] = field(default_factory=list)
    # Folders we could not open: index entries under them are kept as they are, not dropped.
    unreadable: list[str] = field(default_factory=list)
    # Regular files with more than one link: a write through another name changes them without an
    # event on this name, so a change-driven reconcile cannot trust its other rows (see _reconcile_changed).
    linked: list[str] = field(default_factory=list)
    # Folders found empty (with fix=True): folders are not files, so no quota counts them; see
    # _reconcile.MAX_EMPTY_FOLDERS.
    empty_folders: list[str] = field(default_factory=list)

    def is_unreadable(self, path: str) -> bool:
        return any(path.startswith(prefix + "/") for prefix in self.unreadable)


def scan(session_dir: Path, *, fix: bool, max_depth: int = MAX_DEPTH) -> Scan:
    result = Scan()
    try:
        root = os.open(session_dir, DIR_FLAGS)
    except FileNotFoundError:
        return result
    # Depth first, one open folder per level (MAX_DEPTH at most), however many folders a level holds.
    # Depth = number of components of the folder's path.
    with fd_closing(root):
        _scan_dir(root, "", 0, fix, max_depth, result)
    return result


def scan_folder(
    parent_fd: int, name: str, path: str, *, fix: bool, result: Scan, max_depth: int = MAX_DEPTH
) -> None:
    """Add the folder `name` of parent_fd (at `path`, relative to the session folder) and everything
    under it to `result`, with the rules of a full scan (too deep, swapped for a symlink, ...)."""
    _enter_dir(parent_fd, name, path, path.count("/") + 1, fix, max_depth, result)


def _scan_dir(
    fd: int,
    prefix: str,
    depth: int,
    fix: bool,
    max_depth: int,
    result: Scan,
) -> None:
    # The hot loop of reconcile: keep it lean (one lstat per regular file, d_type for the rest).
    files = result.files
    is_reg = stat.S_ISREG
    with os.scandir(fd) as listing:
        entries = list(listing)  # finish reading before we unlink or rename anything in here
    if not entries and prefix:
        result.empty_folders.append(prefix[:-1])
    for entry in entries:
        name = entry.name
        if not name.isascii() and not is_utf8(name):
            fixed = _fix_name(fd, name, prefix, fix, result)
            if fixed is None:
                continue
            _classify(fd, fixed, prefix + fixed, depth, fix, max_depth, result)
            continue
        try:
            if entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                if is_reg(st.st_mode):
                    if len(prefix) + len(name) > _SURELY_SHORT and _too_long(prefix + name):
                        _remove_long(fd, name, prefix + name, fix, result)
                        continue
                    files[prefix + name] = (st.st_size, st.st_mtime_ns)
                    if st.st_nlink > 1:
                        result.linked.append(prefix + name)
                    continue
                reject(fd, name, prefix + name, kind_of(st.st_mode), fix, result)
            elif entry.is_dir(follow_symlinks=False):
                _enter_dir(fd, name, prefix + name, depth + 1, fix, max_depth, result)
            else:
                _classify(fd, name, prefix + name, depth, fix, max_depth, result)
        except FileNotFoundError:
            continue  # vanished while listing: it simply is not there


def _classify(
    fd: int,
    name: str,
    path: str,
    depth: int,
    fix: bool,
    max_depth: int,
    result: Scan,
) -> None:
    """Handle an entry from its lstat (renamed entries, and types d_type did not settle)."""
    st = lstat_at(fd, name)
    if st is None:
        return
    if stat.S_ISREG(st.st_mode):
        if _too_long(path):
            _remove_long(fd, name, path, fix, result)
            return
        result.files[path] = (st.st_size, st.st_mtime_ns)
        if st.st_nlink > 1:
            result.linked.append(path)
    elif stat.S_ISDIR(st.st_mode):
        _enter_dir(fd, name, path, depth + 1, fix, max_depth, result)
    else:
        reject(fd, name, path, kind_of(st.st_mode), fix, result)


def _enter_dir(
    fd: int,
    name: str,
    path: str,
    depth: int,
    fix: bool,
    max_depth: int,
    result: Scan,
) -> None:
    """Scan the folder `name` of fd now, so only one folder per level is ever open (a level may hold
    thousands of folders; opening them all first would exhaust file descriptors)."""
    if depth >= max_depth:
        # A folder at the last allowed level could only hold files one level too deep.
        result.rejected.append(Rejected(path + "/", "too deep"))
        if fix:
            remove_tree_at(fd, name)
        return
    if _too_long(path + "/x"):  # nothing in it could have a path short enough
        _remove_long(fd, name, path + "/", fix, result, folder=True)
        return
    try:
        child = os.open(name, DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            # Swapped for something else since the listing: judge what is there now, without following.
            st = lstat_at(fd, name)
            if st is None:
                return
            reject(fd, name, path, kind_of(st.st_mode), fix, result)
            return
        if exc.errno == errno.EACCES:
            log.warning("cannot read folder %s in a session; its index entries are kept", path)
            result.unreadable.append(path)
            return
        raise
    with fd_closing(child):
        _scan_dir(child, path + "/", depth, fix, max_depth, result)


# A path of this many characters or fewer is within MAX_PATH_BYTES whatever it holds (UTF-8 takes at
# most 4 bytes a character): the scan measures only longer ones.
_SURELY_SHORT = MAX_PATH_BYTES // 4


def _too_long(path: str) -> bool:
    return len(path) > _SURELY_SHORT and len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES


def _remove_long(fd: int, name: str, path: str, fix: bool, result: Scan, *, folder: bool = False) -> None:
    result.rejected.append(Rejected(display(path), "path too long"))
    if fix:
        if folder:
            remove_tree_at(fd, name)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)


def reject(fd: int, name: str, path: str, kind: str, fix: bool, result: Scan) -> None:
    if kind in ("file", "folder"):
        return
    result.rejected.append(Rejected(display(path), kind))
    if fix:
        # unlinkat never follows or opens the entry.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)


def _fix_name(fd: int, raw: str, prefix: str, fix: bool, result: Scan) -> str | None:
    """Rename an entry whose name is not valid UTF-8 to a readable one; None when not renamed."""
    decoded = raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace").replace("\ufffd", "_")
    new = decoded
    n = 2
    while lstat_at(fd, new) is not None:
        new = numbered(decoded, n)
        n += 1
    result.renamed.append(Renamed(display(prefix + raw), prefix + new))
    if not fix:
        return None
    os.rename(raw, new, src_dir_fd=fd, dst_dir_fd=fd)
    return new
