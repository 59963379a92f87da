"""A real PostgreSQL server for the tests (and the benchmarks), from Debian's `postgresql` package.

`postgres_server` (session scope) runs initdb into a temporary folder and starts the server on
127.0.0.1 on a free port, with trust authentication for local connections only, and stops it at the
end. `postgres_url` gives each test a database of its own, cloned from an empty template (cheap), and
drops it afterwards.

The cluster's default collation is ICU's en-US where the server supports it (the machine may have
only the C locale): a locale-aware default, as on most real servers, so a column that forgot
`COLLATE "C"` would sort differently from SQLite and fail a test.

PostgreSQL refuses to run as root: as root, every server command runs as the `postgres` user
(`runuser -u postgres --`) and the temporary folder belongs to that user.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import free_port, log_tail, missing

TEMPLATE = "cs_template"
_counter = itertools.count()


def find_bindir() -> Path | None:
    """The folder of initdb/pg_ctl/postgres: Debian keeps them under /usr/lib/postgresql/<major>/bin."""
    found = []
    for initdb in Path("/usr/lib/postgresql").glob("*/bin/initdb"):
        major = initdb.parent.parent.name
        if major.isdigit():
            found.append((int(major), initdb.parent))
    if found:
        return max(found)[1]
    on_path = shutil.which("initdb")
    return Path(on_path).resolve().parent if on_path else None


class PostgresServer:
    """One throw-away cluster: `start()`, `url(db)`, `create_database()`, `restart()`, `stop()`."""

    def __init__(self, bindir: Path, base: Path, *, durable: bool = False) -> None:
        self.bindir = bindir
        self.base = base
        self.data = base / "data"
        self.sockets = base / "sockets"
        self.log = base / "server.log"
        self.durable = durable
        self.port = 0
        self._as_postgres = os.geteuid() == 0

    # ------------------------------------------------------------------ commands

    def _cmd(self, *argv: str) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if self._as_postgres else list(argv)

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self._cmd(*argv), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:2])} failed ({done.returncode}): {done.stderr or done.stdout}"
            )
        return done

    def init(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(exist_ok=True)
        if self._as_postgres:
            user = pwd.getpwnam("postgres")
            for path in (self.base, self.sockets):
                os.chown(path, user.pw_uid, user.pw_gid)
        initdb = [str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E"]
        try:
            self._run(*initdb, "UTF8", "--locale=C.UTF-8", "--locale-provider=icu", "--icu-locale=en-US")
        except RuntimeError:
            shutil.rmtree(self.data, ignore_errors=True)
            self._run(*initdb, "UTF8", "--locale=C.UTF-8")
        # Trust on this machine only: the socket folder and 127.0.0.1 (the server listens nowhere else).
        hba = "local all all trust\nhost all all 127.0.0.1/32 trust\n"
        (self.data / "pg_hba.conf").write_text(hba)

    def _options(self) -> str:
        options = [
            f"-p {self.port}",
            "-c listen_addresses=127.0.0.1",
            f"-c unix_socket_directories={self.sockets}",
            "-c max_connections=200",
            "-c shared_buffers=64MB",
        ]
        if not self.durable:
            # Throw-away test data: no flushes. The benchmarks keep the defaults (durable).
            options += ["-c fsync=off", "-c full_page_writes=off", "-c synchronous_commit=off"]
        return " ".join(options)

    def start(self) -> None:
        for attempt in range(3):
            self.port = free_port()
            try:
                self._pg_ctl("start", "-o", self._options(), "-l", str(self.log))
                return
            except RuntimeError:
                if attempt == 2:
                    raise RuntimeError(f"PostgreSQL did not start: {self.log_tail()}") from None

    def _pg_ctl(self, *argv: str) -> None:
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", *argv)

    def restart(self) -> None:
        """Stop and start again (fast shutdown: every connection is dropped) on the same port."""
        self._pg_ctl("restart", "-m", "fast", "-o", self._options(), "-l", str(self.log))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._pg_ctl("stop", "-m", "immediate")

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log, lines)

    # ------------------------------------------------------------------ databases

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def admin(self, sql: str) -> None:
        """Run one statement as the superuser, outside a transaction (CREATE/DROP DATABASE)."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql)

    def create_template(self) -> None:
        self.admin(f"CREATE DATABASE {TEMPLATE} TEMPLATE template0 ENCODING 'UTF8'")

    def create_database(self) -> str:
        """A new empty database; returns its URL."""
        name = f"cs_{os.getpid()}_{next(_counter)}"
        self.admin(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE} STRATEGY FILE_COPY")
        return self.url(name)

    def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        if not re.fullmatch(r"cs_\d+_\d+", name):
            raise ValueError(f"not a test database: {name}")
        # FORCE: a subprocess a test killed may have left a connection behind.
        self.admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def start_server(*, durable: bool = False) -> PostgresServer:
    """Start a throw-away cluster in a new temporary folder (the caller stops it and removes `base`)."""
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError("PostgreSQL's server programs were not found: apt-get install postgresql")
    base = Path(tempfile.mkdtemp(prefix="code-sessions-pg-"))
    server = PostgresServer(bindir, base, durable=durable)
    try:
        server.init()
        server.start()
        server.create_template()
    except BaseException:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
        raise
    return server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    try:
        import psycopg  # noqa: F401
    except ImportError:
        missing("psycopg is not installed (pip install -e '.[dev]')")
    if find_bindir() is None:
        missing("PostgreSQL's server programs were not found (apt-get install postgresql)")
    started = time.monotonic()
    server = start_server()
    print(f"\n[postgres] server on 127.0.0.1:{server.port} in {time.monotonic() - started:.1f} s")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.base, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh, empty database for this test."""
    url = postgres_server.create_database()
    try:
        yield url
    finally:
        postgres_server.drop_database(url)
