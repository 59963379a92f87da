"""A kernel's saved image on disk: what `runsc checkpoint` wrote, and what restoring it needs.

A saved image is a folder (`<state dir>/kernel`, in the chat's state area the caller names) holding
the files runsc wrote, each compressed with zstd (`pages.img.zst` ...), and `meta.json`:

    {"format": 2, "id": "<token>", "identity": {...}, "ready": {...}, "files": {name: [size, sha256]},
     "codec": "zstd", "unpacked": {runsc's name: its size}, "saved_at": <unix time>}

`files` are the files on disk (what is sealed, checked and counted against the limits); `unpacked`,
runsc's names and sizes of those compressed (a file that compression does not halve is kept as runsc
wrote it, under its own name: memory full of random numbers compresses by a third, and would cost its
unpacking at every resume). Format 1 is the same without the codec: runsc's files as they are (a
template, an image no file of which compresses well, and one written where no `zstd` is installed or
at exit without time to compress it). runsc restores only
from plain files (it checks the state file's size, seeks it, and reads the pages file at offsets), so a
compressed image is unpacked into the restoring sandbox's private bundle first (`unpack`), and that
copy goes as soon as the kernel answers. zstd is Debian's command (`zstd`), run as a process of its
own: nothing of it runs in the caller's process, and the runner keeps to the standard library. Its level
3 keeps a pandas kernel's 80 MiB in about 18 MiB, written in about 0.3 s and read back in about 0.1 s
(docs/benchmarks.md); a frame of random numbers hardly compresses, and costs its time all the same.

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
import errno
import functools
import json
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _delta

FORMAT = 2
FORMATS = (1, 2)  # what load() reads: 1, runsc's files as they are; 2, each compressed
CODEC = "zstd"
ZSTD_LEVEL = 3
ZSTD_SUFFIX = ".zst"
DELTA_SUFFIX = ".delta.zst"  # pages stored against a template's (runner/_delta.py)
BASED = ("pages.img",)  # the file a base can stand for
IMAGE_DIR = "kernel"
META = "meta.json"
_MAX_META = 1 << 16
_MAX_FILES = 32
_ZSTD_TIMEOUT_S = 120.0  # a 2 GiB image at level 3 takes about 10 s here; a hung zstd must not hold a chat


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
    codec: str = ""  # "" (format 1: runsc's own files) or "zstd"
    unpacked: dict[str, int] = field(default_factory=dict)  # runsc's file -> its size (format 2)
    base: str = ""  # the sha256 of the template's pages its pages are stored against ("": none)
    unpacked_base_size: int = 0  # and their size

    @property
    def packed(self) -> bool:
        """Its files must be unpacked (`unpack`) before runsc can restore them."""
        return bool(self.codec)


def image_dir(state_dir: Path) -> Path:
    return state_dir / IMAGE_DIR


@functools.cache
def zstd_command() -> str | None:
    """The `zstd` program on PATH, or None (images are then kept as runsc wrote them)."""
    return shutil.which("zstd")


def codec_works() -> str:
    """The zstd here, after a round trip of a small buffer through it (for the doctor); OSError
    with what went wrong. Blocking."""
    program = zstd_command()
    if program is None:
        raise FileNotFoundError("zstd is not installed (not found on PATH)")
    sample = (b"code-sessions " * 5000)[:65536]
    packed = subprocess.run([program, "-q", "-c"], input=sample, capture_output=True, timeout=30)
    back = subprocess.run([program, "-q", "-d", "-c"], input=packed.stdout, capture_output=True, timeout=30)
    if packed.returncode or back.returncode or back.stdout != sample:
        raise OSError(f"{program} did not give back what it compressed: {back.stderr[-200:]!r}")
    version = subprocess.run([program, "-V"], capture_output=True, text=True, timeout=30).stdout
    return f"{program}, {version.strip().strip('*').strip() or 'version unknown'}"


def _zstd(args: list[str], doing: str) -> None:
    """Run zstd (its own process; blocking: call it from a thread); OSError with its words on failure."""
    _zstd_finish(_zstd_start(args, doing), doing)


def _zstd_start(args: list[str], doing: str) -> subprocess.Popen[bytes]:
    program = zstd_command()
    if program is None:
        raise FileNotFoundError(f"zstd is not installed here, which {doing} needs")
    return subprocess.Popen(
        [program, "-q", "--no-progress", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _zstd_finish(job: subprocess.Popen[bytes], doing: str) -> None:
    try:
        _, err = job.communicate(timeout=_ZSTD_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        job.kill()
        job.wait()
        raise OSError(f"zstd did not finish {doing} within {_ZSTD_TIMEOUT_S:g} s") from error
    if job.returncode != 0:
        words = err.decode("utf-8", "replace").strip().splitlines()[-1:]
        raise OSError(f"zstd failed {doing}: {(words or [f'exit {job.returncode}'])[0][:200]}")


def compress(staging: Path, base: _delta.Base | None = None) -> dict[str, int]:
    """Compress the files runsc wrote into `staging` in place (`pages.img` becomes `pages.img.zst`),
    one zstd process for them all, keeping each compressed only if that at least halves it (memory of
    random numbers hardly compresses: unpacking it at every resume would cost time for little disk);
    with a `base`, the pages are stored against it instead (`pages.img.delta.zst`). Returns the names
    and sizes of those kept compressed. Blocking."""
    sizes = {name: size for name, (size, _) in image_files(staging, digests=False).items()}
    if any(name.endswith(ZSTD_SUFFIX) for name in sizes):
        raise ImageRefused("runsc wrote a file named like a compressed one")
    unpacked = {}
    program = zstd_command()
    if base is not None and program is not None:
        for name in BASED:
            if name in sizes:
                delta = staging / (name + DELTA_SUFFIX)
                try:
                    _delta.encode(staging / name, base, delta, [program, f"-{ZSTD_LEVEL}", "-q", "-c"])
                except _delta.DeltaError as error:
                    raise OSError(str(error)) from error
                if 2 * delta.stat().st_size <= sizes[name]:  # as below: halved, or kept as it is
                    os.unlink(staging / name)
                    unpacked[name] = sizes.pop(name)
                else:
                    os.unlink(delta)
                    del sizes[name]
    if not sizes:
        return unpacked
    _zstd([f"-{ZSTD_LEVEL}", "-f", *(str(staging / name) for name in sorted(sizes))], "compressing")
    for name, size in sizes.items():
        packed = staging / (name + ZSTD_SUFFIX)
        if 2 * packed.stat().st_size <= size:
            os.unlink(staging / name)
            unpacked[name] = size
        else:
            os.unlink(packed)
    return unpacked


def new_staging(state_dir: Path) -> Path:
    """An empty private folder beside the final one, for runsc to write the image into."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    staging = state_dir / f".{IMAGE_DIR}-{secrets.token_hex(6)}"
    staging.mkdir(mode=0o700)
    return staging


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
        files[entry.name] = [size, _delta.digest_of(Path(entry.path)) if digests else None]
    if not files or len(files) > _MAX_FILES:
        raise ImageRefused(f"runsc wrote {len(files)} image files")
    return files


def seal(
    staging: Path,
    state_dir: Path,
    identity: dict[str, Any],
    ready: dict[str, Any],
    *,
    packed: bool = True,
    base: _delta.Base | None = None,
) -> SavedImage:
    """Compress what runsc wrote (`packed`, and zstd is installed; its pages against `base`, the
    template the kernel came from, when given), record what the image needs beside it and move it into
    place (replacing an older one)."""
    unpacked = compress(staging, base) if packed and zstd_command() is not None else {}  # {}: none pays
    based = [name for name in BASED if (staging / (name + DELTA_SUFFIX)).exists()]
    files = image_files(staging)
    token = secrets.token_hex(12)
    meta: dict[str, Any] = {
        "format": 2 if unpacked else 1,
        "id": token,
        "identity": identity,
        "ready": ready,
        "files": files,
        "saved_at": time.time(),
    }
    if unpacked:
        meta["codec"], meta["unpacked"] = CODEC, unpacked
    if based:
        assert base is not None
        meta["based"] = {"digest": base.digest, "size": base.size, "files": based}
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
    size = sum(size for size, _ in files.values())
    return SavedImage(
        final,
        token,
        identity,
        ready,
        size,
        files,
        meta.get("codec", ""),
        unpacked,
        base.digest if based and base else "",
        base.size if based and base else 0,
    )


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
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS:
        raise ImageRefused("its saved image has an unknown format")
    codec, unpacked, base = _codec_of(meta)
    base_size = int(meta["based"].get("size", 0)) if base else 0
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
    return SavedImage(
        folder, expected_id, meta["identity"], ready, size, recorded, codec, unpacked, base, base_size
    )


def _codec_of(meta: dict[str, Any]) -> tuple[str, dict[str, int], str]:
    """The codec, runsc's names and sizes and the base an image records ("", {} and "" for format 1)."""
    if meta["format"] == 1:
        return "", {}, ""
    codec, unpacked, files = meta.get("codec"), meta.get("unpacked"), meta.get("files")
    if codec != CODEC or not isinstance(unpacked, dict) or not isinstance(files, dict) or not unpacked:
        raise ImageRefused("its saved image has an unknown format")
    based = meta.get("based")
    base, delta = "", []
    if based is not None:
        if (
            not isinstance(based, dict)
            or not isinstance(based.get("digest"), str)
            or not isinstance(based.get("files"), list)
            or not set(based["files"]) <= set(BASED) & set(unpacked)
        ):
            raise ImageRefused("its saved image has an unknown format")
        base, delta = based["digest"], based["files"]
    packed = {name + (DELTA_SUFFIX if name in delta else ZSTD_SUFFIX) for name in unpacked}
    kept = set(files) - packed  # as runsc wrote them
    if (
        not all(isinstance(size, int) and size >= 0 for size in unpacked.values())
        or not packed <= set(files)
        or kept & set(unpacked)
        or any(name.endswith(ZSTD_SUFFIX) for name in kept)
    ):
        raise ImageRefused("its saved image has an unknown format")
    return codec, unpacked, base


def unpack(image: SavedImage, into: Path, base: _delta.Base | None = None) -> None:
    """Write runsc's files of a compressed image into the new private folder `into` (one zstd process;
    pages stored against a template from `base`, which must be that template's, checked), each checked
    to have the size it had when saved; ImageRefused (damaged, no base, or no zstd here) otherwise.
    A file kept uncompressed is linked there by name. Blocking. zstd checks each file's own checksum
    as it reads: a damaged file stops here."""
    into.mkdir(mode=0o700)
    for name in image.files:
        if not name.endswith(ZSTD_SUFFIX):
            os.symlink(os.path.abspath(image.folder / name), into / name)
    delta = [name for name in image.unpacked if name + DELTA_SUFFIX in image.files]
    sources = [
        str(image.folder / (name + ZSTD_SUFFIX)) for name in sorted(image.unpacked) if name not in delta
    ]
    doing = "unpacking it"
    try:
        # The small files unpack in their own process while this thread rebuilds the pages.
        job = _zstd_start(["-d", "-f", "--output-dir-flat", str(into), *sources], doing) if sources else None
        try:
            if delta:
                _unpack_delta(image, into, base, delta)
        except BaseException:
            if job is not None:
                job.kill()
                job.wait()
            raise
        if job is not None:
            _zstd_finish(job, doing)
    except FileNotFoundError as error:
        raise ImageRefused(f"its saved image is compressed, and {error}") from error
    except OSError as error:
        words = str(error).replace(f"{image.folder}/", "").replace(f"{into}/", "")
        if "no space left" in words.lower():
            raise ImageRefused("its saved image could not be unpacked: the disk is full") from error
        raise ImageRefused(f"its saved image is damaged ({words})") from error
    for name, size in image.unpacked.items():
        try:
            st = (into / name).stat()
        except OSError as error:
            raise ImageRefused(f"its saved image is damaged ({name} was not unpacked: {error})") from error
        if st.st_size != size:
            raise ImageRefused(f"its saved image is damaged ({name} unpacked to another size)")


def _unpack_delta(image: SavedImage, into: Path, base: _delta.Base | None, names: list[str]) -> None:
    if base is None or base.digest != image.base:
        raise ImageRefused(
            "its saved image was stored against the pages of the kernel template it started from, "
            "and those are gone or changed"
        )
    program = zstd_command()
    if program is None:
        raise ImageRefused(
            "its saved image is compressed, and zstd is not installed here, which unpacking it needs"
        )
    for name in names:
        try:
            _delta.decode(
                image.folder / (name + DELTA_SUFFIX),
                base,
                into / name,
                image.unpacked[name],
                [program, "-q", "-d", "-c"],
            )
        except _delta.DeltaError as error:
            raise ImageRefused(f"its saved image is damaged ({error})") from error
        except OSError as error:
            if error.errno == errno.ENOSPC:
                raise ImageRefused("its saved image could not be unpacked: the disk is full") from error
            raise ImageRefused(f"its saved image is damaged ({error})") from error


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
