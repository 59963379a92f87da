"""Save to Knowledge: a file of a chat put into one of the user's Knowledge bases through Open WebUI's own
Knowledge API (0.12.4), so that other chats find it by retrieval.

Every decision about who may write where is Open WebUI's own code, called with the user:
`routers/knowledge.py get_knowledge_bases` lists the bases the user can see with `write_access`, and
`add_file_to_knowledge_by_id` (the route the Knowledge page uses) checks write access again and adds
the file. The file is made the way an upload is (`routers/files.py upload_file_handler`, processed at
once: extracted and embedded), owned by the user; if anything refuses it, it is removed again
(`delete_file_resource`), so a refusal leaves nothing behind.
"""

from __future__ import annotations

import io
import logging
import mimetypes
from typing import Any

from storage import human_bytes

log = logging.getLogger("code_sessions.function")

__all__ = ["knowledge_bases", "save_to_knowledge"]

# Pages of the user's Knowledge bases looked through for a name (30 per page in Open WebUI 0.12).
_MAX_PAGES = 20
_LISTED = 10


async def save_to_knowledge(request: Any, user_id: str, target: str, name: str, data: bytes) -> str:
    """See engine.Host.save_to_knowledge. `request`: the message's (Open WebUI's processing reads its
    app)."""
    from open_webui.internal.db import get_async_db
    from open_webui.models.users import Users

    user = await Users.get_user_by_id(user_id)
    if user is None:
        return "Not saved to Knowledge: Open WebUI does not know this user."
    async with get_async_db() as db:
        bases = await _bases(user, db)
    writable = [base for base in bases if base.write_access]
    if not target:
        if not writable:
            return "You have no Knowledge base you may add to: make one under Workspace → Knowledge."
        names = ", ".join(_quoted(base.name) for base in writable[:_LISTED])
        more = f" and {len(writable) - _LISTED} more" if len(writable) > _LISTED else ""
        return f"Knowledge bases you may add to: {names}{more}."
    matches = [base for base in bases if base.id == target] or [
        base for base in bases if base.name.strip().casefold() == target.strip().casefold()
    ]
    if not matches:
        return (
            f"Not saved: you have no Knowledge base named {_quoted(target)} (or it is not shared with "
            f"you). Type the command with no base to see the ones you may add to."
        )
    if len(matches) > 1:
        ids = ", ".join(base.id for base in matches[:5])
        return f"Not saved: several Knowledge bases are named {_quoted(target)}; give its id instead ({ids})."
    base = matches[0]
    if not base.write_access and user.role != "admin":
        return f"Not saved: you may read the Knowledge base {_quoted(base.name)} but not add to it."
    return await _add(request, user, base, name, data)


async def knowledge_bases(user_id: str) -> list[tuple[str, str]]:
    """(id, name) of the bases the user may add to: Open WebUI's own listing and its `write_access`."""
    from open_webui.internal.db import get_async_db
    from open_webui.models.users import Users

    user = await Users.get_user_by_id(user_id)
    if user is None:
        return []
    async with get_async_db() as db:
        bases = await _bases(user, db)
    return [(str(base.id), str(base.name)) for base in bases if base.write_access]


async def _bases(user: Any, db: Any) -> list[Any]:
    """The Knowledge bases the user can see, each with `write_access`: Open WebUI's own listing."""
    from open_webui.routers.knowledge import get_knowledge_bases

    found: list[Any] = []
    for page in range(1, _MAX_PAGES + 1):
        result = await get_knowledge_bases(page=page, user=user, db=db)
        found.extend(result.items)
        if len(found) >= result.total or not result.items:
            break
    return found


async def _add(request: Any, user: Any, base: Any, name: str, data: bytes) -> str:
    from fastapi import HTTPException, UploadFile
    from open_webui.internal.db import get_async_db
    from open_webui.models.files import Files
    from open_webui.routers.files import upload_file_handler
    from open_webui.routers.knowledge import (
        KnowledgeFileIdForm,
        add_file_to_knowledge_by_id,
        delete_file_resource,
    )
    from starlette.datastructures import Headers

    content_type = mimetypes.guess_type(name, strict=False)[0] or "application/octet-stream"
    upload = UploadFile(io.BytesIO(data), filename=name, headers=Headers({"content-type": content_type}))
    async with get_async_db() as db:
        try:
            made = await upload_file_handler(
                request,
                file=upload,
                metadata={"source": "code-sessions"},
                process=True,
                process_in_background=False,  # extracted and embedded now: the answer can say it worked
                user=user,
                db=db,
            )
        except HTTPException as error:
            return f"Not saved to Knowledge: Open WebUI refused the file ({error.detail})."
        file_id = made["id"] if isinstance(made, dict) else made.id
        record = await Files.get_file_by_id(file_id, db=db)
        status = ((record.data if record else None) or {}).get("status")
        if record is None or status == "failed":
            why = ((record.data if record else None) or {}).get("error") or "it could not be processed"
            if record is not None:
                await delete_file_resource(record, db)
            return f"Not saved to Knowledge: Open WebUI could not read the text of {name} ({why})."
        try:
            await add_file_to_knowledge_by_id(
                request, base.id, KnowledgeFileIdForm(file_id=file_id), user=user, db=db
            )
        except HTTPException as error:
            await delete_file_resource(record, db)
            if error.status_code in (401, 403) or "access" in str(error.detail).lower():
                return f"Not saved: you may not add to the Knowledge base {_quoted(base.name)}."
            return f"Not saved to Knowledge: Open WebUI refused it ({error.detail})."
    return (
        f"Saved {name} ({human_bytes(len(data))}) to the Knowledge base {_quoted(base.name)}: other chats "
        "that use it can now find it."
    )


def _quoted(text: str) -> str:
    # Names come from users: shown as plain text between quotes, one line, bounded.
    flat = " ".join(str(text).split())[:80]
    return "\u201c" + flat.replace("`", "'") + "\u201d"
