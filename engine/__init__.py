"""A chat step without Open WebUI: sandbox runs over a persistent session, links, the conversation loop."""

from .blocks import CodeBlock, runnable_blocks
from .host import Host, PurgeValve
from .links import References, Target, find_paths, rewrite
from .loop import (
    RUN_CODE_TOOL,
    LoopOptions,
    ModelCall,
    StatusCall,
    converse,
    render_step,
    run_step,
    waiting_status,
)
from .maintenance import MINUTE_S, Maintenance
from .markup import code_span, escape_text, mention
from .prepare import import_uploads, last_user_text, messages_with_prompt
from .prompt import PromptFacts, system_prompt
from .purge import parse_purge
from .service import ChatSession, Engine, StepResult
from .settings import DEFAULTS, Settings
from .sse import ModelError, TextDelta, ToolCall, events_from_message, events_from_sse
from .streaming import StreamingRewriter

__all__ = [
    "DEFAULTS",
    "MINUTE_S",
    "RUN_CODE_TOOL",
    "ChatSession",
    "CodeBlock",
    "Engine",
    "Host",
    "LoopOptions",
    "Maintenance",
    "ModelCall",
    "ModelError",
    "PromptFacts",
    "PurgeValve",
    "References",
    "Settings",
    "StatusCall",
    "StepResult",
    "StreamingRewriter",
    "Target",
    "TextDelta",
    "ToolCall",
    "code_span",
    "converse",
    "escape_text",
    "events_from_message",
    "events_from_sse",
    "find_paths",
    "import_uploads",
    "last_user_text",
    "mention",
    "messages_with_prompt",
    "parse_purge",
    "render_step",
    "rewrite",
    "run_step",
    "runnable_blocks",
    "system_prompt",
    "waiting_status",
]
