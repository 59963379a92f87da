"""Warm starts: a new chat's kernel resumed from a template image that has the data stack imported.

Importing numpy, pandas and matplotlib takes seconds in gVisor, and it is the first thing nearly every
data chat does. So, once per host, sandbox environment and set of lifetime limits (the template's
key is the same identity a saved kernel records), a kernel is started in an empty folder, made to
import the data stack (without binding any name in its namespace), and checkpointed into
`<bundle_dir>/templates/<key>/kernel`. A chat's first run then resumes that image with its own folder
at /mnt/data instead of starting a cold kernel.

What a template must not share between chats is made fresh after each resume (`RESEED`): `random`'s
generator, numpy's global generator, `tempfile`'s name generator. What stays the same in every kernel
resumed from one template: the `hash()` secret of str and bytes, the memory layout of the Python
process, and the module objects' state at import. Inside gVisor these are a kernel's own business:
knowing them helps a cell attack only its own process (hash flooding, an exploit of the interpreter),
which it runs anyway; nothing of another chat lives in that process. A template holds no user data: it
is made by this module's code in an empty folder, before any chat runs in it.

The template is built in the background the first time a chat starts without one, and only one
process of the host builds it (an exclusive marker file). Until it exists, kernels start cold. A
template that cannot be resumed is removed and rebuilt; its chat starts cold, with nothing lost.

A template is worth it only to a chat that uses the data stack: resuming its 80 MiB takes longer
than a cold kernel's start (about 0.34 s against 0.27 s here) and the kernel holds about 110 MiB more.
So a new chat's kernel resumes the template only when its first cell is bash (a data chat's first
look at its files) or Python that imports a module from outside the standard library
(`wants_template`); a first cell such as `print(1)` starts cold, and the template is still built for
the next data chat. A chat that starts with the standard library and imports pandas later pays that
import then, as without templates.

Every file of a template is checked against its recorded sha256 the first time this process resumes
it, and again only if a file was replaced or rewritten since (its inode, size or modification time
changed): reading 80 MiB beside every warm start's restore cost it about 0.1 s on a busy host.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from . import _delta, _hibernate
from ._hibernate import ImageRefused
from ._kernel import KERNEL_SOURCE, Kernel, KernelLost, NotSaved
from .models import Limits
from .runner import Runner

log = logging.getLogger("code_sessions.runner")

# Imported through importlib: the modules are loaded, no name of the namespace is bound (a chat's
# code still needs its own `import pandas as pd`, which is then instant). The read_csv warms the lazy
# imports a first read needs.
WARM_UP = """
def _warm():
    import importlib
    import io
    import sys
    for name in ("numpy", "pandas", "matplotlib", "matplotlib.pyplot"):
        try:
            importlib.import_module(name)
        except Exception:
            pass
    pandas = sys.modules.get("pandas")
    if pandas is not None:
        pandas.read_csv(io.StringIO("a,b\\n1,2\\n")).describe()
_warm()
del _warm
"""

RESEED = """
def _reseed():
    import sys
    if "random" in sys.modules:
        sys.modules["random"].seed()  # from os.urandom, which the sentry answers afresh
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    if "tempfile" in sys.modules:
        sys.modules["tempfile"]._name_sequence = None
_reseed()
del _reseed
"""

# An import at a line's (or a statement's) start: `import a.b as c, d` or `from a.b import c`. Read from
# the first _SCANNED characters of the cell only; a false match (in a string) only means a warm start.
_IMPORT = re.compile(
    r"(?:^|;)[ \t]*(?:from[ \t]+([A-Za-z_]\w*)|import[ \t]+([A-Za-z_][\w \t.,]*))", re.MULTILINE
)
_SCANNED = 64 * 1024
_STANDARD = frozenset(sys.stdlib_module_names)

_BUILD_TIMEOUT_S = 120.0
_STALE_MARKER_S = 300.0  # a build marker older than this was left by a process that died building


def wants_template(code: str, language: str) -> bool:
    """Whether a new chat whose first cell is `code` should start from the template: bash, or Python
    that imports anything outside the standard library (pandas, numpy, seaborn, sklearn ...)."""
    if language != "python":
        return True
    for match in _IMPORT.finditer(code[:_SCANNED]):
        names = [match.group(1)] if match.group(1) else match.group(2).split(",")
        for name in names:
            words = name.split()
            if words and words[0].split(".")[0] not in _STANDARD:
                return True
    return False


class WarmStart:
    def __init__(self, runner: Runner, folder: Path) -> None:
        self.runner = runner
        self.folder = folder
        self._building: asyncio.Task[None] | None = None
        self._failed: set[str] = set()  # keys whose build failed in this process: not retried here
        self._verified: dict[str, tuple[object, ...]] = {}  # key -> stamp of the image checked whole

    def _key(self, identity: dict[str, object]) -> str:
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]

    async def resume(self, workdir: Path, limits: Limits, identity: dict[str, object]) -> Kernel | None:
        """A kernel for a new chat resumed from the template with `workdir` at /mnt/data, or None
        (no template yet: one is being built; or it failed to resume: it is removed)."""
        key = self._key(identity)
        place = self.folder / key
        try:
            image = await asyncio.to_thread(_hibernate.load, place, _read_id(place), identity)
        except ImageRefused:
            self._build_soon(key, limits, identity)
            return None
        sandbox, watch = await self.runner.prepare(
            KERNEL_SOURCE,
            "python",
            workdir,
            limits,
            prefix="cs-k-",
            compile_once=True,
            kernel=True,
            restore_from=image.folder,
        )
        kernel = Kernel(sandbox, limits)
        try:
            stamp = await asyncio.to_thread(_hibernate.stamp, image)
            verified = self._verified.get(key) == stamp
            check = _no_check if verified else functools.partial(_hibernate.verify, image)
            await kernel.resume_checked(watch, image.ready, RESEED, check)
        except (KernelLost, ImageRefused, OSError) as lost:
            log.warning("kernel template %s could not be resumed, removed: %s", key, lost)
            self._verified.pop(key, None)
            await kernel.close()
            await asyncio.to_thread(_hibernate.discard, place)
            return None
        except BaseException:
            await kernel.close()
            raise
        self._verified[key] = stamp
        recorded = image.files.get("pages.img")
        if recorded and isinstance(recorded[1], str):
            kernel.base = _delta.Base(recorded[1], image.folder / "pages.img", int(recorded[0]))
        return kernel

    def pages(self, identity: dict[str, object]) -> Path:
        """Where the template of this identity keeps its pages (whether or not it is built)."""
        return _hibernate.image_dir(self.folder / self._key(identity)) / "pages.img"

    async def build_if_missing(self, limits: Limits, identity: dict[str, object]) -> None:
        """Start building the template in the background if there is none (a chat started cold)."""
        key = self._key(identity)
        if key in self._verified:
            return  # resumed by this process already
        if not await asyncio.to_thread(_read_id, self.folder / key):
            self._build_soon(key, limits, identity)

    def _build_soon(self, key: str, limits: Limits, identity: dict[str, object]) -> None:
        if key in self._failed or (self._building is not None and not self._building.done()):
            return
        self._building = asyncio.create_task(self._build(key, limits, identity))

    async def _build(self, key: str, limits: Limits, identity: dict[str, object]) -> None:
        place = self.folder / key
        marker = self.folder / f"{key}.building"
        if not await asyncio.to_thread(_claim, marker):
            return  # another process of this host is building it
        empty = Path(
            await asyncio.to_thread(tempfile.mkdtemp, prefix="template-", dir=self.runner.bundle_dir)
        )
        kernel: Kernel | None = None
        t0 = time.monotonic()
        try:
            sandbox, watch = await self.runner.prepare(
                KERNEL_SOURCE, "python", empty, limits, prefix="cs-t-", compile_once=True, kernel=True
            )
            kernel = Kernel(sandbox, limits)
            await kernel.start(watch)
            warm = await kernel.run(
                WARM_UP, "python", limits.model_copy(update={"timeout_s": _BUILD_TIMEOUT_S})
            )
            if not warm.ok:
                raise NotSaved(f"the warm-up failed: {warm.reason} {warm.stderr[-300:]}")
            staging = await asyncio.to_thread(_hibernate.new_staging, place)
            try:
                await kernel.checkpoint(staging, self.runner.checkpoint_flags())
                # Kept as runsc wrote it (not compressed): every warm start restores it.
                await asyncio.to_thread(
                    functools.partial(
                        _hibernate.seal, staging, place, identity, kernel.ready_fields(), packed=False
                    )
                )
            finally:
                await asyncio.to_thread(shutil.rmtree, staging, True)
            log.info("kernel template %s built in %.1f s", key, time.monotonic() - t0)
        except (KernelLost, NotSaved, ImageRefused, OSError) as error:
            self._failed.add(key)
            log.warning("kernel template %s could not be built: %s", key, error)
        finally:
            if kernel is not None:
                await kernel.close("a template is made")
            await asyncio.to_thread(shutil.rmtree, empty, True)
            with contextlib.suppress(OSError):
                os.unlink(marker)

    async def wait_built(self) -> None:
        """For tests and the bench: wait for a build this process started."""
        if self._building is not None:
            await asyncio.shield(self._building)


def _no_check() -> None:
    """The template's files were verified whole by this process, and have not changed since."""


def _read_id(place: Path) -> str:
    try:
        with open(_hibernate.image_dir(place) / _hibernate.META, "rb") as fh:
            meta = json.loads(fh.read(1 << 16))
        return str(meta.get("id", "")) if isinstance(meta, dict) else ""
    except (OSError, ValueError):
        return ""


def _claim(marker: Path) -> bool:
    marker.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        if time.time() - marker.stat().st_mtime > _STALE_MARKER_S:
            os.unlink(marker)
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    return True
