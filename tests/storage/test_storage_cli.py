"""The CLI, run as a real subprocess against a temporary store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from storage import DirectoryPublisher, Store
from tests.storage.storage_helpers import REPO, temporary_chat

Cli = Callable[..., subprocess.CompletedProcess[str]]
Sql = Callable[..., list[tuple[Any, ...]]]
_ENV = ("CODE_SESSIONS_ROOT", "DATA_DIR", "CODE_SESSIONS_DATABASE_URL")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k not in _ENV}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "storage", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=full_env,
    )


@pytest.fixture
def cli(database_url: str) -> Cli:
    """The CLI against the test's backend (the database URL from the environment, as an admin sets it)."""

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, env={"CODE_SESSIONS_DATABASE_URL": database_url, **(env or {})})

    return run


@pytest.fixture
async def populated(root: Path, publisher: DirectoryPublisher, database_url: str) -> Path:
    temporary = temporary_chat
    async with Store(root, publisher=publisher, database_url=database_url, temporary_chat=temporary) as store:
        a = await store.session("alice", "chat-1")
        await a.files.write("report.csv", b"a,b\n1,2\n")
        await a.files.write("plots/chart.png", b"\x89PNG")
        await a.publish("plots/chart.png")
        b = await store.session("bob", "temporary:x")
        await b.files.write("notes.txt", b"hello")
        await a.run_budget()  # records the quotas in use for the CLI
    return root


def test_listings_as_tables_and_json(populated: Path, cli: Cli) -> None:
    root = str(populated)
    out = cli("--root", root, "sessions")
    assert out.returncode == 0, out.stderr
    assert "alice" in out.stdout and "chat-1" in out.stdout and "USER" in out.stdout
    rows = json.loads(cli("--root", root, "sessions", "--json").stdout)
    assert {(r["user_id"], r["chat_id"], r["files"]) for r in rows} == {
        ("alice", "chat-1", 2),
        ("bob", "temporary:x", 1),
    }
    assert (
        json.loads(cli("--root", root, "--json", "sessions", "--user", "bob").stdout)[0]["temporary"] is True
    )

    files = json.loads(cli("--root", root, "files", "chat-1", "--json").stdout)
    assert [f["path"] for f in files] == ["plots/chart.png", "report.csv"]
    prefix = rows[0]["chat_key"][:8] if rows[0]["chat_id"] == "chat-1" else rows[1]["chat_key"][:8]
    assert "report.csv" in cli("--root", root, "files", prefix).stdout
    missing = cli("--root", root, "files", "nope")
    assert missing.returncode == 2 and "no session" in missing.stderr

    usage = json.loads(cli("--root", root, "usage", "--json").stdout)
    assert usage["quotas"]["max_files_per_user"] == 5000
    # alice's 12 bytes of files and the 4-byte published copy of her chart
    assert {u["user_id"]: u["bytes"] for u in usage["users"]} == {"alice": 16, "bob": 5}
    assert "1 GiB" in cli("--root", root, "usage").stdout

    links = json.loads(cli("--root", root, "links", "--json").stdout)
    assert [li["path"] for li in links] == ["plots/chart.png"]
    assert json.loads(cli("--root", root, "links", "--chat", "other", "--json").stdout) == []


def test_check_exit_code_and_rebuild(populated: Path, cli: Cli) -> None:
    root = str(populated)
    ok = cli("--root", root, "check")
    assert ok.returncode == 0 and "matches" in ok.stdout
    session_dirs = list((populated / "sessions").glob("alice-*/chat-1-*"))
    (session_dirs[0] / "sneaky.txt").write_text("x")
    drift = cli("--root", root, "check")
    assert drift.returncode == 1
    assert "file not indexed" in drift.stdout and "sneaky.txt" in drift.stdout
    items = json.loads(cli("--root", root, "check", "--json").stdout)
    assert [(d["kind"], d["path"]) for d in items] == [("file not indexed", "sneaky.txt")]
    rebuilt = json.loads(cli("--root", root, "rebuild", "--json").stdout)
    assert rebuilt["added"] == 1 and rebuilt["sessions"] == 2
    assert cli("--root", root, "check").returncode == 0


def test_a_rebuild_by_the_cli_keeps_a_temporary_chat_temporary(
    populated: Path, cli: Cli, index_sql: Sql
) -> None:
    """The CLI cannot know the host's temporary chat ids: the chat's sidecar remembers it."""
    root = str(populated)
    index_sql("DELETE FROM files")
    index_sql("DELETE FROM links")
    index_sql("DELETE FROM sessions")
    rebuilt = json.loads(cli("--root", root, "rebuild", "--json").stdout)
    assert rebuilt["sessions"] == 2
    rows = json.loads(cli("--root", root, "sessions", "--json").stdout)
    assert {r["chat_id"]: r["temporary"] for r in rows} == {"chat-1": False, "temporary:x": True}


def test_cleanup_commands(populated: Path, cli: Cli, index_sql: Sql) -> None:
    root = str(populated)
    dry = json.loads(cli("--root", root, "cleanup", "--dry-run", "--all", "--json").stdout)
    assert dry["dry_run"] and dry["sessions_removed"] == 2
    assert len(json.loads(cli("--root", root, "sessions", "--json").stdout)) == 2
    policy = cli("--root", root, "cleanup")
    assert policy.returncode == 0 and "policy:" in policy.stdout and "removed 0 sessions" in policy.stdout
    index_sql("UPDATE sessions SET last_used_at = last_used_at - 3 * 86400 WHERE user_id = 'bob'")
    idle = json.loads(cli("--root", root, "cleanup", "--idle", "2d", "--json").stdout)
    assert [d["chat_id"] for d in idle["details"]] == ["temporary:x"]
    user = cli("--root", root, "cleanup", "--user", "alice")
    assert "removed 1 sessions" in user.stdout and "alice" in user.stdout
    assert json.loads(cli("--root", root, "sessions", "--json").stdout) == []
    bad = cli("--root", root, "cleanup", "--idle", "soon")
    assert bad.returncode == 2 and "duration" in bad.stderr
    log = json.loads(cli("--root", root, "log", "--limit", "3", "--json").stdout)
    assert log[0]["event"] == "cleanup" and len(log) == 3
    assert "session_removed" in cli("--root", root, "log").stdout


def test_root_resolution(populated: Path, tmp_path: Path, cli: Cli) -> None:
    assert cli("sessions", env={"CODE_SESSIONS_ROOT": str(populated)}).returncode == 0
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    os.symlink(populated, data_dir / "code_sessions")
    assert "alice" in cli("sessions", env={"DATA_DIR": str(data_dir)}).stdout
    none = cli("sessions")
    assert none.returncode == 2 and "--root" in none.stderr
    missing = cli("--root", str(tmp_path / "nowhere"), "sessions")
    assert missing.returncode == 2 and "no store" in missing.stderr


async def test_check_shows_what_a_dead_run_left_unindexed_and_rebuild_indexes_it(
    populated: Path, database_url: str, cli: Cli
) -> None:
    async with Store(populated, database_url=database_url) as store:
        s = await store.session("alice", "chat-1")
        async with s.lock():
            await s.begin_run()  # the run's process dies before its reconcile: the mark stays
            (s.path / "left.txt").write_bytes(b"left by the dead run")
    check = cli("--root", str(populated), "check", "--json")
    assert check.returncode == 1, check.stdout + check.stderr
    assert [(d["kind"], d["path"]) for d in json.loads(check.stdout)] == [("file not indexed", "left.txt")]
    assert cli("--root", str(populated), "check").returncode == 1  # it repaired nothing
    assert cli("--root", str(populated), "cleanup", "--dry-run").returncode == 0
    assert cli("--root", str(populated), "check").returncode == 1  # a dry run changes nothing either
    assert cli("--root", str(populated), "rebuild").returncode == 0
    again = cli("--root", str(populated), "check")
    assert again.returncode == 0, again.stdout + again.stderr


async def test_usage_shows_each_users_branch_states(
    root: Path, publisher: DirectoryPublisher, database_url: str, cli: Cli
) -> None:
    async with Store(root, publisher=publisher, database_url=database_url) as store:
        session = await store.session("alice", "chat-1")
        async with session.lock():
            for i in range(3):
                (session.path / "f.txt").write_text(str(i) * 1000)
                await session.history.save(f"m{i}", keep_states=20, keep_kernels=3, room_bytes=None)
        await session.run_budget()
    usage = json.loads(cli("--root", str(root), "usage", "--json").stdout)
    [alice] = usage["users"]
    # Three states; what they count is the two versions the folder no longer holds.
    assert (alice["branch_states"], alice["branch_state_bytes"]) == (3, 2000), alice
    table = cli("--root", str(root), "usage").stdout
    assert "STATES SIZE" in table and "2.0 KiB" in table, table
    # A history saved before the folder's bytes were recorded is counted against the folder as it is.
    stats = session.history.folder / "stats.json"
    older = {k: v for k, v in json.loads(stats.read_text()).items() if k != "live_bytes"}
    stats.write_text(json.dumps(older))
    usage = json.loads(cli("--root", str(root), "usage", "--json").stdout)
    assert usage["users"][0]["branch_state_bytes"] == 2000, usage
