"""Where things live under the store root, and the sidecar files that remember real ids.

root/                       0700
  index.sqlite3(-wal,-shm)
  sessions/<user key>/<chat key>/   the folder mounted at /mnt/data
  state/<user key>/<chat key>.lock  flock target (outside the mount: the sandbox cannot touch it)
  state/<user key>/<chat key>.json  {user_id, chat_id, created_at}: lets a lost index be rebuilt
  state/<user key>/<chat key>.kernel/  the chat's saved state: opaque bytes the runner writes (a
                            sleeping Python kernel); it lives and goes with the session
  trash/                    a deleted session folder is renamed here first, then removed
  running/<user key>.<chat key>   a run is changing the folder: removed by the reconcile after it,
                            so one left behind marks a run its process did not live to index
  links/<digest>.json       what each published copy is (session, path, publisher, bytes): lets a
                            lost index take its links back, so old answers keep working
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._fsops import fd_closing
from ._keys import id_key

SIDECAR_VERSION = 1


@dataclass(frozen=True, slots=True)
class Layout:
    root: Path

    @property
    def db_path(self) -> Path:
        return self.root / "index.sqlite3"

    @property
    def sessions(self) -> Path:
        return self.root / "sessions"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def trash(self) -> Path:
        return self.root / "trash"

    @property
    def running(self) -> Path:
        return self.root / "running"

    @property
    def links(self) -> Path:
        return self.root / "links"

    def link_record(self, kind: str, ref: str) -> Path:
        # Refs are the publisher's (a token, a web server's file id): hashed into a safe file name.
        return self.links / (hashlib.sha256(f"{kind}\0{ref}".encode()).hexdigest()[:40] + ".json")

    def session_dir(self, user_key: str, chat_key: str) -> Path:
        return self.sessions / user_key / chat_key

    def lock_path(self, user_key: str, chat_key: str) -> Path:
        return self.state / user_key / f"{chat_key}.lock"

    def sidecar_path(self, user_key: str, chat_key: str) -> Path:
        return self.state / user_key / f"{chat_key}.json"

    def saved_state(self, user_key: str, chat_key: str) -> Path:
        """The chat's saved-state folder (not created here: its writer makes it, mode 0700)."""
        return self.state / user_key / f"{chat_key}.kernel"

    def saved_states(self) -> list[tuple[str, str, int]]:
        """(user key, chat key, bytes) of every saved-state folder on disk."""
        found: list[tuple[str, str, int]] = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.state) as users:
            for user in users:
                if not user.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError), os.scandir(user.path) as items:
                    for item in items:
                        if item.name.endswith(".kernel") and item.is_dir(follow_symlinks=False):
                            found.append(
                                (user.name, item.name[: -len(".kernel")], tree_bytes(Path(item.path)))
                            )
        return found

    def running_marker(self, user_key: str, chat_key: str) -> Path:
        # Keys never contain '.', so the name splits back unambiguously.
        return self.running / f"{user_key}.{chat_key}"

    def running_markers(self) -> list[tuple[str, str]]:
        """(user key, chat key) of every run that began and has not been reconciled yet."""
        found: list[tuple[str, str]] = []
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.running):
                user_key, dot, chat_key = name.partition(".")
                if dot:
                    found.append((user_key, chat_key))
        return found

    def session_keys_on_disk(self) -> list[tuple[str, str]]:
        """(user key, chat key) of every session folder; anything that is not a plain folder is ignored."""
        found: list[tuple[str, str]] = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.sessions) as users:
            for user in users:
                if not user.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError), os.scandir(user.path) as chats:
                    found.extend(
                        (user.name, chat.name) for chat in chats if chat.is_dir(follow_symlinks=False)
                    )
        return found


def tree_bytes(folder: Path) -> int:
    """Bytes of the regular files under `folder` (links not followed)."""
    total = 0
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                total += st.st_size
    return total


def write_sidecar(path: Path, user_id: str, chat_id: str, created_at: float, temporary: bool) -> None:
    """Create the sidecar once (never replaced: the first writer's created_at wins). `temporary` is
    remembered here because only the host knows which chat ids are temporary, and a rebuild from the
    folders (the CLI's too) must not make a temporary chat an ordinary one."""
    record = {"version": SIDECAR_VERSION, "user_id": user_id, "chat_id": chat_id, "created_at": created_at}
    data = json.dumps({**record, "temporary": temporary}).encode()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with fd_closing(fd):
            os.write(fd, data)
            os.fsync(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_sidecar(path: Path, user_key: str, chat_key: str) -> dict[str, Any] | None:
    """The sidecar's ids if it exists and matches the folder's keys (else None)."""
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    user_id, chat_id = data.get("user_id"), data.get("chat_id")
    if not isinstance(user_id, str) or not isinstance(chat_id, str):
        return None
    if id_key(user_id) != user_key or id_key(chat_id) != chat_key:
        return None
    created = data.get("created_at")
    return {
        "user_id": user_id,
        "chat_id": chat_id,
        "created_at": float(created) if isinstance(created, int | float) else None,
        "temporary": data.get("temporary") is True,
    }
