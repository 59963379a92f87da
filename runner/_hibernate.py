"""A kernel's saved image on disk: what `runsc checkpoint` wrote, and what restoring it needs.

A saved image is a folder (`<state dir>/kernel`, in the chat's state area the caller names) holding
the files runsc wrote and `meta.json`:

    {"format": 1, "id": "<token>", "identity": {...}, "ready": {...}, "files": {name: [size, sha256]},
     "saved_at": <unix time>}

`identity` is everything the image was made with and needs again: the runsc version and platform, the
sandbox's root file system, interpreter and user, the kernel program's digest and the lifetime limits
(memory, processes, file size: the last two are rlimits of the process, which the image carries).
An image whose identity differs from the host's now is refused with a sentence, not tried; one whose
files do not match their recorded sizes and digests (damaged, truncated, swapped) likewise. A folder is
written beside the final one and renamed into place, so a crash mid-save leaves the older image or
none, never half of one.

Pure file work, blocking: call it from a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 1
IMAGE_DIR = "kernel"
META = "meta.json"
_MAX_META = 1 << 16
_MAX_FILES = 32


class ImageRefused(Exception):
    """The saved image cannot be used; the message says why, in words for the user."""


@dataclass(frozen=True)
class SavedImage:
    folder: Path
    id: str
    identity: dict[str, Any]
    ready: dict[str, Any]
    size: int
    files: dict[str, list[Any]]  # name -> [size, sha256] as recorded


def image_dir(state_dir: Path) -> Path:
    return state_dir / IMAGE_DIR


def new_staging(state_dir: Path) -> Path:
    """An empty private folder beside the final one, for runsc to write the image into."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    staging = state_dir / f".{IMAGE_DIR}-{secrets.token_hex(6)}"
    staging.mkdir(mode=0o700)
    return staging


def _digest(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def image_files(folder: Path, *, digests: bool = True) -> dict[str, list[Any]]:
    """Each regular file runsc wrote, with its size and digest (no links, no folders); without
    `digests`, the digest is None."""
    files: dict[str, list[Any]] = {}
    for entry in os.scandir(folder):
        if entry.name == META:
            continue
        if not entry.is_file(follow_symlinks=False):
            raise ImageRefused(f"the image holds an unexpected entry {entry.name!r}")
        size = entry.stat(follow_symlinks=False).st_size
        files[entry.name] = [size, _digest(Path(entry.path)) if digests else None]
    if not files or len(files) > _MAX_FILES:
        raise ImageRefused(f"runsc wrote {len(files)} image files")
    return files


def seal(staging: Path, state_dir: Path, identity: dict[str, Any], ready: dict[str, Any]) -> SavedImage:
    """Record what the image needs beside it and move it into place (replacing an older one)."""
    files = image_files(staging)
    token = secrets.token_hex(12)
    meta = {
        "format": FORMAT,
        "id": token,
        "identity": identity,
        "ready": ready,
        "files": files,
        "saved_at": time.time(),
    }
    fd = os.open(staging / META, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(meta, fh)
        fh.flush()
        os.fsync(fh.fileno())
    final = image_dir(state_dir)
    discard(state_dir, staging=False)  # the older image (a rename cannot replace a non-empty folder)
    os.rename(staging, final)
    with contextlib.suppress(OSError):
        dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return SavedImage(final, token, identity, ready, sum(size for size, _ in files.values()), files)


def copy_image(source: Path, state_dir: Path) -> str:
    """Put the saved image of the state folder `source` in `state_dir` too (replacing the one there),
    sharing its files (hard links: images are written once and never changed in place), and return
    its id. ImageRefused when `source` holds no readable image."""
    folder = image_dir(source)
    try:
        with open(folder / META, "rb") as fh:
            meta = json.loads(fh.read(_MAX_META))
        token = meta["id"]
        names = [entry.name for entry in os.scandir(folder) if entry.is_file(follow_symlinks=False)]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ImageRefused(f"its saved image cannot be read: {error}") from error
    if not isinstance(token, str) or len(names) > _MAX_FILES + 1:
        raise ImageRefused("its saved image has an unknown format")
    staging = new_staging(state_dir)
    try:
        for name in names:
            try:
                os.link(folder / name, staging / name)
            except OSError:  # another file system
                shutil.copyfile(folder / name, staging / name)
        discard(state_dir, staging=False)
        os.rename(staging, image_dir(state_dir))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return token


def saved_bytes_beside(state_dir: Path) -> int:
    """The recorded bytes of the saved images in `state_dir` and the state folders beside it (one
    owner's), read from their records; a folder without a readable record counts nothing."""
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(state_dir.parent) as listing:
        for folder in listing:
            try:
                with open(Path(folder.path) / IMAGE_DIR / META, "rb") as fh:
                    files = json.loads(fh.read(_MAX_META)).get("files", {})
                total += sum(int(size) for size, _digest in files.values())
            except (OSError, ValueError, TypeError, AttributeError):
                continue
    return total


def discard(state_dir: Path, *, staging: bool = True) -> None:
    """Remove the saved image (and, with `staging`, any folder a save was writing or a crash left)."""
    with contextlib.suppress(FileNotFoundError), os.scandir(state_dir) as listing:
        for entry in listing:
            if entry.name == IMAGE_DIR or (staging and entry.name.startswith(f".{IMAGE_DIR}-")):
                gone = state_dir / f".{IMAGE_DIR}-gone-{secrets.token_hex(6)}"
                try:
                    os.rename(entry.path, gone)
                except OSError:
                    continue
                shutil.rmtree(gone, ignore_errors=True)


def load(state_dir: Path, expected_id: str, identity: dict[str, Any]) -> SavedImage:
    """The saved image with id `expected_id`, checked whole and fit for this host; else ImageRefused."""
    folder = image_dir(state_dir)
    try:
        st = folder.lstat()
        with open(folder / META, "rb") as fh:
            meta = json.loads(fh.read(_MAX_META))
    except FileNotFoundError as error:
        raise ImageRefused("its saved image is missing") from error
    except (OSError, ValueError) as error:
        raise ImageRefused(f"its saved image cannot be read: {error}") from error
    if not folder.is_dir() or folder.is_symlink() or st.st_uid != os.geteuid():
        raise ImageRefused("its saved image is not a folder of ours")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ImageRefused("its saved image has an unknown format")
    if meta.get("id") != expected_id:
        raise ImageRefused("its saved image is not the one its kernel wrote last")
    mismatch = [
        f"{name} {meta['identity'].get(name)!r}, now {value!r}"
        for name, value in identity.items()
        if not isinstance(meta.get("identity"), dict) or meta["identity"].get(name) != value
    ]
    if mismatch:
        raise ImageRefused("it was saved by another sandbox: " + "; ".join(mismatch)[:300])
    recorded = meta.get("files")
    try:
        found = image_files(folder, digests=False)
    except OSError as error:
        raise ImageRefused(f"its saved image cannot be read: {error}") from error
    if not isinstance(recorded, dict) or {k: v[0] for k, v in found.items()} != {
        k: v[0] if isinstance(v, list) and v else None for k, v in recorded.items()
    }:
        raise ImageRefused("its saved image is damaged (its files differ from what was recorded)")
    ready = meta.get("ready")
    if not isinstance(ready, dict):
        raise ImageRefused("its saved image has no kernel description")
    size = sum(s for s, _ in found.values())
    return SavedImage(folder, expected_id, meta["identity"], ready, size, recorded)


def verify(image: SavedImage) -> None:
    """The image's files have the digests recorded when it was saved; else ImageRefused. (load()
    checks names and sizes only: this reads every byte, so it runs while runsc restores, and the
    restored kernel is trusted only once both are done.)"""
    try:
        found = image_files(image.folder)
    except OSError as error:
        raise ImageRefused(f"its saved image cannot be read: {error}") from error
    if found != image.files:
        raise ImageRefused("its saved image is damaged (its files differ from what was recorded)")


def stamp(image: SavedImage) -> tuple[object, ...]:
    """What would change if the image's files were replaced or rewritten (their inode, size and
    modification time): an image verified once and with the same stamp need not be read again."""
    found = []
    for name in sorted(image.files):
        st = (image.folder / name).stat(follow_symlinks=False)
        found.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
    return (image.id, *found)


def size_of(state_dir: Path) -> int:
    """Bytes the saved image takes (0 without one)."""
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(image_dir(state_dir)) as listing:
        for entry in listing:
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_size
    return total
