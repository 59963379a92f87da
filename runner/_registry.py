"""The kernel registry: one small file per key (`<registry_dir>/<digest>.json`, kept across restarts)
saying where the key's kernel lives (host, process and its start time, socket), when it was last used,
and, once it ended, why. Every worker of a host (and every host sharing the folder) reads it.

Writes are best effort: a registry that cannot be written (a full disk) must not stop a chat from
running code (which may be what frees the space).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("code_sessions.runner")

STARTING = "starting-"  # the cid of an entry that holds a place for a kernel being started
_MAX_ENTRY = 1 << 16
_RUNNING = re.compile(rb'"running"\s*:\s*true')  # what json.dumps writes for a running entry


def _host_id() -> str:
    """This host, for the registry (shared by several hosts when the store is): its name and boot,
    or CODE_SESSIONS_HOST_ID (replicas sharing one machine, as in the tests, are told apart by it)."""
    if os.environ.get("CODE_SESSIONS_HOST_ID"):
        return os.environ["CODE_SESSIONS_HOST_ID"][:200]
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}:{boot}"


HOST = _host_id()


@dataclass
class Entry:
    key: str
    cid: str
    host: str
    owner: str  # "<pid> <start time> <pool>" of the process (and its pool) that started it
    socket: str
    workdir: str
    started_at: float
    last_used: float
    running: bool
    reason: str = ""  # why it ended, once it has
    stop_requested: str = ""  # another host asks the owner to stop it (the chat moved there)
    image: str = ""  # it ended saved to disk: the id of its image in the chat's state folder
    unsaved: bool = False  # it should have been saved, and `reason` says why it could not be
    saving: bool = False  # its owner is writing its image now: wait, then resume it

    @classmethod
    def load(cls, path: Path) -> Entry | None:
        try:
            raw = path.read_bytes()[:_MAX_ENTRY]
        except OSError:
            return None
        return cls.parse(raw)

    @classmethod
    def parse(cls, raw: bytes) -> Entry | None:
        try:
            data = json.loads(raw)
            fields = cls.__dataclass_fields__
            entry = cls(**{k: data[k] for k in fields if k in data})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        typed = all(isinstance(getattr(entry, k), type(getattr(cls, k, ""))) for k in ("image", "reason"))
        return entry if typed else None


def digest(key: str) -> str:
    """The key as a file name."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def owned_here(entry: Entry) -> bool:
    """A running entry whose owning process is alive on this host (its kernel dies with it)."""
    if entry.host != HOST:
        return False
    try:
        pid, started = entry.owner.split()[:2]
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode() == started
    except (OSError, ValueError, IndexError):
        return False


class Registry:
    """The entries in one folder. Blocking file I/O: the pool calls it in a thread."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, key: str) -> Path:
        return self.folder / f"{digest(key)}.json"

    def get(self, key: str) -> Entry | None:
        entry = Entry.load(self.path(key))
        return entry if entry is not None and entry.key == key else None

    def save(self, entry: Entry) -> None:
        """Best effort: until it can be written, other workers do not find this kernel, and a restart
        cannot say why the state went."""
        path = self.path(entry.key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entry.__dict__), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("kernel registry: cannot record %s: %s", entry.cid, error)

    def save_if_same(self, entry: Entry) -> None:
        """Save ``entry`` unless the key's entry now names another kernel."""
        now = self.get(entry.key)
        if now is not None and now.cid == entry.cid:
            self.save(entry)

    def touch(self, key: str, cid: str, when: float) -> None:
        """The kernel ``cid`` of ``key`` was last used at ``when`` (epoch seconds)."""
        entry = self.get(key)
        if entry is not None and entry.cid == cid:
            entry.last_used = when
            self.save(entry)

    def running_here(self) -> list[Entry]:
        """The entries of kernels running on this host. Every start reads them (under the host-wide
        lock), and a host keeps an entry per saved chat: a thousand of them took 33 ms to parse, so
        an entry that does not say it is running is not parsed at all."""
        found = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.folder) as listing:
            for item in listing:
                if not item.name.endswith(".json"):
                    continue
                try:
                    with open(item.path, "rb") as fh:
                        data = fh.read(_MAX_ENTRY)
                except OSError:
                    continue
                if _RUNNING.search(data) is None:
                    continue
                entry = Entry.parse(data)
                if entry is not None and entry.running and owned_here(entry):
                    found.append(entry)
        return found
