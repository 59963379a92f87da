"""The system prompt that tells the model about its /mnt/data folder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runner import MAX_FIGURES_PER_RUN
from storage import human_bytes

__all__ = ["PromptFacts", "system_prompt"]


@dataclass(frozen=True, slots=True)
class PromptFacts:
    files: Sequence[tuple[str, int]]  # (relative path, size), newest first
    total_files: int
    total_bytes: int
    timeout_s: float
    memory_mb: int
    network: bool
    max_file_bytes: int | None  # None: no limit (and so for the quotas)
    quota_bytes: int | None
    quota_files: int | None
    tool_mode: bool  # True: a run_code tool; False: fenced blocks are run
    sandbox_notes: Sequence[str] = ()  # quirks of this sandbox worth knowing (see Runner.known_issues)
    max_listed: int = 40
    kernel_idle_minutes: float | None = None  # a live kernel per chat (None: every run starts fresh)
    packages: Sequence[tuple[str, str]] = ()  # (import name, version): the notable ones of the sandbox
    more_packages: int = 0  # how many more distributions are installed besides those named
    tools: Sequence[str] = ()  # command-line tools the sandbox has beyond coreutils
    # Whether the run's figures are shown to the user by themselves (the Pipe shows them under each
    # step); False: only when the answer writes their paths (the Tool's results are the model's).
    figures_shown: bool = True


def _file_lines(facts: PromptFacts) -> str:
    if not facts.files:
        return "The folder is empty."
    shown = facts.files[: facts.max_listed]
    lines = [f"- /mnt/data/{path} ({human_bytes(size)})" for path, size in shown]
    hidden = facts.total_files - len(shown)
    if hidden > 0:
        lines.append(f"- ... and {hidden} more (list them with code if you need them)")
    header = f"Files now in /mnt/data ({facts.total_files} files, {human_bytes(facts.total_bytes)}):"
    return "\n".join([header, *lines])


def _quota_line(facts: PromptFacts) -> str:
    limits = []
    if facts.max_file_bytes:
        limits.append(f"{human_bytes(facts.max_file_bytes)} per file")
    if facts.quota_bytes:
        limits.append(f"{human_bytes(facts.quota_bytes)} for all of this user's chats")
    if facts.quota_files:
        limits.append(f"{facts.quota_files} files for all of this user's chats")
    return f"- Storage limits: {', '.join(limits)}.\n" if limits else ""


def _state_line(facts: PromptFacts) -> str:
    packages = ", ".join(f"{name} {version}" for name, version in facts.packages)
    more = (
        f" There are {facts.more_packages} more (importlib.metadata.distributions() lists them all)."
        if facts.more_packages and packages
        else ""
    )
    have = f"- Python packages you can import: {packages}.{more}\n" if packages else ""
    if facts.tools:
        have += f"- Command-line tools in bash, besides coreutils: {', '.join(facts.tools)}.\n"
    if facts.kernel_idle_minutes is None:
        return have + "- Every run starts a fresh Python: variables do not carry over, only files do.\n"
    figures = (
        "- Matplotlib figures you show (plt.show()) or leave open are saved as PNG in /mnt/data, then closed "
        "as in Jupyter, and shown to the user under the run (do not link them again), at most "
        f"{MAX_FIGURES_PER_RUN} per run (close the ones you do not need); you are told their paths.\n"
        if facts.figures_shown
        else "- Matplotlib figures you show (plt.show()) or leave open are saved as PNG in /mnt/data, then "
        f"closed as in Jupyter, at most {MAX_FIGURES_PER_RUN} per run; you are told their paths. Write a "
        "figure's path in your answer to show it to the user.\n"
    )
    return (
        have
        + "- Python runs in a live kernel that belongs to this chat: variables, imports and functions carry "
        "over from one run to the next (do not reload or recompute what you already have). The kernel is "
        f"reset after {facts.kernel_idle_minutes:g} minutes without a run; you are told when that "
        "happens, and files in /mnt/data are always kept. Bash runs in the same sandbox.\n" + figures
    )


def system_prompt(facts: PromptFacts) -> str:
    how = (
        "Run code with the `run_code` tool (language `python` or `bash`). "
        "You will get its output back and can run more code."
        if facts.tool_mode
        else "To run code, write it in a fenced block tagged ```python or ```bash; every such block in your "
        "reply is run in order and you will get the output back. Do not use those tags for code that "
        "must not run."
    )
    network = (
        "has network access" if facts.network else "has NO network access (no pip install, no downloads)"
    )
    return (
        "You can run code in a sandbox with a persistent folder, /mnt/data, that belongs to this chat.\n"
        f"{how}\n"
        "- Files in /mnt/data stay there for the whole chat: what you write in one step you can read in the "
        "next. Files the user attached to the chat are copied there too.\n"
        "- Save every file the user should get in /mnt/data (not /tmp, which is not kept).\n"
        "- To give the user a file, write its full path, e.g. /mnt/data/report.csv, in your answer as plain "
        "text (not in a code block): it becomes a download link, and an image is shown inline. Name each "
        "file once.\n"
        + _state_line(facts)
        + _limits_line(facts, network)
        + _quota_line(facts)
        + "".join(f"- Note: {note}\n" for note in facts.sandbox_notes)
        + _file_lines(facts)
    )


def _limits_line(facts: PromptFacts, network: str) -> str:
    if facts.kernel_idle_minutes is None:
        return (
            f"- Limits per run: {facts.timeout_s:g} s, {facts.memory_mb} MB of memory; "
            f"the sandbox {network}.\n"
        )
    return (
        f"- Limits: {facts.timeout_s:g} s per run; {facts.memory_mb} MB of memory for the kernel, with "
        f"everything it holds (going over resets it); the sandbox {network}.\n"
    )
