"""What one piece of code did (`StepResult`): the words the user and the model read about a step, its
outcome, its output, the files it saved, deleted or lost to a limit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runner import Outcome, RunResult
from storage import MAX_PATH_BYTES, ReconcileReport

from .markup import mention

__all__ = ["StepResult"]

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
        text = f"{self.language.capitalize()} {words} in {spent}"
        if self.run.outcome == Outcome.ERROR and self.run.exit_code is not None:
            text += f" (exit code {self.run.exit_code})"
        return text

    def saved(self) -> list[str]:
        """The files this run added or changed and kept, figures aside (they are shown inline)."""
        report = self.files
        if report is None:
            return []
        removed = {r.path for r in report.quota_removed}
        figures = set(self.figures)
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
        kept = self.saved()
        if kept:
            notes.append("Saved: " + ", ".join(mention(p) for p in kept[:20]) + _more(kept, 20))
        deleted = self.deleted_note()
        if deleted:
            notes.append(deleted)
        return notes + self._removals()

    def for_model(self, max_chars: int = 8000) -> str:
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
