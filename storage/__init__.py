"""code-sessions storage: per-chat session folders, their index, quotas, expiry, publishing.

It knows nothing of the web UI or of the sandbox; see docs/storage.md.
"""

from ._format import human_bytes, human_duration, parse_duration
from ._incoming import Incoming
from ._names import MAX_PATH_BYTES, PASSIVE_IMAGE_TYPES, split_path
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
from .history import ChatHistory, HistoryError, HistoryHead, Restored, Saved
from .models import (
    ActivityEntry,
    ChatInfo,
    CleanupAction,
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
    Reconcile,
    ReconcileReport,
    Rejected,
    Renamed,
    RunBudget,
    Usage,
    UserUsage,
)
from .policy import CLEAR_FILES_COMMAND, Policy
from .publishing import Copy, DirectoryPublisher, Published, Publisher
from .session import ChatFiles, Session
from .store import Store
from .upload_links import LinkRefused, UploadGrant, UploadLinks

__all__ = [
    "CLEAR_FILES_COMMAND",
    "MAX_PATH_BYTES",
    "PASSIVE_IMAGE_TYPES",
    "ActivityEntry",
    "ChatFiles",
    "ChatHistory",
    "ChatInfo",
    "CleanupAction",
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
    "HistoryError",
    "HistoryHead",
    "Incoming",
    "IndexDamaged",
    "InvalidPath",
    "Link",
    "LinkInfo",
    "LinkRefused",
    "Policy",
    "Published",
    "Publisher",
    "Purge",
    "QuotaExceeded",
    "QuotaRemoval",
    "Quotas",
    "RebuildReport",
    "Reconcile",
    "ReconcileReport",
    "Rejected",
    "Renamed",
    "Restored",
    "RunBudget",
    "Saved",
    "Session",
    "StorageBusy",
    "StorageError",
    "Store",
    "UploadGrant",
    "UploadLinks",
    "Usage",
    "UserUsage",
    "human_bytes",
    "human_duration",
    "is_postgres_url",
    "parse_duration",
    "split_path",
]
