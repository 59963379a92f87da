"""The file work under a chat's history (storage/_history.py, which has the layout and the rules):
walking the live folder without following links, copying a version in as a private object (a reflink
where the disk has them) and out into the live folder, clearing what a restored state does not have,
and the checks of the names a state's record may hold. Blocking, file descriptors relative to open
folders throughout, so a folder swapped for a link mid-way is never followed."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._fsops import DIR_FLAGS, Owner, copy_fd, fd_closing, remove_tree_at
from ._names import MAX_DEPTH, MAX_PATH_BYTES

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FICLONE = 0x40049409  # linux/fs.h: share the blocks of a file (XFS, Btrfs); ext4 refuses
_RESTORE_TEMP = ".cs-restore-"
_OBJECT = re.compile(r"[0-9a-f]{24}")
_PLAIN_PATH = re.compile(r"[^/\0]+(?:/[^/\0]+)*")
_DOT_PART = re.compile(r"(?:^|/)\.\.?(?:/|$)")


def safe_path(path: object) -> bool:
    """A relative path of plain components, as the state's own walk wrote it (a damaged or forged
    state could otherwise name a place outside the folder)."""
    return (
        isinstance(path, str)
        and _PLAIN_PATH.fullmatch(path) is not None
        and _DOT_PART.search(path) is None
        and path.count("/") < MAX_DEPTH
        and len(path.encode("utf-8", "surrogatepass")) <= MAX_PATH_BYTES
    )


def object_name(name: object) -> bool:
    return isinstance(name, str) and _OBJECT.fullmatch(name) is not None


def listing(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def write_bytes(path: Path, data: bytes) -> None:
    """Write a file of the history whole: a new file renamed over the old one."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, _NEW, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def unchanged(record: list[Any], st: os.stat_result) -> bool:
    """The live file is still the one a state's record describes: its size, mtime, inode and ctime
    (which the sandbox's code cannot set back) are as recorded."""
    return record[1:3] == [st.st_size, st.st_mtime_ns] and record[4:6] == [st.st_ino, st.st_ctime_ns]


def digest_name(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


def tree_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def walk(fd: int, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, os.stat_result, int, str]]:
    """(path, lstat, parent fd, name) of every folder and regular file under the folder `fd`, each
    folder before what it holds. Never follows a link; names that are not UTF-8 are skipped
    (reconcile renames them), and so is what lies deeper than MAX_DEPTH. One open folder per level."""
    try:
        names = os.listdir(fd)
    except OSError:
        return
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if name.startswith(_RESTORE_TEMP) or (not name.isascii() and not _utf8(name)):
            continue
        path = f"{prefix}{name}"
        if stat.S_ISREG(st.st_mode):
            yield path, st, fd, name
        elif stat.S_ISDIR(st.st_mode):
            yield path, st, fd, name
            if depth + 1 >= MAX_DEPTH:
                continue
            try:
                sub = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue
            with fd_closing(sub):
                yield from walk(sub, f"{path}/", depth + 1)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def clear_live(
    fd: int,
    prefix: str,
    depth: int,
    wanted: dict[str, list[Any]],
    keep_dirs: set[str],
    before: dict[str, list[Any]],
    kept: dict[str, list[Any]],
) -> int:
    """Remove from the live folder `fd` what the state being restored does not hold (links, FIFOs,
    names that are not UTF-8 and folders it lacks included, never followed); note in `kept` the files
    that are already the state's version. Returns how many entries went."""
    removed = 0
    try:
        names = os.listdir(fd)
    except OSError:
        return removed
    for name in names:
        st = _lstat(fd, name)
        if st is None:
            continue
        path = f"{prefix}{name}"
        if not _utf8(name) or name.startswith(_RESTORE_TEMP):
            remove_tree_at(fd, name)
            removed += 1
        elif stat.S_ISDIR(st.st_mode):
            if path not in keep_dirs or depth + 1 >= MAX_DEPTH:
                remove_tree_at(fd, name)
                removed += 1
                continue
            try:
                sub = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue
            with fd_closing(sub):
                removed += clear_live(sub, f"{path}/", depth + 1, wanted, keep_dirs, before, kept)
        else:
            entry, seen = wanted.get(path), before.get(path)
            if (
                entry is not None
                and stat.S_ISREG(st.st_mode)
                and seen is not None
                and seen[0] == entry[0]
                and unchanged(seen, st)
            ):
                kept[path] = seen
            elif entry is None or not stat.S_ISREG(st.st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
                    removed += 1
    return removed


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None


def _clone_or_copy(src: int, dst: int) -> None:
    try:
        fcntl.ioctl(dst, _FICLONE, src)
        return
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.EBADF):
            raise
    copy_fd(src, dst)


def copy_in(parent: int, name: str, seen: os.stat_result, objects_fd: int) -> str | None:
    """A private copy of the live file `name` as a new object; None when it is gone or is no longer
    the regular file the walk saw."""
    try:
        src = os.open(name, _READ, dir_fd=parent)
    except OSError:
        return None
    with fd_closing(src):
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != seen.st_ino:
            return None
        obj = secrets.token_hex(12)
        dst = os.open(obj, _NEW, 0o400, dir_fd=objects_fd)
        try:
            with fd_closing(dst):
                _clone_or_copy(src, dst)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(obj, dir_fd=objects_fd)
            raise
    return obj


def copy_out(
    objects_fd: int, obj: str, parent: int, name: str, mode: int, mtime_ns: int, owner: Owner
) -> os.stat_result:
    """Put the object back at `name` in the live folder: a new file beside it, renamed over it."""
    temp = f"{_RESTORE_TEMP}{secrets.token_hex(6)}"
    with fd_closing(os.open(obj, _READ, dir_fd=objects_fd)) as src:
        dst = os.open(temp, _NEW, 0o600, dir_fd=parent)
        try:
            with fd_closing(dst):
                _clone_or_copy(src, dst)
                if owner is not None and os.geteuid() == 0:
                    os.fchown(dst, owner[0], owner[1])
                os.fchmod(dst, mode & 0o777)
                os.utime(dst, ns=(mtime_ns, mtime_ns))
            st = _lstat(parent, name)
            if st is not None and stat.S_ISDIR(st.st_mode):
                remove_tree_at(parent, name)
            os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=parent)
            raise
        done = _lstat(parent, name)
        assert done is not None
        return done


def make_dirs(root: int, parts: list[str], mode: int, owner: Owner) -> int:
    """Open (making what is missing) the folder `parts` under root; a non-folder in the way goes."""
    fd = os.dup(root)
    for part in parts:
        try:
            sub = os.open(part, DIR_FLAGS, dir_fd=fd)
        except OSError as error:
            if error.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                os.close(fd)
                raise
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(part, dir_fd=fd)
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, mode & 0o777, dir_fd=fd)
            sub = os.open(part, DIR_FLAGS, dir_fd=fd)
            if owner is not None and os.geteuid() == 0:
                os.fchown(sub, owner[0], owner[1])
            os.fchmod(sub, mode & 0o777)
        os.close(fd)
        fd = sub
    return fd
