"""Saving a live kernel to its chat's state folder, so the next run resumes it: `runsc checkpoint` into
a staging folder, sealed as the folder's image (runner/_hibernate.py), kept only within the bounds the
pool is given (one image's size, and all the images of one owner together)."""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from . import _delta, _hibernate
from ._hibernate import ImageRefused, SavedImage
from ._kernel import Kernel, NotSaved, lifetime_limits
from ._registry import Entry, Registry
from ._supervise import human_bytes
from .models import KernelSettings

log = logging.getLogger("code_sessions.runner")

Refusal = Callable[[Path, SavedImage], "str | None"]

# What zstd compresses per second at least here, at its level 3 on a loaded core (a random frame's pages
# went at ~110 MB/s, a pandas kernel's at ~250 MB/s): at exit, an image is compressed only if twice
# this estimate fits in the time left.
_EXIT_PACK_BYTES_PER_S = 100 * 2**20


def refusal(
    state_dir: Path, image: SavedImage, max_image_bytes: int | None, max_together: int | None
) -> str | None:
    """Why a sealed image may not be kept (blocking: it reads the neighbours' records), or None."""
    size = f"{image.size / 2**20:.0f} MiB"
    if max_image_bytes is not None and image.size > max_image_bytes:
        limit = human_bytes(max_image_bytes)
        return f"its image of {size} is over the {limit} allowed for a saved state"
    if max_together is not None:
        together = _hibernate.saved_bytes_beside(state_dir)
        if together > max_together:
            return (
                f"with its image of {size}, this user's saved states would take "
                f"{human_bytes(together)}, over the {human_bytes(max_together)} allowed together"
            )
    return None


async def save(
    key: str,
    kernel: Kernel,
    state_dir: Path,
    flags: list[str],
    identity: Callable[[], Awaitable[dict[str, object]]],
    refused: Refusal,
    *,
    packed: bool = True,
    base: _delta.Base | None = None,
) -> tuple[str, str]:
    """Checkpoint the kernel into `state_dir`, compressed if `packed` (its pages against `base`, the
    template they came from, when given): (image id, "") or ("", why it could not be kept)."""
    t0 = time.monotonic()
    staging: Path | None = None
    try:
        staging = await asyncio.to_thread(_hibernate.new_staging, state_dir)
        await kernel.checkpoint(staging, flags)
        image = await asyncio.to_thread(
            functools.partial(
                _hibernate.seal,
                staging,
                state_dir,
                await identity(),
                kernel.ready_fields(),
                packed=packed,
                base=base,
            )
        )
        staging = None
        why = await asyncio.to_thread(refused, state_dir, image)
        if why is not None:
            await asyncio.to_thread(_hibernate.discard, state_dir)
            raise NotSaved(why)
    except NotSaved as error:
        log.warning("kernel %s of %s: not saved: %s", kernel.cid, key, error)
        return "", str(error)
    except (OSError, ImageRefused) as error:
        why = "the disk is full" if getattr(error, "errno", None) == errno.ENOSPC else str(error)
        log.warning("kernel %s of %s: not saved: %s", kernel.cid, key, error)
        await asyncio.to_thread(_hibernate.discard, state_dir)
        return "", f"its image could not be written: {why}"[:300]
    finally:
        if staging is not None:
            await asyncio.to_thread(shutil.rmtree, staging, True)
    log_written(kernel, key, "saved to disk", t0, image)
    return image.id, ""


def log_written(kernel: Kernel, key: str, what: str, t0: float, image: SavedImage) -> None:
    """Log that an image of the key's kernel was written (`what`: saved, copied...), in the time since
    `t0` (time.monotonic), and its size."""
    log.info(
        "kernel %s of %s: %s in %.2f s (%.1f MiB)",
        kernel.cid,
        key,
        what,
        time.monotonic() - t0,
        image.size / 2**20,
    )


def save_at_exit(
    targets: list[tuple[str, Kernel, Path, KernelSettings]],
    registry: Registry,
    identity: dict[str, object],
    flags: list[str],
    within_s: float,
) -> None:
    """Save the idle ``targets`` (key, kernel, state folder, the chat's settings: the bounds its image
    is kept within, and whether it is compressed) at interpreter exit, within ``within_s``:
    every `runsc checkpoint` at once (processes: no new thread may start this late), then each image
    sealed. Blocking, as no event loop is left. A kernel not saved in time dies with the process, and
    its next run says so."""
    started: list[tuple[str, Kernel, Path, KernelSettings, Path, subprocess.Popen[bytes], Entry]] = []
    for key, kernel, state_dir, settings in targets:
        entry = registry.get(key)
        if entry is None or entry.cid != kernel.cid:
            continue
        try:
            staging = _hibernate.new_staging(state_dir)
            argv = kernel.checkpoint_argv(staging, flags)
            job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as error:
            log.warning("kernel %s of %s: not saved at exit: %s", kernel.cid, key, error)
            continue
        entry.saving = True
        registry.save(entry)
        started.append((key, kernel, state_dir, settings, staging, job, entry))
    deadline = time.monotonic() + within_s
    for key, kernel, state_dir, settings, staging, job, entry in started:
        image_id, why = "", "Open WebUI stopped before it was written"
        try:
            code = job.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            job.kill()
            code = None
        try:
            if code == 0:
                full = {**identity, "lifetime_limits": list(lifetime_limits(kernel.limits))}
                # Compressed only while the time left clearly allows it; else kept as runsc wrote it
                # (a larger image, resumed all the same).
                staged = sum(size for size, _ in _hibernate.image_files(staging, digests=False).values())
                fits = settings.compress and deadline - time.monotonic() > 2 * staged / _EXIT_PACK_BYTES_PER_S
                image = _hibernate.seal(staging, state_dir, full, kernel.ready_fields(), packed=fits)
                declined = refusal(
                    state_dir, image, settings.max_image_bytes, settings.max_saved_bytes_together
                )
                if declined is not None:
                    _hibernate.discard(state_dir)
                    why = declined
                else:
                    image_id = image.id
            elif code is not None:
                why = f"runsc could not save it (exit status {code})"
        except (OSError, ImageRefused) as error:
            log.warning("kernel %s of %s: not saved at exit: %s", kernel.cid, key, error)
            why = "its image could not be written"
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        entry.running, entry.saving, entry.image = False, False, image_id
        entry.unsaved, entry.reason = not image_id, "" if image_id else why
        registry.save(entry)
