"""Upload links: one chat, one path, one use, a few minutes.

A link is a random token (256 bits, in the URL); what it grants is a record named by the token's
SHA-256 in a folder only root can read, so neither a listing of that folder nor the record itself
reveals a usable token. Using a link renames its record to a `.used` tombstone first (a rename is
atomic: of two requests at once, one wins), so a second use is refused with a sentence that says
why, as is an expired one. Records and tombstones are removed two days after they were made.

The folder is the caller's to choose: it must be the same for every worker and replica that may
receive the POST (see webui/uploads.py), which is why a record also carries `where`, the caller's own
note of where the chat's files are.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._format import human_duration
from ._fsops import write_private
from ._names import split_path
from .errors import StorageError

__all__ = ["LinkRefused", "UploadGrant", "UploadLinks"]

_TOKEN = re.compile(r"[A-Za-z0-9_-]{43}")
_KEEP_S = 2 * 24 * 3600.0  # records and tombstones are removed this long after they were made
_VERSION = 1
_ASK_AGAIN = "Ask in the chat for a new upload link."


class LinkRefused(StorageError):
    """The upload link cannot be used; the message says why, and what to do. `kind`: "unknown", "used"
    or "expired"."""

    def __init__(self, message: str, kind: str = "unknown") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class UploadGrant:
    user_id: str
    chat_id: str
    path: str  # relative to /mnt/data
    made_at: float
    expires_at: float
    where: dict[str, Any] = field(default_factory=dict)  # the maker's note of where the chat's files are
    message_id: str = ""  # the answer that offered the link: the file belongs to its state ("": none)


class UploadLinks:
    def __init__(self, folder: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.folder = folder
        self._clock = clock

    async def mint(
        self,
        user_id: str,
        chat_id: str,
        path: str,
        *,
        ttl_s: float,
        where: dict[str, Any] | None = None,
        message_id: str = "",
    ) -> tuple[str, UploadGrant]:
        """A new link for `path` in the chat: its token (for the URL) and what it grants. `message_id`:
        the answer that offers it, whose state the file joins."""
        rel = "/".join(split_path(path))
        now = self._clock()
        grant = UploadGrant(user_id, chat_id, rel, now, now + ttl_s, dict(where or {}), message_id)
        token = secrets.token_urlsafe(32)
        record = {"version": _VERSION, **_as_dict(grant)}

        def work() -> None:
            self._make_folder()
            self._remove_old(now)
            write_private(self._record(token), json.dumps(record).encode())

        await asyncio.to_thread(work)
        return token, grant

    async def peek(self, token: str) -> UploadGrant:
        """What the link grants, without using it. Raises LinkRefused (unknown, used, expired)."""
        return await asyncio.to_thread(self._check, token, False)

    async def claim(self, token: str) -> UploadGrant:
        """Use the link: from now on it is refused as used. Raises LinkRefused (unknown, used, expired)."""
        return await asyncio.to_thread(self._check, token, True)

    # ---- internals -------------------------------------------------------------------------------------

    def _check(self, token: str, claim: bool) -> UploadGrant:
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise LinkRefused(f"This upload link is not valid (it is incomplete or mistyped). {_ASK_AGAIN}")
        record = self._record(token)
        used = record.with_suffix(".used")
        grant = _read(record)
        if grant is None:
            if used.exists():
                raise LinkRefused(
                    f"This upload link was used already: a link takes one file. {_ASK_AGAIN}", "used"
                )
            raise LinkRefused(
                f"This upload link is not valid (unknown, or older than two days). {_ASK_AGAIN}"
            )
        late = self._clock() - grant.expires_at
        if late > 0:
            minutes = human_duration(round(grant.expires_at - grant.made_at))
            raise LinkRefused(
                f"This upload link expired {human_duration(max(1, round(late)))} ago (links last {minutes}). "
                f"{_ASK_AGAIN}",
                "expired",
            )
        if claim:
            try:
                os.rename(record, used)
            except FileNotFoundError:  # another request used it a moment ago
                raise LinkRefused(
                    f"This upload link was used already: a link takes one file. {_ASK_AGAIN}", "used"
                ) from None
        return grant

    def _record(self, token: str) -> Path:
        return self.folder / (hashlib.sha256(token.encode()).hexdigest()[:40] + ".json")

    def _make_folder(self) -> None:
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)

    def _remove_old(self, now: float) -> None:
        with contextlib.suppress(OSError), os.scandir(self.folder) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < now - _KEEP_S:
                        os.unlink(entry.path)


def _as_dict(grant: UploadGrant) -> dict[str, Any]:
    return {
        "user_id": grant.user_id,
        "chat_id": grant.chat_id,
        "path": grant.path,
        "made_at": grant.made_at,
        "expires_at": grant.expires_at,
        "where": grant.where,
        "message_id": grant.message_id,
    }


def _read(path: Path) -> UploadGrant | None:
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read(1 << 16))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return None
    try:
        return UploadGrant(
            str(data["user_id"]),
            str(data["chat_id"]),
            str(data["path"]),
            float(data["made_at"]),
            float(data["expires_at"]),
            dict(data.get("where") or {}),
            str(data.get("message_id") or ""),
        )
    except (KeyError, TypeError, ValueError):
        return None
