"""Files in, for the Pipe, the Tool and the Filter: the upload link the model offers (a tool), the Save to
Knowledge command the user types, and the upload route every loaded file puts on its worker.

The work is engine.Inbound's (checks, sentences) and webui's (the route, Open WebUI's Knowledge API);
this module only composes them with the process's services. One `Inbound` serves a process; its links
live where every worker finds them (`OpenWebUI.upload_links_folder`), each naming where its chat's
files are, so a worker that never ran the chat can still receive its upload.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from engine import ChatSession, Engine, ExtraTool, Inbound, Settings, save_command
from storage import Expiry, Policy, Quotas, Store, UploadLinks

__all__ = ["UPLOAD_LINK_TOOL", "answer_command", "serve_uploads", "upload_link", "upload_link_tool"]

LOCATION_ID = "code_sessions"  # as functions/adapter.py's: where older /cache copies lived

UPLOAD_LINK_TOOL = {
    "type": "function",
    "function": {
        "name": "upload_link",
        "description": (
            "Make a link the user can upload one file with, straight into /mnt/data at the path you "
            "choose (for files too big to attach, or that come from another system). The link takes "
            "one file, once, for a few minutes. Give the link to the user as it is."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "where the file goes, e.g. /mnt/data/export.csv"}
            },
            "required": ["path"],
        },
    },
}


def serve_uploads(host: Any) -> None:
    """Put the upload route on this worker's Open WebUI app (at each file's load; a no-op outside
    Open WebUI), so a link works in every worker that has loaded one of the files."""
    host.serve_uploads(lambda: _inbound(host))


async def answer_command(host: Any, chat: ChatSession, request: Any, text: str) -> str | None:
    """The sentence for the user's Save to Knowledge command, or None when the message is not one."""
    parsed = save_command(text)
    if parsed is None:
        return None
    return await _inbound(host).save_to_knowledge(chat, host, request, *parsed)


async def upload_link(
    host: Any, services: Engine, valves: Any, chat: ChatSession, request: Any, path: str
) -> str:
    """A new upload link for the model to give the user, or the sentence why not."""
    inbound = _inbound(host)
    host.serve_uploads(lambda: inbound)
    settings: Settings = chat.settings
    made = await inbound.make_link(chat, path, ttl_s=settings.upload_link_s, where=_where(valves, services))
    if isinstance(made, str):
        return made
    url = await host.upload_url(request, made.token)
    return made.sentence(url, settings.policy.max_file_bytes)


def upload_link_tool(
    host: Any, services: Engine, valves: Any, chat: ChatSession, request: Any
) -> ExtraTool:
    """The upload link as a tool of the Pipe's own loop."""

    async def call(arguments: dict[str, Any]) -> str:
        path = arguments.get("path")
        if not isinstance(path, str) or not path.strip():
            return "Missing `path` (a string such as /mnt/data/export.csv)."
        return await upload_link(host, services, valves, chat, request, path)

    return ExtraTool(UPLOAD_LINK_TOOL, call)


# ---- composition ---------------------------------------------------------------------------------------


def _inbound(host: Any) -> Inbound:
    shared = host.shared()
    inbound: Inbound | None = shared.get("code-sessions:inbound")
    if inbound is None:
        links = UploadLinks(host.upload_links_folder())
        inbound = shared["code-sessions:inbound"] = Inbound(links, lambda where: _store_for(host, where))
    return inbound


def _where(valves: Any, services: Engine) -> dict[str, Any]:
    """What a link records about where its chat's files are (for a worker that has no services yet)."""
    store = services.store
    return {
        "root": str(store.root),
        "storage_root": valves.storage_root,
        "index": valves.index_database,
        "owner": list(store.owner) if store.owner else None,
        "quotas": store.policy.quotas.to_dict(),
    }


async def _store_for(host: Any, where: dict[str, Any]) -> tuple[Store, Policy]:
    """The store a link names (this process's own, its services', when it has one for that root, else
    one opened for uploads alone) and the quotas the link was made under."""
    root = Path(str(where.get("root") or ""))
    policy = Policy(Quotas(**dict(where.get("quotas") or {})), Expiry())
    shared = host.shared()
    for entry in list(shared.values()):
        services = entry[0] if isinstance(entry, list) and entry else None
        if isinstance(services, Engine) and services.store.root == root:
            return services.store, policy
    key = ("code-sessions:upload-store", id(asyncio.get_running_loop()), str(root))
    store: Store | None = shared.get(key)
    if store is None:
        places = host.locations(str(where.get("storage_root") or ""), LOCATION_ID)
        owner = where.get("owner")
        store = Store(
            root,
            publisher=host.publisher(places),
            owner=(int(owner[0]), int(owner[1])) if owner else None,
            database_url=host.index_url(str(where.get("index") or "")),
            temporary_chat=host.temporary_chat,
        )
        await store.open()
        shared[key] = store
    return store, policy
