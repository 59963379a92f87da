"""The wire between the workers of one host: a run (or a stop) for a chat whose kernel another worker
holds goes to that worker's unix socket (`<socket_dir>/<digest>-<cid>.sock`) and its answer comes back.

A message is a 4-byte big-endian length and that many bytes of JSON. Only our own user's processes
reach a socket (mode 0600 in a 0700 folder owned by us), and the serving side checks the peer's
credentials too (`peer_uid`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ._registry import Entry
from .models import KernelSettings, Limits, RunResult

CONNECT_TIMEOUT_S = 2.0
_MAX_MESSAGE = 80 * 1024 * 1024  # a run request carries the code (the kernel takes up to 64 MiB)
_HEADER = struct.Struct(">I")
_REPLY_MARGIN_S = 15.0  # a relayed run's reply may come this long after its time limit
_STOP_REPLY_S = 10.0  # a stop request is answered at once (the kernel is stopped after the reply)
_SETTLE_REMOTE_S = 8.0  # after the asker gives up, how long it waits for the cell there to stop


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class OwnerSilent(Exception):
    """The worker holding a chat's kernel accepted a request and did not answer in time."""


async def run_remote(
    entry: Entry, workdir: Path, code: str, language: str, limits: Limits, settings: KernelSettings
) -> RunResult | None:
    """The run, by the worker that holds the chat's kernel (which keeps the run's `settings` for the
    chat); None if that kernel is gone. Raises OwnerSilent if that worker does not answer within the
    run's time limit and a margin."""
    request = {
        "op": "run",
        "code": code,
        "language": language,
        "limits": limits.model_dump(),
        "settings": settings.model_dump(),
        "workdir": str(workdir),
    }
    reply = await ask(entry, request, limits.timeout_s + _REPLY_MARGIN_S)
    if reply is None or "result" not in reply:
        return None
    return RunResult.model_validate(reply["result"])


async def ask(
    entry: Entry, request: dict[str, Any], reply_within: float = _STOP_REPLY_S
) -> dict[str, Any] | None:
    """One request to the worker serving `entry`'s kernel, naming the chat and kernel it is for.
    None when no such kernel answers there; OwnerSilent when the worker accepts and says nothing
    for `reply_within` s (stopped, stuck). If the caller is cancelled (the user stopped the
    answer), the worker is told (the connection is half-closed), and the caller waits, bounded, for
    the cell there to stop: what it wrote is then on disk before the caller reconciles."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(entry.socket, limit=_MAX_MESSAGE), CONNECT_TIMEOUT_S
        )
    except (OSError, TimeoutError):
        return None
    try:
        await send(writer, {**request, "key": entry.key, "cid": entry.cid})
        try:
            return await asyncio.wait_for(receive(reader), reply_within)
        except TimeoutError:
            raise OwnerSilent(f"the worker holding it did not answer within {reply_within:g} s") from None
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                writer.write_eof()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(receive(reader)), _SETTLE_REMOTE_S)
            raise
    except (OSError, ValueError, asyncio.IncompleteReadError):
        return None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode()
    writer.write(_HEADER.pack(len(body)) + body)
    await writer.drain()


async def receive(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > _MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes")
    message = json.loads(await reader.readexactly(size))
    if not isinstance(message, dict):
        raise ValueError("not an object")
    return message


async def listen(path: Path, handle: Handler) -> asyncio.AbstractServer:
    """Serve ``handle(reader, writer)`` on the socket ``path``, reachable by our own user only."""
    await asyncio.to_thread(_prepare_socket, path)
    server = await asyncio.start_unix_server(handle, path=str(path))
    os.chmod(path, 0o600)
    return server


def peer_uid(writer: asyncio.StreamWriter) -> int | None:
    sock = writer.get_extra_info("socket")
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    pid: int = struct.unpack("3i", creds)[1]
    return pid


def _prepare_socket(path: Path) -> None:
    # The folder is what keeps other users off the socket (which is 0600 only once bound): 0700
    # and ours, even if it was there before with another mode.
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(f"{folder} is not a folder of ours")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(folder, 0o700)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
