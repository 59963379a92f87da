"""A real Redis server for the tests, from Debian's `redis-server` package.

`redis_server` (session scope) starts `redis-server` on 127.0.0.1 on a free port, with no
persistence (`--save "" --appendonly no`) and a temporary working folder, waits until it answers
PING, and stops it at the end. `RedisServer.command` speaks just enough of the Redis protocol
(RESP2) for a test to look at what a program stored there, without a client library.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.servers import free_port, log_tail, missing

_START_TIMEOUT_S = 30.0


def find_server() -> Path | None:
    """Debian's redis-server is /usr/bin/redis-server (on PATH for root and users alike)."""
    found = shutil.which("redis-server", path=os.environ.get("PATH", "") + ":/usr/bin:/usr/sbin")
    return Path(found) if found else None


class RedisError(RuntimeError):
    """An error reply of the server (`-ERR ...`)."""


class RedisServer:
    """One throw-away server: `start()`, `url(db)`, `ping()`, `command(...)`, `stop()`."""

    def __init__(self, executable: Path, base: Path) -> None:
        self.executable = executable
        self.base = base
        self.log = base / "redis.log"
        self.port = 0
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            self.port = free_port()
            argv = [
                str(self.executable),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.base),
                "--daemonize",
                "no",
                "--logfile",
                str(self.log),
            ]
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            if self._wait_ready():
                return
            self.stop()
            if attempt == 2:
                raise RuntimeError(f"Redis did not start: {self.log_tail()}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False  # e.g. the port was taken meanwhile: the caller tries another one
            with contextlib.suppress(OSError, RedisError):
                if self.ping():
                    return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log, lines)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    # ------------------------------------------------------------------ the protocol

    def ping(self) -> bool:
        return self.command("PING") == "PONG"

    def command(self, *args: str, db: int = 0) -> object:
        """Send one command (after SELECT db) and return its reply: str, int, None, or a list."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            reader = sock.makefile("rb")
            if db:
                sock.sendall(_encode("SELECT", str(db)))
                _read_reply(reader)
            sock.sendall(_encode(*args))
            return _read_reply(reader)


def _encode(*args: str) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read_reply(reader) -> object:
    line = reader.readline()
    if not line.endswith(b"\r\n"):
        raise OSError("the connection closed mid-reply")
    kind, rest = line[:1], line[1:-2].decode(errors="replace")
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RedisError(rest)
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        data = reader.read(size + 2)
        return data[:-2].decode(errors="replace")
    if kind == b"*":
        count = int(rest)
        return None if count < 0 else [_read_reply(reader) for _ in range(count)]
    raise OSError(f"an unexpected reply: {line!r}")


def start_server() -> RedisServer:
    """Start a throw-away server in a new temporary folder (the caller stops it and removes `base`)."""
    executable = find_server()
    if executable is None:
        raise RuntimeError("redis-server was not found: apt-get install redis-server")
    server = RedisServer(executable, Path(tempfile.mkdtemp(prefix="code-sessions-redis-")))
    try:
        server.start()
    except BaseException:
        server.stop()
        shutil.rmtree(server.base, ignore_errors=True)
        raise
    return server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if find_server() is None:
        missing("redis-server was not found (apt-get install redis-server)")
    started = time.monotonic()
    server = start_server()
    print(f"\n[redis] server on 127.0.0.1:{server.port} in {time.monotonic() - started:.1f} s")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.base, ignore_errors=True)
