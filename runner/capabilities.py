"""What the installed runsc can do, detected once per binary rather than assumed.

gVisor's flags change between releases (Debian 12 ships a 2022 build with ptrace and kvm; current
releases add systrap, --directfs, --overlay2 defaults ...). Passing a flag an old runsc does not know
makes it refuse to start, so every optional flag the runner uses is checked against `runsc flags`.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from dataclasses import dataclass

from .errors import RunnerError, RunscNotFound

# Newest first: the first one the binary offers is the automatic choice. kvm is never chosen
# automatically: it needs /dev/kvm, which containers rarely have.
_PLATFORM_PREFERENCE = ("systrap", "ptrace")
_PROBE_TIMEOUT_S = 15.0
_FLAG_LINE = re.compile(r"^\s+-{1,2}([A-Za-z0-9][A-Za-z0-9_-]*)", re.MULTILINE)
_cache: dict[tuple[str, int, int], RunscInfo] = {}


@dataclass(frozen=True)
class RunscInfo:
    """Facts about one runsc binary."""

    path: str
    version: str
    flags: frozenset[str]
    platforms: tuple[str, ...]
    checkpoint_flags: frozenset[str] = frozenset()  # what `runsc checkpoint` accepts

    def supports(self, flag: str) -> bool:
        return flag.lstrip("-") in self.flags

    def auto_platform(self) -> str:
        for name in _PLATFORM_PREFERENCE:
            if name in self.platforms:
                return name
        # An unknown future runsc that lists none of ours: let it use its own default.
        return self.platforms[0] if self.platforms else "ptrace"


def resolve_runsc(runsc_path: str) -> str:
    """Absolute path of an executable runsc, or RunscNotFound."""
    if os.sep in runsc_path:
        if not os.path.isfile(runsc_path):
            raise RunscNotFound(runsc_path, "no such file")
        if not os.access(runsc_path, os.X_OK):
            raise RunscNotFound(runsc_path, "not executable")
        return os.path.abspath(runsc_path)
    found = shutil.which(runsc_path)
    if found is None:
        raise RunscNotFound(runsc_path, "not on PATH")
    return found


async def run_quick(argv: list[str], timeout_s: float = _PROBE_TIMEOUT_S) -> tuple[int, str]:
    """Run a short helper command; returns (exit status, stdout+stderr). Never hangs past timeout_s."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode if proc.returncode is not None else -1, out.decode("utf-8", "replace")


def parse_flags(text: str) -> frozenset[str]:
    return frozenset(_FLAG_LINE.findall(text))


def parse_platforms(text: str) -> tuple[str, ...]:
    names = [line.strip() for line in text.splitlines()]
    return tuple(n for n in names if re.fullmatch(r"[a-z0-9_]+", n))


async def detect_runsc(runsc_path: str) -> RunscInfo:
    """Probe runsc once (three quick subcommands, run concurrently) and cache by binary identity."""
    path = resolve_runsc(runsc_path)
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    if key in _cache:
        return _cache[key]
    try:
        (v_rc, v_out), (_, f_out), (p_rc, p_out), (_, c_out) = await asyncio.gather(
            run_quick([path, "--version"]),
            run_quick([path, "flags"]),
            run_quick([path, "help", "platforms"]),
            run_quick([path, "help", "checkpoint"]),
        )
    except TimeoutError as exc:
        raise RunnerError(f"{path} did not answer `--version` within {_PROBE_TIMEOUT_S:.0f} s") from exc
    except OSError as exc:
        raise RunscNotFound(runsc_path, str(exc)) from exc
    match = re.search(r"runsc version (\S+)", v_out)
    if v_rc != 0 or match is None:
        raise RunscNotFound(
            runsc_path, f"`{path} --version` did not answer like runsc: {v_out.strip()[:200]!r}"
        )
    platforms = parse_platforms(p_out) if p_rc == 0 else ()
    info = RunscInfo(
        path=path,
        version=match.group(1),
        flags=parse_flags(f_out),
        platforms=platforms,
        checkpoint_flags=parse_flags(c_out),
    )
    _cache[key] = info
    return info
