"""What one piece of code did (`StepResult`): the words the user and the model read about a step, its
outcome, its output, the files it saved, deleted or lost to a limit."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from runner import Outcome, RunResult
from storage import MAX_PATH_BYTES, ReconcileReport

from .markup import mention, visible

__all__ = ["MAX_RESULT_CHARS", "StepResult"]

MAX_RESULT_CHARS = 8000  # of a step's result the model reads, at most (LoopOptions.max_result_chars)

_OUTCOME_WORDS = {
    Outcome.OK: "finished",
    Outcome.ERROR: "exited with an error",
    Outcome.TIMEOUT: "was stopped: time limit reached",
    Outcome.OOM: "was stopped: out of memory",
    Outcome.OUTPUT_LIMIT: "was stopped: too much output",
    Outcome.DISK_LIMIT: "was stopped: it wrote more than the disk limit",
    Outcome.SANDBOX_FAILURE: "could not run: the sandbox failed",
    Outcome.KERNEL_LOST: "was stopped: the kernel stopped responding",
}

# A failed run's headline is what went wrong, in the words of its last error line: for Python, the line
# that names the exception (`ZeroDivisionError: division by zero`), else stderr's last line (bash's
# `ls: cannot access 'x': No such file or directory`). It is the run's own output, hostile: read from
# stderr's tail only (a bounded cost), clipped, its control characters shown as escapes; `details` keeps
# it plain text.
_TAIL_CHARS = 8192
_LINE_CHARS = 160
# A traceback's frame line, also inside an exception group ("  |   File ...").
_FRAME = re.compile(r' *(?:\| +)?File "')
_GROUP_MARGIN = re.compile(r" *\| ?")
# The rules of an exception group's traceback (`+-+---- 1 ----`, `+------`), and a line of nothing.
_RULE = re.compile(r"[\s|+-]*|\s*\+-.*")
_PLAIN_EXIT = re.compile(r"exit code \d+")


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one piece of code did, for the model (text) and for the user (status, summary)."""

    language: str
    code: str
    run: RunResult | None = None
    files: ReconcileReport | None = None
    refused: str | None = None  # why the code was not run at all (sandbox unavailable, busy)
    # Sentences about the step for the user and the model (over quota, a full disk, ...).
    notes: tuple[str, ...] = ()
    # Figures the run saved (the kernel's claim, checked against what the run added to the folder).
    figures: tuple[str, ...] = ()
    # Plotly charts the run saved, the same way: (spec, its static picture or None), shown in the message.
    charts: tuple[tuple[str, str | None], ...] = ()

    @property
    def ok(self) -> bool:
        return self.run is not None and self.run.outcome == Outcome.OK

    def headline(self) -> str:
        if self.refused is not None:
            return f"Not run: {self.refused}"
        assert self.run is not None
        words = _OUTCOME_WORDS.get(self.run.outcome, str(self.run.outcome))
        took = self.run.duration_s
        spent = f"{took * 1000:.0f} ms" if took < 1 else f"{took:.1f} s"
        language = self.language.capitalize()
        if self.run.outcome != Outcome.ERROR:
            return f"{language} {words} in {spent}"
        code = self.run.exit_code
        line = error_line(self.run.stderr)
        if line is None:
            ended = f"exited with code {code}" if code else "failed"
            return f"{language} {ended} in {spent}"
        # Python's exit code says nothing the exception does not; a shell's may.
        said = f"exit code {code}, " if code and self.language != "python" else ""
        return f"{line} ({language}, {said}{spent})"

    def why_failed(self) -> str | None:
        """What the record of a failed run adds to its headline (why a cell could not start, the signal
        that killed it); None when the headline says it all (a bare exit code)."""
        run = self.run
        if run is None or run.outcome != Outcome.ERROR or not run.reason:
            return None
        return None if _PLAIN_EXIT.fullmatch(run.reason) else run.reason

    def saved(self) -> list[str]:
        """The files this run added or changed and kept, figures aside (they are shown inline)."""
        report = self.files
        if report is None:
            return []
        removed = {r.path for r in report.quota_removed}
        figures = {*self.figures, *(name for chart in self.charts for name in chart if name)}
        return sorted(
            path for path in {*report.added, *report.changed} if path not in removed and path not in figures
        )

    def why_stopped(self) -> str | None:
        """Why a limit (or the sandbox) stopped the run, in the sandbox's words; None otherwise."""
        if self.run is None or self.run.outcome in (Outcome.OK, Outcome.ERROR):
            return None
        return self.run.reason

    def attention(self) -> list[str]:
        """What the user must read that the run's block does not say: a lost Python state, the quota,
        files a limit removed. (Why a limit stopped the run: `why_stopped`. The files the run saved are
        not here: the answer names them, and the message's attachments hold them.)"""
        notes = [*(self.run.notes if self.run is not None else ()), *self.notes]
        more = self.run.figures_more if self.run is not None else 0
        if more:  # the kernel bounds a run's figures: the rest are counted here, never carried over
            shown = f"{len(self.figures)} figures are shown, and " if self.figures else ""
            notes.append(f"{shown}{more} more not saved (too many figures in one run)".capitalize())
        return notes + self._removals()

    def _removals(self) -> list[str]:
        report = self.files
        if report is None:
            return []
        notes = [f"Removed {mention(r.path)}: {r.reason}" for r in report.quota_removed[:20]]
        notes.extend(_more_line(report.quota_removed, 20, "more files removed by limits"))
        for rejected in report.rejected[:20]:
            notes.append(f"Removed {mention(rejected.path.rstrip('/'))}: {_why_rejected(rejected.kind)}")
        notes.extend(_more_line(report.rejected, 20, "more entries removed"))
        return notes

    def deleted_note(self) -> str | None:
        """The files the run deleted, for the record inside the block."""
        report = self.files
        if report is None or not report.removed:
            return None
        return "Deleted: " + ", ".join(mention(p) for p in report.removed[:20]) + _more(report.removed, 20)

    def file_notes(self) -> list[str]:
        """Plain sentences about files for the model: every one the run saved, the figures, what was
        deleted, what limits removed, what was rejected (the model learns all of it)."""
        report = self.files
        notes: list[str] = list(self.notes)
        if self.run is not None:
            notes[:0] = self.run.notes
        if report is None:
            return notes
        more = self.run.figures_more if self.run is not None else 0
        if self.figures:
            # The kernel bounds a run's figures (runner MAX_FIGURES_PER_RUN): all
            # are named here, and the ones past the bound are counted, in this answer.
            extra = f", and {more} more not saved (too many figures in one run)" if more else ""
            shown = ", ".join(mention(p) for p in self.figures)
            notes.append(f"Figures: {shown}{extra} (already shown to the user, under the run)")
        elif more:
            notes.append(f"{more} figures were left open and not saved (too many figures in one run)")
        if self.charts:
            named = ", ".join(mention(spec) for spec, _ in self.charts)
            pictures = ", ".join(mention(p) for _, p in self.charts if p)
            still = f"; static pictures, for readers who cannot see them: {pictures}" if pictures else ""
            notes.append(f"Interactive charts: {named} (already shown to the user, in the message){still}")
        kept = self.saved()
        if kept:
            notes.append("Saved: " + ", ".join(mention(p) for p in kept[:20]) + _more(kept, 20))
        deleted = self.deleted_note()
        if deleted:
            notes.append(deleted)
        return notes + self._removals()

    def for_model(self, max_chars: int = MAX_RESULT_CHARS) -> str:
        """The tool result the model reads: outcome, output (bounded), file changes."""
        parts = [self.headline() + "."]
        if self.run is not None:
            if self.run.reason and self.run.outcome != Outcome.OK:
                parts.append(f"Reason: {self.run.reason}")
            if self.run.stdout:
                parts.append("stdout:\n" + _clip(self.run.stdout, max_chars // 2))
            if self.run.stderr:
                parts.append("stderr:\n" + _clip(self.run.stderr, max_chars // 2))
            if not self.run.stdout and not self.run.stderr:
                parts.append("(no output)")
        parts.extend(self.file_notes())
        return "\n".join(parts)


def error_line(stderr: str) -> str | None:
    """The line of a failed run's stderr that says what went wrong: after a traceback's last frame,
    the exception's line (its first: a message may go on over more lines), else the last line that is
    not blank nor an exception group's rule. None when stderr has no such line."""
    lines = stderr[-_TAIL_CHARS:].splitlines()
    frames = [i for i, line in enumerate(lines) if _FRAME.match(line)]
    found = None
    if frames:
        for line in lines[frames[-1] + 1 :]:
            body = _GROUP_MARGIN.sub("", line, count=1) if line.lstrip().startswith("|") else line
            if body.strip() and not body[0].isspace() and not _RULE.fullmatch(line):
                found = body
                break
    if found is None:
        found = next((line for line in reversed(lines) if not _RULE.fullmatch(line)), None)
        if found is not None and found.lstrip().startswith("|"):
            found = _GROUP_MARGIN.sub("", found, count=1)
    if found is None:
        return None
    found = " ".join(visible(found).split())
    return found if len(found) <= _LINE_CHARS else found[: _LINE_CHARS - 1].rstrip() + "\u2026"


def _why_rejected(kind: str) -> str:
    if kind == "too deep":
        return "nested too deep; folders that far down are not kept"
    if kind == "path too long":
        return f"its path is longer than {MAX_PATH_BYTES} bytes; files that far down are not kept"
    if kind == "empty folder":
        return "too many empty folders; only the first 1000 are kept"
    return f"a {kind} is not allowed, only files and folders"


def _more(items: Sequence[object], shown: int) -> str:
    return f" and {len(items) - shown} more" if len(items) > shown else ""


def _more_line(items: Sequence[object], shown: int, what: str) -> list[str]:
    return [f"... and {len(items) - shown} {what}"] if len(items) > shown else []


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters omitted ...]\n{text[-half:]}"
