"""code-sessions storage: per-chat session folders, an SQLite index, quotas, expiry, publishing.

It knows nothing of the web UI or of the sandbox; see docs/storage.md.
"""

from ._format import human_bytes, parse_duration
from .errors import FileExists, FileMissing, InvalidPath, QuotaExceeded, StorageBusy, StorageError
from .models import (
    ActivityEntry,
    CleanupReport,
    Drift,
    Expiry,
    FileEntry,
    Link,
    LinkInfo,
    Publisher,
    Purge,
    QuotaRemoval,
    Quotas,
    RebuildReport,
    ReconcileReport,
    Rejected,
    Renamed,
    RunBudget,
    SessionCleanup,
    SessionInfo,
    Usage,
    UserUsage,
)
from .session import Session, SessionFiles
from .store import Store

__all__ = [
    "ActivityEntry",
    "CleanupReport",
    "Drift",
    "Expiry",
    "FileEntry",
    "FileExists",
    "FileMissing",
    "InvalidPath",
    "Link",
    "LinkInfo",
    "Publisher",
    "Purge",
    "QuotaExceeded",
    "QuotaRemoval",
    "Quotas",
    "RebuildReport",
    "ReconcileReport",
    "Rejected",
    "Renamed",
    "RunBudget",
    "Session",
    "SessionCleanup",
    "SessionFiles",
    "SessionInfo",
    "StorageBusy",
    "StorageError",
    "Store",
    "Usage",
    "UserUsage",
    "human_bytes",
    "parse_duration",
]
