"""Developer/admin CLI: `python -m storage [--root PATH] [--database-url URL] COMMAND [--json]` (also
`code-sessions-store`).

Reads use short transactions (on the WAL index, or PostgreSQL's snapshots), so the CLI can run against
a live deployment without blocking the web workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._format import human_bytes, human_duration, human_limit, iso_time, parse_duration, table
from .errors import StorageError
from .models import ChatInfo, Purge, Reconcile
from .store import Store

ENV_ROOT = "CODE_SESSIONS_ROOT"
ENV_DATABASE_URL = "CODE_SESSIONS_DATABASE_URL"
EXIT_DRIFT = 1
EXIT_ERROR = 2


class CliError(Exception):
    pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        root = _root(args.root)
        url = args.database_url if args.database_url is not None else os.environ.get(ENV_DATABASE_URL, "")
        return asyncio.run(_run(args, root, url))
    except (CliError, StorageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m storage", description="Inspect and maintain a code-sessions store."
    )
    parser.add_argument(
        "--root", help=f"store root (default: ${ENV_ROOT}, else $DATA_DIR/code_sessions)", default=None
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help=f"the index's database: postgresql://... (default: ${ENV_DATABASE_URL}, else the SQLite "
        "index under the root)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    # Accept --json after the command too; SUPPRESS keeps a global --json from being reset.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("sessions", parents=[common], help="list sessions")
    p.add_argument("--user", help="only this user id")
    p = sub.add_parser("files", parents=[common], help="list the indexed files of a chat")
    p.add_argument("chat", metavar="CHAT", help="chat id, or a unique prefix of the chat folder name")
    p.add_argument("--user", help="user id, if the chat id is not unique")
    sub.add_parser("usage", parents=[common], help="files and bytes per user, against the quotas")
    p = sub.add_parser("links", parents=[common], help="list published links")
    p.add_argument("--chat", help="only links of this chat id")
    sub.add_parser("check", parents=[common], help="compare index and disk (exit 1 on drift)")
    p = sub.add_parser("cleanup", parents=[common], help="apply expiry, or purge sessions")
    p.add_argument("--dry-run", action="store_true", help="report what would be removed, change nothing")
    p.add_argument("--all", action="store_true", help="remove every session")
    p.add_argument("--user", help="remove the sessions of this user id")
    p.add_argument("--chat", help="remove the session(s) of this chat id")
    p.add_argument("--idle", type=_duration, help="remove sessions idle longer than this (7d, 12h, 30m)")
    sub.add_parser("rebuild", parents=[common], help="rebuild the index from the session folders")
    p = sub.add_parser("log", parents=[common], help="show the activity trail")
    p.add_argument("--limit", type=int, default=50, help="number of entries (default 50)")
    return parser


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _root(given: str | None) -> Path:
    if given:
        root = Path(given)
    elif os.environ.get(ENV_ROOT):
        root = Path(os.environ[ENV_ROOT])
    elif os.environ.get("DATA_DIR"):
        root = Path(os.environ["DATA_DIR"]) / "code_sessions"
    else:
        raise CliError(f"no store root: pass --root PATH, or set {ENV_ROOT} or DATA_DIR")
    if not root.is_dir():
        raise CliError(f"no store at {root} (the folder does not exist)")
    return root


async def _run(args: argparse.Namespace, root: Path, database_url: str) -> int:
    # Listings, check and a dry run show the index as it is; cleanup and rebuild first repair it as
    # the application does when it starts.
    repair = args.command == "rebuild" or (args.command == "cleanup" and not args.dry_run)
    store = Store(root, record_settings=False, database_url=database_url, repair_at_open=repair)
    async with store:
        # The policy and publish folder the application last recorded, so the CLI applies the same.
        policy, publisher = await store.recorded_settings()
        args.policy = policy or store.policy  # what `usage` shows and `cleanup` applies
        store.use_publisher(publisher)
        handler = _COMMANDS[args.command]
        return await handler(store, args)


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text)


# ---------------------------------------------------------------------------- commands


async def _sessions(store: Store, args: argparse.Namespace) -> int:
    rows = await store.sessions(args.user)
    text = table(
        ["USER", "CHAT", "TEMP", "FILES", "SIZE", "LAST USED", "CREATED", "FOLDER"],
        [
            [
                s.user_id,
                s.chat_id,
                "yes" if s.temporary else "",
                s.files,
                human_bytes(s.bytes),
                iso_time(s.last_used_at),
                iso_time(s.created_at),
                s.chat_key,
            ]
            for s in rows
        ],
        right=(3, 4),
    )
    _emit(args, [s.to_dict() for s in rows], text if rows else "no sessions")
    return 0


async def _resolve_chat(store: Store, chat: str, user: str | None) -> ChatInfo:
    rows = await store.sessions(user)
    exact = [s for s in rows if s.chat_id == chat]
    matches = exact or [s for s in rows if s.chat_key.startswith(chat)]
    if not matches:
        raise CliError(f"no session with chat id or folder prefix {chat!r}")
    if len(matches) > 1:
        names = ", ".join(f"{s.user_id}/{s.chat_id}" for s in matches[:10])
        raise CliError(f"{chat!r} matches {len(matches)} sessions ({names}); add --user or a longer prefix")
    return matches[0]


async def _files(store: Store, args: argparse.Namespace) -> int:
    info = await _resolve_chat(store, args.chat, args.user)
    session = store.session_at(info)
    files = await session.files.list()
    text = table(
        ["PATH", "SIZE", "MODIFIED", "LAST CHANGED"],
        [[f.path, human_bytes(f.size), iso_time(f.mtime), iso_time(f.last_changed)] for f in files],
        right=(1,),
        whole=(0,),
    )
    header = f"user {info.user_id}  chat {info.chat_id}  ({info.files} files, {human_bytes(info.bytes)})"
    _emit(args, [f.to_dict() for f in files], header + "\n" + (text if files else "no files"))
    return 0


async def _usage(store: Store, args: argparse.Namespace) -> int:
    q = args.policy.quotas
    users = await store.users_usage()

    def pct(used: int, limit: int | None) -> str:
        return "" if not limit else f"{100 * used / limit:.0f}%"

    text = table(
        ["USER", "SESSIONS", "FILES", "FILES %", "SIZE", "SIZE %", "STATES", "STATES SIZE", "SAVED STATE"],
        [
            [
                u.user_id,
                u.sessions,
                u.files,
                pct(u.files, q.max_files_per_user),
                human_bytes(u.bytes),
                pct(u.bytes, q.max_bytes_per_user),
                u.branch_states,
                human_bytes(u.branch_state_bytes),
                human_bytes(u.saved_state_bytes),
            ]
            for u in users
        ],
        right=(1, 2, 3, 4, 5, 6, 7, 8),
    )
    head = (
        f"quotas: {q.max_files_per_user or 'no limit'} files, {human_limit(q.max_bytes_per_user)} per user; "
        f"{human_limit(q.max_file_bytes)} per file; {q.max_new_files_per_run or 'no limit'} new files per run"
    )
    data = {"quotas": q.to_dict(), "users": [u.to_dict() for u in users]}
    _emit(args, data, head + "\n" + (text if users else "no users"))
    return 0


async def _links(store: Store, args: argparse.Namespace) -> int:
    links = await store.links(chat_id=args.chat)
    text = table(
        ["USER", "CHAT", "PATH", "SIZE", "CREATED", "URL"],
        [
            [li.user_id, li.chat_id, li.path, human_bytes(li.size), iso_time(li.created_at), li.url]
            for li in links
        ],
        right=(3,),
        whole=(5,),
    )
    _emit(args, [li.to_dict() for li in links], text if links else "no links")
    return 0


async def _check(store: Store, args: argparse.Namespace) -> int:
    drift = await store.check()
    if drift:
        text = table(
            ["KIND", "USER", "CHAT", "PATH", "DETAIL"],
            [[d.kind, d.user_id, d.chat_id, d.path, d.detail] for d in drift],
        )
        text += f"\n{len(drift)} difference(s) between index and disk; `rebuild` fixes them"
    else:
        text = "index matches disk"
    _emit(args, [d.to_dict() for d in drift], text)
    return EXIT_DRIFT if drift else 0


async def _cleanup(store: Store, args: argparse.Namespace) -> int:
    chosen = args.all or args.user is not None or args.chat is not None or args.idle is not None
    if args.all and (args.user is not None or args.chat is not None or args.idle is not None):
        raise CliError("--all cannot be combined with --user, --chat or --idle")
    purge = Purge(args.all, args.user, args.chat, args.idle) if chosen else None
    report = await store.cleanup(purge, policy=args.policy, dry_run=args.dry_run)
    lines = []
    if purge is None:
        e = args.policy.expiry
        lines.append(
            f"policy: remove files unchanged for {human_duration(e.file_max_age_s)}, sessions idle for "
            f"{human_duration(e.session_idle_s)}, temporary chats idle for "
            f"{human_duration(e.temporary_idle_s)}"
        )
    if report.details:
        lines.append(
            table(
                ["ACTION", "USER", "CHAT", "FILES", "SIZE", "REASON"],
                [
                    [d.action, d.user_id, d.chat_id, d.files, human_bytes(d.bytes), d.reason]
                    for d in report.details
                ],
                right=(3, 4),
            )
        )
    lines.append(("dry run: " if args.dry_run else "") + report.summary())
    _emit(args, report.to_dict(), "\n".join(lines))
    return 0


async def _rebuild(store: Store, args: argparse.Namespace) -> int:
    report = await store.reconcile(Reconcile.REBUILD)
    _emit(args, report.to_dict(), "rebuilt: " + report.summary())
    return 0


async def _log(store: Store, args: argparse.Namespace) -> int:
    entries = await store.activity(args.limit)
    text = table(
        ["TIME", "EVENT", "USER", "CHAT", "DETAIL"],
        [
            [iso_time(e.at), e.event, e.user_id, e.chat_id, json.dumps(e.detail, separators=(",", ":"))]
            for e in entries
        ],
    )
    _emit(args, [e.to_dict() for e in entries], text if entries else "no activity")
    return 0


_COMMANDS = {
    "sessions": _sessions,
    "files": _files,
    "usage": _usage,
    "links": _links,
    "check": _check,
    "cleanup": _cleanup,
    "rebuild": _rebuild,
    "log": _log,
}


if __name__ == "__main__":
    sys.exit(main())
