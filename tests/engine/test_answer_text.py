"""How an answer reads: one mark per run, each file once (issue 23).

Real storage (index, reconcile, publishing to a folder) and the real conversation loop; only the sandbox
is stood in for by a run that writes the files it is told to on the host, so the rules about the text
are checked quickly and exactly. The same rules through gVisor and the installed function:
tests/function/test_pipe.py; through a real Open WebUI in Chromium: tests/e2e/test_browser.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine import Engine, LoopOptions, converse, escape_text
from engine.sse import TextDelta, ToolCall
from runner import KernelSettings, Limits, Outcome, Runner, RunResult
from storage import DirectoryPublisher, Quotas, Session, Store

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 64
DETAILS = re.compile(r"<details>.*?</details>", re.S)


class HostRuns(Engine):
    """Engine whose `execute` writes the next planned files straight into the folder."""

    def __init__(self, store: Store) -> None:
        super().__init__(store, Runner())
        self.plans: list[dict] = []

    async def execute(
        self, session: Session, code: str, language: str, limits: Limits, kernels: KernelSettings
    ) -> RunResult:
        plan = self.plans.pop(0)
        for name, data in plan.get("files", {}).items():
            (session.path / name).write_bytes(data)
        return RunResult(
            outcome=plan.get("outcome", Outcome.OK),
            exit_code=plan.get("exit_code", 0),
            stdout=plan.get("stdout", "ok\n"),
            stderr=plan.get("stderr", ""),
            duration_s=0.25,
            reason=plan.get("reason"),
            figures=tuple(plan.get("figures", ())),
            notes=tuple(plan.get("notes", ())),
        )


@pytest.fixture
async def service(tmp_path: Path):
    store = Store(
        tmp_path / "root",
        quotas=Quotas(max_files_per_user=100, max_bytes_per_user=1 << 20, max_file_bytes=1 << 16),
        publisher=DirectoryPublisher(tmp_path / "cache" / "functions" / "cs", "/cache/functions/cs/"),
    )
    async with store:
        yield HostRuns(store)


def model(*replies: str | None, language: str = "python"):
    """A model that calls run_code (a None reply) or answers with text, in turn; records its inputs."""
    seen: list[list[dict]] = []

    async def call(messages, tools):
        seen.append(json.loads(json.dumps(messages)))
        reply = replies[len(seen) - 1]
        if reply is None:
            yield ToolCall(f"c{len(seen)}", "run_code", json.dumps({"code": "pass", "language": language}))
        else:
            yield TextDelta(reply)

    return call, seen


class Statuses(list):
    async def __call__(self, description: str, done: bool, *, hidden: bool = False) -> None:
        self.append((description, done, hidden))

    def shown_at_the_end(self) -> str | None:
        """What Open WebUI 0.12 shows over the message once it is done: the last status unless hidden."""
        description, _, hidden = self[-1]
        return None if hidden else description


async def answer(
    service: HostRuns, *replies: str | None, attachments: bool = True, language: str = "python", **options
):
    chat = await service.chat("u", "c")
    call, seen = model(*replies, language=language)
    status = Statuses()
    loop = LoopOptions(attachments=attachments, **options)
    text = "".join([p async for p in converse(chat, [{"role": "user", "content": "go"}], call, loop, status)])
    return text, chat, status, seen


def outside_blocks(text: str) -> str:
    """The text a reader sees with every block collapsed (Open WebUI renders a closed one's title only)."""
    return DETAILS.sub(lambda m: re.search(r"<summary>(.*?)</summary>", m.group(), re.S).group(1), text)


def named(text: str, name: str) -> int:
    """How often a file's name is shown as a link or an image (a link's URL repeats the name: not counted)."""
    return len(re.findall(r"\[" + re.escape(name) + r"\]\(", text))


async def test_a_run_the_answer_names_shows_one_block_one_link_and_no_lasting_status(service: HostRuns):
    service.plans = [{"files": {"report.csv": b"month,visitors\n"}}]
    text, chat, status, seen = await answer(service, None, "Your file is ready: /mnt/data/report.csv")
    assert text.count("<details>") == 1
    visible = outside_blocks(text)
    assert named(visible, "report.csv") == 1 and "Saved" not in visible
    assert [link.name for link in chat.attachments] == ["report.csv"]  # and once among the attachments
    assert status[0] == ("Running Python\u2026", False, False)
    assert status.shown_at_the_end() is None  # the block is the run's record: the status goes
    assert "Saved: /mnt/data/report.csv" in seen[1][-1]["content"]  # the model learns it


async def test_a_file_the_answer_does_not_name_is_an_attachment_and_nowhere_in_the_text(service: HostRuns):
    service.plans = [{"files": {"notes.txt": b"n"}}]
    text, chat, _, seen = await answer(service, None, "Done.")
    assert "notes.txt" not in outside_blocks(text)
    [link] = chat.attachments
    assert link.name == "notes.txt" and Path(link.url).name == "notes.txt"
    assert "Saved: /mnt/data/notes.txt" in seen[1][-1]["content"]


async def test_without_attachments_a_file_not_named_is_named_in_one_line_at_the_end(service: HostRuns):
    service.plans = [{"files": {"a.txt": b"a", "b.txt": b"b"}}, {"files": {"a.txt": b"again"}}]
    text, chat, _, _ = await answer(service, None, None, "See /mnt/data/b.txt", attachments=False)
    visible = outside_blocks(text)
    assert named(visible, "b.txt") == 1 and named(visible, "a.txt") == 1  # a.txt saved twice, said once
    last = visible.rstrip().splitlines()[-1]  # one line, at the end
    assert last.startswith("Saved: [a.txt](/cache/functions/cs/") and "b.txt" not in last
    assert chat.attachments == chat.links  # (shown only if the host has attachments)


async def test_a_figure_is_shown_inline_once_never_listed_nor_attached(service: HostRuns):
    for attachments in (True, False):
        service.plans = [{"files": {"figure-1.png": PNG}, "figures": ["figure-1.png"]}]
        text, chat, _, seen = await answer(service, None, "Here is the trend.", attachments=attachments)
        visible = outside_blocks(text)
        assert visible.count("![figure-1.png](") == 1 and named(visible, "figure-1.png") == 1
        assert "Saved" not in visible and "Figures" not in visible
        assert chat.attachments == []  # shown inline: not again as an attachment
        assert "Figures: /mnt/data/figure-1.png" in seen[1][-1]["content"]


async def test_a_picture_saved_but_not_shown_is_attached_as_an_image(service: HostRuns):
    service.plans = [{"files": {"plot.png": PNG, "shown.png": PNG}}]
    text, chat, _, _ = await answer(service, None, "Look: /mnt/data/shown.png")
    visible = outside_blocks(text)
    assert visible.count("![shown.png](") == 1 and "plot.png" not in visible
    assert [(link.name, link.is_image) for link in chat.attachments] == [("plot.png", True)]
    assert {link.name for link in chat.links} == {"plot.png", "shown.png"}  # both linked to the chat


async def test_a_limit_is_said_once_under_the_block_and_the_status_goes(service: HostRuns):
    why = "interrupted after 30 s; the Python state is kept"
    service.plans = [{"outcome": Outcome.TIMEOUT, "exit_code": None, "reason": why, "files": {"p.csv": b"1"}}]
    text, chat, status, seen = await answer(service, None, "It took too long.")
    visible = outside_blocks(text)
    assert text.count("<details>") == 1 and visible.count(why) == 1
    assert f"_Why: {why}._" in visible  # the block's headline says which limit; this line says why
    assert "Python was stopped: time limit reached in 250 ms" in visible  # the block's headline
    assert status.shown_at_the_end() is None  # the text says it all
    assert f"Reason: {why}" in seen[1][-1]["content"]
    assert [link.name for link in chat.attachments] == ["p.csv"]  # what it wrote before: kept, given


async def test_the_reason_a_limit_gives_is_shown_as_text_never_as_markup(service: HostRuns):
    hostile = "the kernel stopped responding: it exited (<img src=x onerror=alert(1)> [x](javascript:y))"
    service.plans = [{"outcome": Outcome.KERNEL_LOST, "exit_code": None, "reason": hostile}]
    text, _, _, _ = await answer(service, None, "Gone.")
    visible = outside_blocks(text)
    assert f"_Why: {escape_text(hostile)}._" in visible  # written to show as itself (test_hostile_names)
    assert re.search(r"(?<!\\)<img", visible) is None and "](javascript" not in visible


async def test_a_reset_is_said_once_in_the_text_and_stays_in_the_status(service: HostRuns):
    reset = "The Python state was reset (it was idle); files in /mnt/data are kept."
    service.plans = [{"notes": [reset], "files": {"x.txt": b"x"}}]
    text, chat, status, _ = await answer(service, None, "Done.")
    assert outside_blocks(text).count(reset) == 1
    assert status.shown_at_the_end() == reset
    assert [link.name for link in chat.attachments] == ["x.txt"]


TRACEBACK = """Traceback (most recent call last):
  File "<cell-1>", line 2, in <module>
    1 / 0
    ~~^~~
ZeroDivisionError: division by zero
"""


async def test_a_failed_run_is_headed_by_its_exception_and_clears_the_status(service: HostRuns):
    service.plans = [
        {"outcome": Outcome.ERROR, "exit_code": 1, "reason": "exit code 1", "stdout": "", "stderr": TRACEBACK}
    ]
    text, _, status, seen = await answer(service, None, "It failed.")
    visible = outside_blocks(text)
    assert "<summary>ZeroDivisionError: division by zero (Python, 250 ms)</summary>" in text
    assert "exit code" not in text and "Why" not in text  # a bare exit code says nothing more
    assert "Traceback (most recent call last)" in text  # the whole of it inside the block, its record
    assert "Why" not in visible and status.shown_at_the_end() is None
    assert seen[1][-1]["content"].startswith("ZeroDivisionError: division by zero (Python, 250 ms).\n")


async def test_a_failed_shell_command_is_headed_by_its_last_error_line_and_exit_code(service: HostRuns):
    error = "ls: cannot access 'nope': No such file or directory\n"
    service.plans = [{"outcome": Outcome.ERROR, "exit_code": 2, "reason": "exit code 2", "stderr": error}]
    text, _, _, _ = await answer(service, None, "It failed.", language="bash")
    assert "<summary>ls: cannot access 'nope': No such file or directory (Bash, exit code 2, 250 ms)" in text


async def test_a_failure_without_an_error_line_says_its_exit_code_and_why(service: HostRuns):
    killed = "exit code 137 (killed by SIGKILL)"
    service.plans = [
        {"outcome": Outcome.ERROR, "exit_code": 3, "reason": "exit code 3", "stdout": "", "stderr": "\n"},
        {"outcome": Outcome.ERROR, "exit_code": 137, "reason": killed, "stdout": ""},
    ]
    text, _, _, _ = await answer(service, None, None, "It failed.")
    assert "<summary>Python exited with code 3 in 250 ms</summary>" in text
    assert "<summary>Python exited with code 137 in 250 ms</summary>" in text
    assert text.count("_Why:") == 1 and f"_Why: {escape_text(killed)}_" in text


HOSTILE_ERROR = (
    "ValueError: </summary></details><img src=x onerror=alert(1)> {{user}} $x$ &lt;b&gt; "
    "[a](https://evil.example)\u202egpj.exe\t" + "x" * 400
)


async def test_a_hostile_error_line_heads_its_block_as_plain_text(service: HostRuns):
    stderr = 'Traceback (most recent call last):\n  File "<cell-1>", line 1, in <module>\n' + HOSTILE_ERROR
    service.plans = [{"outcome": Outcome.ERROR, "exit_code": 1, "reason": "exit code 1", "stderr": stderr}]
    text, _, _, _ = await answer(service, None, "It failed.")
    [summary] = re.findall(r"<summary>(.*)</summary>", text)
    # Its tags broken apart (the block cannot end early), Open WebUI's tokens too, control characters
    # shown as escapes, and clipped: the rest is in the block.
    assert "</summary></details>" not in summary and "<\u2060/summary><\u2060/details>" in summary
    assert "{{user}}" not in summary and "{\u2060{user}}" in summary
    assert "\\u202e" in summary and "\u202e" not in summary
    assert summary.endswith("\u2026 (Python, 250 ms)") and len(summary) < 200
    assert text.count("<details>") == 1 and text.count("</details>") == 1


async def test_fenced_blocks_follow_the_same_rules(service: HostRuns):
    service.plans = [{"files": {"out.csv": b"1"}}, {"files": {"more.csv": b"2"}}]
    call_text = "Running:\n\n```python\nprint(1)\n```\n\n```python\nprint(2)\n```\n"
    text, chat, status, _ = await answer(service, call_text, "Here: /mnt/data/out.csv", tool_mode=False)
    visible = outside_blocks(text)
    assert text.count("<details>") == 2
    assert named(visible, "out.csv") == 1 and "more.csv" not in visible
    assert [link.name for link in chat.attachments] == ["out.csv", "more.csv"]
    assert [s for s in status if not s[1]] == [("Running Python\u2026", False, False)] * 2
    assert status.shown_at_the_end() is None
