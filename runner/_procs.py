"""Host processes of a sandbox: finding them without cgroups, and killing them."""

from __future__ import annotations

import contextlib
import os
import signal
from collections import defaultdict


def pids_by_marker(marker: str) -> list[int]:
    """Processes whose command line contains ``marker``, plus all their descendants (ptrace stubs
    have no command line of their own). This process is never among them."""
    needle = marker.encode()
    children: dict[int, list[int]] = defaultdict(list)
    marked: list[int] = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as fh:
                stat = fh.read()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        children[int(stat.rsplit(b")", 1)[1].split()[1])].append(pid)
        if needle in cmdline and pid != me:
            marked.append(pid)
    found: set[int] = set()
    queue = marked
    while queue:
        pid = queue.pop()
        if pid not in found:
            found.add(pid)
            queue.extend(children.get(pid, ()))
    return sorted(found)


def sigkill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def rss_bytes(pids: list[int]) -> int:
    """The summed resident memory of these processes (gone ones count 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            continue
    return total


def pss_bytes(pids: list[int]) -> int:
    """The proportional resident memory of these processes: a page they share (a sandbox's memory
    file, mapped by the sentry and by each stub process that runs the code) counts once, split
    among them, where summed RSS counts it in each. RSS for a process whose smaps cannot be read."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
                for line in fh:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            total += rss_bytes([pid])
    return total
