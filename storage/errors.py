"""The one exception hierarchy of the storage package.

Every error a caller can see derives from StorageError, so `except StorageError` is always enough.
Messages are written for the person at the chat: they say what happened and what to do.
"""

from __future__ import annotations

import errno

__all__ = [
    "DiskFull",
    "FileExists",
    "FileMissing",
    "HistoryError",
    "IndexDamaged",
    "InvalidPath",
    "QuotaExceeded",
    "SessionGone",
    "StorageBusy",
    "StorageError",
    "disk_error",
]


class StorageError(Exception):
    """Base class of every error raised by the storage package."""


class InvalidPath(StorageError):
    """A path is malformed (absolute, `..`, NUL, ...) or names something that is not a regular file,
    or goes through a symbolic link."""


class FileMissing(StorageError):
    """The file does not exist in the session."""


class FileExists(StorageError):
    """The destination of a rename already exists and overwriting was not asked for."""


class QuotaExceeded(StorageError):
    """A user-facing limit is reached; the message says which one and how to get below it."""


class SessionGone(StorageError):
    """The chat's session no longer exists (its chat was deleted, or it was purged or expired): what
    was meant for it is not kept, and nothing of the session is made again."""


class StorageBusy(StorageError):
    """The index or a session stayed locked by someone else for too long."""


class DiskFull(StorageError):
    """The disk that holds the sessions or the index has no room left. Nothing was lost: what could
    not be written was not written, and the index is as it was before."""

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "The disk that holds the chats' files is full, so this could not be saved; nothing that "
            "was there is lost. Delete some files, or ask an admin to free space, then try again."
        )


class IndexDamaged(StorageError):
    """The index file is damaged (truncated, overwritten). The store moves it aside and rebuilds it
    from the session folders; callers see this only if that recovery itself failed."""


class HistoryError(StorageError):
    """A state of a chat's history cannot be saved or restored (no longer kept, damaged, too many
    files); the message says why, for the user."""


def disk_error(error: OSError, what: str) -> StorageError:
    """The StorageError for an OSError of the disk under storage's own files (a full disk is DiskFull;
    the rest says `what` could not be done, and why, without naming a host path)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull()
    return StorageError(f"{what}: {error.strerror or error.__class__.__name__}")
