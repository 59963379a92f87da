"""A message's life without Open WebUI: its turn (engine/turn.py), sandbox runs over a persistent session,
links, the conversation loop; the host (Open WebUI) is reached through one protocol (engine/host.py)."""

from .actions import BUTTONS, Ask, Reply
from .blocks import CodeBlock, runnable_blocks
from .branches import Place
from .clones import Origin
from .host import Emit, Host, Places, PurgeValve
from .inbound import (
    SAVE_COMMAND,
    Inbound,
    Knowledge,
    NewLink,
    StoreFor,
    chat_path,
    save_command,
    save_to_knowledge,
)
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
from .sse import ModelError, TextDelta, ToolCall, events_from_message, events_from_response, events_from_sse
from .streaming import StreamingRewriter
from .turn import Message, Status, Turn, Turns

__all__ = [
    "BUTTONS",
    "DEFAULTS",
    "MINUTE_S",
    "RUN_CODE_TOOL",
    "SAVE_COMMAND",
    "Ask",
    "BranchSettings",
    "ChatSession",
    "CodeBlock",
    "Emit",
    "Engine",
    "ExtraTool",
    "Host",
    "Inbound",
    "Knowledge",
    "LoopOptions",
    "Maintenance",
    "Message",
    "ModelCall",
    "ModelError",
    "NewLink",
    "Origin",
    "Place",
    "Places",
    "PromptFacts",
    "PurgeValve",
    "References",
    "Reply",
    "Settings",
    "Status",
    "StatusCall",
    "StepResult",
    "StoreFor",
    "StreamingRewriter",
    "Target",
    "TextDelta",
    "ToolCall",
    "Turn",
    "Turns",
    "answer_embed",
    "answer_previews",
    "chat_path",
    "code_span",
    "converse",
    "escape_text",
    "events_from_message",
    "events_from_response",
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
    "save_to_knowledge",
    "system_prompt",
    "waiting_status",
]
