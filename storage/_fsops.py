"""File operations that never follow a symbolic link.

The session folder is written by sandboxed code, so any component of any path in it may be a symlink,
a FIFO or a device. Everything here walks from an open directory fd, one component at a time, with
O_NOFOLLOW, and uses the *at() forms of system calls (dir_fd=...) so a path is resolved exactly once
and never leaves the session folder. Regular files are checked with lstat before they are opened and
opened with O_NONBLOCK, so a FIFO can never block us and a device is never opened.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import FileExists, FileMissing, InvalidPath, StorageError

Owner = tuple[int, int] | None

DIR_MODE = 0o700
FILE_MODE = 0o600
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20


@contextlib.contextmanager
def fd_closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def chown(fd: int, owner: Owner) -> None:
    # Only root can give files away; without root the sandbox is expected to run as us anyway.
    if owner is not None and os.geteuid() == 0:
        os.fchown(fd, owner[0], owner[1])


def open_dir(path: Path | str) -> int:
    """Open a directory we control (the session folder itself); its last component must not be a link."""
    # Messages may reach the user: they do not name the host path.
    try:
        return os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        raise FileMissing("the session folder does not exist") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise InvalidPath("the session folder is not a folder") from None
        raise


def private_file(path: Path | str) -> None:
    """Make sure the file at ``path`` (created empty if missing) is ours alone: 0600, whatever the
    umask and the mode of the folder it is in (a storage root made beforehand is often 0755). One made
    by an earlier version with a looser mode is tightened; a file of another owner, or a link, is left.

    An existing file is never opened: closing any descriptor of a file drops every POSIX lock this
    process holds on it, and SQLite keeps its locks on the index that way."""
    try:
        fd = os.open(path, _NEW_FLAGS, FILE_MODE)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
        return
    with fd_closing(fd):
        tighten(fd)


def tighten(fd: int) -> None:
    """0600 for a file of ours that other users could read or write."""
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)


def write_private(path: Path | str, data: bytes) -> None:
    """Write a whole small file of ours, 0600 (truncating what is there; never through a link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    with fd_closing(fd):
        tighten(fd)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]


def make_dir(path: Path, owner: Owner = None, *, mode: int = DIR_MODE) -> bool:
    """mkdir that applies mode exactly (no umask surprise) and the owner; True if created."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return False
    with fd_closing(os.open(path, DIR_FLAGS)) as fd:
        os.fchmod(fd, mode)
        chown(fd, owner)
    return True


def walk_dirs(root_fd: int, parts: Iterable[str], *, create: bool = False, owner: Owner = None) -> int:
    """Open the directory root/parts..., refusing symlinks; mkdir missing ones when create is set.

    Returns a new fd the caller must close.
    """
    fd = os.dup(root_fd)
    done: list[str] = []
    try:
        for part in parts:
            done.append(part)
            new = _open_child_dir(fd, part, done, create, owner)
            os.close(fd)
            fd = new
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_child_dir(fd: int, part: str, done: list[str], create: bool, owner: Owner) -> int:
    for _ in range(3):
        try:
            return os.open(part, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise FileMissing(f"the folder {'/'.join(done)} does not exist") from None
            try:
                os.mkdir(part, DIR_MODE, dir_fd=fd)
            except FileExistsError:
                continue  # created by someone else meanwhile, or it is a link: the open decides
            new = os.open(part, DIR_FLAGS, dir_fd=fd)
            chown(new, owner)
            return new
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise InvalidPath(f"{'/'.join(done)} is {_describe_at(fd, part)}, not a folder") from None
            raise
    raise StorageError(f"the folder {'/'.join(done)} keeps changing; try again")


def _describe_at(dir_fd: int, name: str) -> str:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return "missing"
    return "a " + kind_of(st.st_mode)


def kind_of(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "folder"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode):
        return "char device"
    if stat.S_ISBLK(mode):
        return "block device"
    return "unknown"


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_regular(root_fd: int, parts: tuple[str, ...]) -> int:
    """Open root/parts for reading; it must be a regular file reached without any symlink."""
    path = "/".join(parts)
    with fd_closing(walk_dirs(root_fd, parts[:-1])) as parent:
        name = parts[-1]
        before = lstat_at(parent, name)
        if before is None:
            raise FileMissing(f"{path} does not exist")
        if not stat.S_ISREG(before.st_mode):
            raise InvalidPath(f"{path} is a {kind_of(before.st_mode)}, not a regular file")
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            raise FileMissing(f"{path} does not exist") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise InvalidPath(f"{path} is a symlink, not a regular file") from None
            raise
        after = os.fstat(fd)
        # Swapped between lstat and open (e.g. for a FIFO): refuse what we opened.
        if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            os.close(fd)
            raise InvalidPath(f"{path} changed while being opened; try again")
        return fd


def read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, _CHUNK):
        chunks.append(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _temp_name() -> str:
    return f".tmp-{secrets.token_hex(8)}"


def _write_temp(dir_fd: int, data: bytes, owner: Owner) -> tuple[str, os.stat_result]:
    tmp = _temp_name()
    fd = os.open(tmp, _NEW_FLAGS, FILE_MODE, dir_fd=dir_fd)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
            chown(fd, owner)
            return tmp, os.fstat(fd)
        finally:
            os.close(fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageError("the disk is full; the file was not written") from exc
        raise


def atomic_write(dir_fd: int, name: str, data: bytes, owner: Owner, path: str) -> os.stat_result:
    """Write name in dir_fd through a temp file + rename, so readers see the old or the new content."""
    old = lstat_at(dir_fd, name)
    if old is not None and stat.S_ISDIR(old.st_mode):
        raise InvalidPath(f"{path} is a folder")
    tmp, st = _write_temp(dir_fd, data, owner)
    try:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if exc.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
            raise InvalidPath(f"{path} is a folder") from None
        raise
    return st


def write_unique(dir_fd: int, names: Iterable[str], data: bytes, owner: Owner) -> tuple[str, os.stat_result]:
    """Write data under the first of `names` that does not exist yet; never replaces anything.

    link(2) fails if the target exists, which makes "take this name if free" atomic.
    """
    tmp, st = _write_temp(dir_fd, data, owner)
    try:
        for name in names:
            try:
                os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                continue
            return name, st
        raise StorageError("could not find a free file name; rename or delete some files")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)


def unlink_file(root_fd: int, parts: tuple[str, ...]) -> os.stat_result:
    """Remove a non-directory entry (a symlink is removed, not followed). Returns its lstat."""
    path = "/".join(parts)
    with fd_closing(walk_dirs(root_fd, parts[:-1])) as parent:
        st = lstat_at(parent, parts[-1])
        if st is None:
            raise FileMissing(f"{path} does not exist")
        if stat.S_ISDIR(st.st_mode):
            raise InvalidPath(f"{path} is a folder; only files can be removed")
        try:
            os.unlink(parts[-1], dir_fd=parent)
        except FileNotFoundError:
            raise FileMissing(f"{path} does not exist") from None
        return st


def rename_file(
    root_fd: int, src: tuple[str, ...], dst: tuple[str, ...], *, overwrite: bool, owner: Owner
) -> tuple[os.stat_result, os.stat_result | None]:
    """Move a regular file; returns (its lstat, lstat of the file it replaced or None)."""
    src_path, dst_path = "/".join(src), "/".join(dst)
    with (
        fd_closing(walk_dirs(root_fd, src[:-1])) as src_dir,
        fd_closing(walk_dirs(root_fd, dst[:-1], create=True, owner=owner)) as dst_dir,
    ):
        st = lstat_at(src_dir, src[-1])
        if st is None:
            raise FileMissing(f"{src_path} does not exist")
        if not stat.S_ISREG(st.st_mode):
            raise InvalidPath(f"{src_path} is a {kind_of(st.st_mode)}; only regular files can be renamed")
        old = lstat_at(dst_dir, dst[-1])
        if old is not None and stat.S_ISDIR(old.st_mode):
            raise InvalidPath(f"{dst_path} is a folder")
        if old is not None and not overwrite:
            raise FileExists(f"{dst_path} already exists")
        if overwrite:
            os.rename(src[-1], dst[-1], src_dir_fd=src_dir, dst_dir_fd=dst_dir)
        else:
            # link + unlink instead of rename: link fails if dst appeared meanwhile, rename would not.
            try:
                os.link(src[-1], dst[-1], src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
            except FileExistsError:
                raise FileExists(f"{dst_path} already exists") from None
            os.unlink(src[-1], dir_fd=src_dir)
        return st, old


def remove_tree_at(dir_fd: int, name: str) -> None:
    """Delete name (file or tree) inside dir_fd, never following a link; entries that vanish meanwhile
    are fine.

    A session folder may hold a chain of folders thousands of levels deep (sandboxed code can `chdir`
    down without limit). A recursive delete would hit Python's recursion limit, and one open folder per
    level would exhaust file descriptors; instead the children of each non-empty subfolder are moved
    up into the folder being emptied, so at most two folders are open at any time and every entry is
    moved at most once.
    """
    st = lstat_at(dir_fd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        return
    try:
        top = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    with fd_closing(top):
        while _empty_one_level(top):
            pass
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=dir_fd)


def _empty_one_level(top: int) -> bool:
    """Unlink the files of `top`, remove its empty subfolders and hoist the children of the others into
    it. Returns False once `top` is empty."""
    with os.scandir(top) as listing:
        entries = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in listing]
    for name, is_dir in entries:
        with contextlib.suppress(FileNotFoundError):
            if not is_dir:
                os.unlink(name, dir_fd=top)
                continue
            try:
                os.rmdir(name, dir_fd=top)
                continue
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
            with fd_closing(os.open(name, DIR_FLAGS, dir_fd=top)) as sub:
                _hoist_children(sub, top)
    return bool(entries)


def _hoist_children(sub: int, top: int) -> None:
    with os.scandir(sub) as listing:
        children = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in listing]
    for child, is_dir in children:
        with contextlib.suppress(FileNotFoundError):
            if not is_dir:
                os.unlink(child, dir_fd=sub)
                continue
            while True:
                try:  # a random name that no entry of `top` has: a rename never replaces a full folder
                    os.rename(child, f".rm-{secrets.token_hex(8)}", src_dir_fd=sub, dst_dir_fd=top)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise


def remove_tree(path: Path) -> None:
    """Delete a directory tree we own (trash entries, published copies); missing is fine."""
    try:  # the parent is ours (the trash, the publish folder): an admin may have made it a link
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    with fd_closing(parent):
        remove_tree_at(parent, path.name)


def copy_fd(src: int, dst: int) -> None:
    """Copy from the current offset of src to dst, in the kernel when possible. Holes stay holes: a
    sparse file of 1 TiB that holds a few bytes must not become 1 TiB of zeros on the host disk."""
    start = os.lseek(src, 0, os.SEEK_CUR)
    end = os.fstat(src).st_size
    position = start
    while position < end:
        try:
            data = os.lseek(src, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                break
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            data = position  # no hole support here: copy everything
        try:
            hole = os.lseek(src, data, os.SEEK_HOLE)
        except OSError:
            hole = end
        os.lseek(src, data, os.SEEK_SET)
        os.lseek(dst, data - start, os.SEEK_SET)
        _copy_range(src, dst, hole - data)
        position = hole
    os.ftruncate(dst, end - start)


def _copy_range(src: int, dst: int, count: int) -> None:
    try:
        while count > 0:
            sent = os.sendfile(dst, src, None, min(count, _CHUNK))
            if sent == 0:
                return
            count -= sent
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    while count > 0 and (chunk := os.read(src, min(count, _CHUNK))):
        _write_all(dst, chunk)
        count -= len(chunk)


def move_aside_unchanged(
    root_fd: int,
    parts: tuple[str, ...],
    wanted: dict[str, tuple[int, int]],
    trash_fd: int,
    bin_name: str,
    limit: int,
    absent: list[str] | None = None,
) -> list[str] | None:
    """Move the regular files of the folder `parts` (under root_fd) whose (size, mtime_ns) still match
    `wanted` out of the session into the trash (trash_fd, ours), without unlinking anything.

    When such files are all the folder holds (and it is not the session folder itself), the folder goes
    in one rename and an empty one of the same mode and owner takes its place; otherwise each file goes
    in one rename into trash/<bin_name>/ (made on first use; `bin_name` is new for each call), at most
    `limit` of them. Returns the names moved (None: the folder
    is missing or not a folder); `absent` gets the names of `wanted` the folder does not hold. A rename
    is atomic: a name is either still in the session or already out of it, whatever happens when."""
    try:
        folder = walk_dirs(root_fd, parts)
    except (FileMissing, InvalidPath):
        return None
    with fd_closing(folder):
        with os.scandir(folder) as listing:
            entries = [(entry.name, entry.stat(follow_symlinks=False)) for entry in listing]
        if absent is not None:
            held = {name for name, _ in entries}
            absent.extend(name for name in wanted if name not in held)
        moving = [
            name
            for name, st in entries
            if stat.S_ISREG(st.st_mode) and wanted.get(name) == (st.st_size, st.st_mtime_ns)
        ]
        if not moving:
            return moving
        if parts and len(moving) == len(entries):
            st = os.fstat(folder)
            try:
                parent = walk_dirs(root_fd, parts[:-1])
            except (FileMissing, InvalidPath):
                return None
            with fd_closing(parent):
                named = lstat_at(parent, parts[-1])
                if named is None or (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
                    return None  # the name no longer leads to the folder we listed
                os.rename(parts[-1], f"{bin_name}.dir", src_dir_fd=parent, dst_dir_fd=trash_fd)
                # The folder stays (empty), as unlinking its files would have left it.
                with contextlib.suppress(FileExistsError):
                    os.mkdir(parts[-1], DIR_MODE, dir_fd=parent)
                    with fd_closing(os.open(parts[-1], DIR_FLAGS, dir_fd=parent)) as made:
                        if os.geteuid() == 0:
                            os.fchown(made, st.st_uid, st.st_gid)
                        os.fchmod(made, stat.S_IMODE(st.st_mode))
            return moving
        with contextlib.suppress(FileExistsError):
            os.mkdir(bin_name, DIR_MODE, dir_fd=trash_fd)
        moved = []
        with fd_closing(os.open(bin_name, DIR_FLAGS, dir_fd=trash_fd)) as bin_fd:
            for i, name in enumerate(moving[:limit]):
                with contextlib.suppress(FileNotFoundError):
                    os.rename(name, str(i), src_dir_fd=folder, dst_dir_fd=bin_fd)
                    moved.append(name)
        return moved
