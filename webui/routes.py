"""Routes of ours on Open WebUI's app, put there once per process."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["add_route_once"]


def add_route_once(
    app: Any, path: str, endpoint: Callable[[Any], Awaitable[Any]], methods: list[str], flag: str
) -> bool:
    """Put a route on `app` ahead of Open WebUI's own (its catch-all mount at "/" would answer every
    path), unless the mark `flag` on `app.state` says it is there already. True when it was put now."""
    from starlette.routing import Route

    if getattr(app.state, flag, False):
        return False
    app.router.routes.insert(0, Route(path, endpoint, methods=methods))
    setattr(app.state, flag, True)
    return True
