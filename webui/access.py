"""Open WebUI's read grants, asked the way its own checks ask them."""

from __future__ import annotations

__all__ = ["read_granted"]


async def read_granted(user_id: str, resource_type: str, resource_id: str) -> bool:
    """A read grant on the resource (`resource_type` as Open WebUI's access grants name it: "tool",
    "shared_chat", ...) to the user, one of their groups (inherited ones too) or every user."""
    from open_webui.models.access_grants import AccessGrants
    from open_webui.models.groups import Groups

    groups = {g.id for g in await Groups.get_groups_by_member_id(user_id, include_inherited=True)}
    return bool(
        await AccessGrants.has_access(
            user_id=user_id,
            resource_type=resource_type,
            resource_id=resource_id,
            permission="read",
            user_group_ids=groups,
        )
    )
