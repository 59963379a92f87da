"""A chat step without Open WebUI: sandbox runs over a persistent session, links, the conversation loop."""

from .blocks import CodeBlock, runnable_blocks
from .branches import Turn
from .host import Host, PurgeValve
from .inbound import SAVE_COMMAND, Inbound, KnowledgeHost, NewLink, StoreFor, chat_path, save_command
from .links import References, Target, find_paths, rewrite
from .loop import (
    RUN_CODE_TOOL,
    ExtraTool,
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
from .outputs import answer_embed, answer_previews
from .prepare import import_uploads, last_user_text, messages_with_prompt
from .prompt import PromptFacts, system_prompt
from .purge import parse_purge
from .service import ChatSession, Engine, StepResult
from .settings import DEFAULTS, BranchSettings, Settings
from .sse import ModelError, TextDelta, ToolCall, events_from_message, events_from_sse
from .streaming import StreamingRewriter

__all__ = [
    "DEFAULTS",
    "MINUTE_S",
    "RUN_CODE_TOOL",
    "SAVE_COMMAND",
    "BranchSettings",
    "ChatSession",
    "CodeBlock",
    "Engine",
    "ExtraTool",
    "Host",
    "Inbound",
    "KnowledgeHost",
    "LoopOptions",
    "Maintenance",
    "ModelCall",
    "ModelError",
    "NewLink",
    "PromptFacts",
    "PurgeValve",
    "References",
    "Settings",
    "StatusCall",
    "StepResult",
    "StoreFor",
    "StreamingRewriter",
    "Target",
    "TextDelta",
    "ToolCall",
    "Turn",
    "answer_embed",
    "answer_previews",
    "chat_path",
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
    "save_command",
    "system_prompt",
    "waiting_status",
]
