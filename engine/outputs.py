"""What an answer shows besides its text and its links: previews of the tables it links, and its
interactive charts. Composes the pure modules (engine/previews.py, engine/charts.py) with a chat's
folder and its sandbox."""

from __future__ import annotations

from collections.abc import Sequence

from runner import RunnerError

from .charts import ChartEmbed, chart_embed
from .previews import SANDBOX_LIMITS, is_table, previews
from .service import ChatSession, Engine

__all__ = ["answer_embed", "answer_previews"]


async def answer_previews(chat: ChatSession) -> str:
    """Markdown previews of the table files the answer's text links, in the order it links them."""
    paths = chat.shown
    if not any(is_table(path) for path in paths):
        return ""
    files = chat.session.files
    return await previews(
        paths, files.read_head, lambda code: chat.read_in_sandbox(code, SANDBOX_LIMITS), files.read_at
    )


async def answer_embed(
    services: Engine, chat: ChatSession, charts: Sequence[str]
) -> tuple[ChartEmbed | None, list[str]]:
    """The message's one embed holding its charts (None: no chart; the host serves its plotly.js and
    writes its HTML), and a sentence for each chart that cannot be shown interactively."""
    if not charts:
        return None, []
    try:
        root = (await services.runner.environment()).root
    except RunnerError:
        root = None
    return await chart_embed(charts, chat.session.files.read_head, root)
