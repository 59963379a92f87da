"""The index schema, as migrations keyed by version (PRAGMA user_version).

Each step takes the database from version N-1 to N inside the opening transaction. Never edit a
released step: add a new one. A database newer than the last step is refused (written by a newer
release; downgrading would lose data).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

# Version 1: sessions, files (with triggers keeping the session totals), links and meta.
_V1 = """
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

CREATE TABLE sessions (
    id           INTEGER PRIMARY KEY,
    user_id      TEXT NOT NULL,
    chat_id      TEXT NOT NULL,
    user_key     TEXT NOT NULL,
    chat_key     TEXT NOT NULL,
    temporary    INTEGER NOT NULL DEFAULT 0,
    created_at   REAL NOT NULL,
    last_used_at REAL NOT NULL,
    bytes        INTEGER NOT NULL DEFAULT 0,
    file_count   INTEGER NOT NULL DEFAULT 0,
    UNIQUE (user_id, chat_id),
    UNIQUE (user_key, chat_key)
);
-- The two UNIQUE constraints index user_id and user_key as prefixes; the quota check is a SUM over
-- the user's rows found through (user_key, chat_key).
CREATE INDEX sessions_last_used ON sessions (last_used_at);

CREATE TABLE files (
    session_id   INTEGER NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    path         TEXT NOT NULL,
    size         INTEGER NOT NULL,
    mtime_ns     INTEGER NOT NULL,
    first_seen   REAL NOT NULL,
    last_changed REAL NOT NULL,
    PRIMARY KEY (session_id, path)
) WITHOUT ROWID;

CREATE TABLE links (
    token      TEXT PRIMARY KEY,
    session_id INTEGER REFERENCES sessions (id) ON DELETE CASCADE,
    path       TEXT NOT NULL,
    name       TEXT NOT NULL,
    url        TEXT NOT NULL,
    directory  TEXT NOT NULL,
    size       INTEGER NOT NULL,
    mtime_ns   INTEGER NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL
);
CREATE INDEX links_file ON links (session_id, path);

-- sessions.file_count / bytes follow the files rows in every code path (reconcile, file operations,
-- expiry, cascades), so the user quota check is a SUM over a user's few session rows.
CREATE TRIGGER files_inserted AFTER INSERT ON files BEGIN
    UPDATE sessions SET file_count = file_count + 1, bytes = bytes + NEW.size WHERE id = NEW.session_id;
END;
CREATE TRIGGER files_deleted AFTER DELETE ON files BEGIN
    UPDATE sessions SET file_count = file_count - 1, bytes = bytes - OLD.size WHERE id = OLD.session_id;
END;
CREATE TRIGGER files_updated AFTER UPDATE OF size, session_id ON files BEGIN
    UPDATE sessions SET file_count = file_count - 1, bytes = bytes - OLD.size WHERE id = OLD.session_id;
    UPDATE sessions SET file_count = file_count + 1, bytes = bytes + NEW.size WHERE id = NEW.session_id;
END;
"""

# Version 2: the audit trail.
_V2 = """
CREATE TABLE activity (
    id      INTEGER PRIMARY KEY,
    at      REAL NOT NULL,
    event   TEXT NOT NULL,
    user_id TEXT,
    chat_id TEXT,
    detail  TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX activity_at ON activity (at);
"""

# Version 3: where uploaded files came from, so the caller copies each attachment into a chat once
# (chat UIs send the same attachment with every later message) and a file the user deleted stays deleted.
_V3 = """
CREATE TABLE imports (
    session_id  INTEGER NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    source      TEXT NOT NULL,
    path        TEXT NOT NULL,
    imported_at REAL NOT NULL,
    PRIMARY KEY (session_id, source)
) WITHOUT ROWID;
"""

# Version 4: how many names of files with several hard links the last full listing of a session
# found. A write through one name changes the others without anything naming them, so while there
# are any, a reconcile lists the whole folder instead of only the paths a run changed (_partial).
_V4 = """
ALTER TABLE sessions ADD COLUMN linked_files INTEGER NOT NULL DEFAULT 0;
"""

# Version 5: links know which publisher holds their copy (`kind`: a folder served by the web server,
# or the web server's own file store) and the bytes they were made from: a content hash, plus the
# file's inode and ctime, which sandboxed code cannot set back (it can restore size and mtime), so
# an unchanged file is known without hashing it again. `expires_at` was never written. Published
# copies count toward the user's storage limit: `sessions.published_bytes` follows the links rows
# the way `bytes` follows the files rows. `unpublished`: copies whose link is gone but that only
# their publisher can delete (the CLI cannot reach the web server's file store); the application
# deletes them at its next cleanup. `sessions.missing_since`: when the web UI was first seen not to
# have the session's chat any more (it is deleted once a second look, a while later, agrees).
_V5 = """
ALTER TABLE links ADD COLUMN kind TEXT NOT NULL DEFAULT 'directory';
ALTER TABLE links ADD COLUMN sha256 TEXT;
ALTER TABLE links ADD COLUMN inode INTEGER NOT NULL DEFAULT 0;
ALTER TABLE links ADD COLUMN ctime_ns INTEGER NOT NULL DEFAULT 0;
ALTER TABLE links DROP COLUMN expires_at;
ALTER TABLE sessions ADD COLUMN published_bytes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE sessions ADD COLUMN missing_since REAL;
UPDATE sessions SET published_bytes =
    (SELECT coalesce(sum(size), 0) FROM links WHERE session_id = sessions.id);
CREATE TRIGGER links_inserted AFTER INSERT ON links BEGIN
    UPDATE sessions SET published_bytes = published_bytes + NEW.size WHERE id = NEW.session_id;
END;
CREATE TRIGGER links_deleted AFTER DELETE ON links BEGIN
    UPDATE sessions SET published_bytes = published_bytes - OLD.size WHERE id = OLD.session_id;
END;
CREATE TABLE unpublished (
    kind      TEXT NOT NULL,
    token     TEXT NOT NULL,
    queued_at REAL NOT NULL,
    PRIMARY KEY (kind, token)
);
"""

MIGRATIONS: Sequence[str] = (_V1, _V2, _V3, _V4, _V5)
CURRENT_VERSION = len(MIGRATIONS)


def statements(script: str) -> list[str]:
    """Split a migration script into statements (executescript would COMMIT our transaction)."""
    result: list[str] = []
    current = ""
    for line in script.splitlines(keepends=True):
        current += line
        # complete_statement knows about literals and comments, unlike a split on ';'.
        if sqlite3.complete_statement(current):
            result.append(current.strip())
            current = ""
    if current.strip() and not all(
        not ln.strip() or ln.strip().startswith("--") for ln in current.splitlines()
    ):
        raise ValueError(f"incomplete SQL statement in a migration: {current.strip()[:80]}")
    return result
