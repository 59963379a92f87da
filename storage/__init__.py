"""code-sessions storage: per-chat session folders, their index, quotas, expiry, publishing.

It knows nothing of the web UI or of the sandbox; see docs/storage.md.
"""

from ._format import human_bytes, parse_duration
from ._names import MAX_PATH_BYTES, PASSIVE_IMAGE_TYPES
from ._postgres import is_postgres_url
from .errors import (
    DiskFull,
    FileExists,
    FileMissing,
    IndexDamaged,
    InvalidPath,
    QuotaExceeded,
    StorageBusy,
    StorageError,
)
from .models import (
    ActivityEntry,
    CleanupReport,
    Drift,
    Expiry,
    FileEntry,
    Growth,
    Link,
    LinkInfo,
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
from .policy import CLEAR_FILES_COMMAND, Policy
from .publishing import Copy, DirectoryPublisher, Published, Publisher
from .session import Session, SessionFiles
from .store import Store

__all__ = [
    "CLEAR_FILES_COMMAND",
    "MAX_PATH_BYTES",
    "PASSIVE_IMAGE_TYPES",
    "ActivityEntry",
    "CleanupReport",
    "Copy",
    "DirectoryPublisher",
    "DiskFull",
    "Drift",
    "Expiry",
    "FileEntry",
    "FileExists",
    "FileMissing",
    "Growth",
    "IndexDamaged",
    "InvalidPath",
    "Link",
    "LinkInfo",
    "Policy",
    "Published",
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
    "is_postgres_url",
    "parse_duration",
]
