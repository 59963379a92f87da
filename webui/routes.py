"""Routes of ours on Open WebUI's app, put there once per process."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["add_route_once"]

log = logging.getLogger("code_sessions.function")


def add_route_once(
    app: Any, path: str, endpoint: Callable[[Any], Awaitable[Any]], methods: list[str], flag: str, what: str
) -> None:
    """Put a route on `app` ahead of Open WebUI's own (its catch-all mount at "/" would answer every
    path), unless the mark `flag` on `app.state` says it is there already; log that this worker serves
    `what` there."""
    from starlette.routing import Route

    if getattr(app.state, flag, False):
        return
    app.router.routes.insert(0, Route(path, endpoint, methods=methods))
    setattr(app.state, flag, True)
    log.info("code-sessions: worker %d serves %s at %s", os.getpid(), what, path.split("{", 1)[0])
