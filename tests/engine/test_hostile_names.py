"""File names are chosen by sandboxed code: our notes must show them, never interpret them as markup."""

from __future__ import annotations

from engine import StepResult, code_span, escape_text, mention
from runner import Outcome, RunResult
from storage import ReconcileReport, Rejected

OK = RunResult(outcome=Outcome.OK, exit_code=0, stdout="", stderr="", duration_s=0.1)


def test_plain_paths_stay_bare_so_they_become_links():
    for path in ("report.csv", "out/chart.png", "données/été.csv", ".env", "a_b-c+d@e=f%20.txt"):
        assert mention(path) == "/mnt/data/" + path


def test_anything_markdown_or_html_would_read_becomes_a_literal_code_span():
    assert mention("<img src=x onerror=alert(1)>.txt") == "`/mnt/data/<img src=x onerror=alert(1)>.txt`"
    assert mention("](javascript:alert(1))") == "`/mnt/data/](javascript:alert(1))`"
    assert mention("a\n# heading") == "`/mnt/data/a\\n# heading`"  # one line, newline shown
    assert mention("\u202eexe.txt") == "`/mnt/data/\\u202eexe.txt`"  # bidi override shown, not obeyed
    assert mention("x.") == "`/mnt/data/x.`"  # trailing dot: the link rewriter would cut it off
    assert code_span("a``b") == "```a``b```"
    assert code_span("`x`") == "`` `x` ``"


def test_error_text_quoting_a_name_is_inert():
    assert escape_text("<b>[x](y)</b>\n# h") == "&lt;b&gt;\\[x\\]\\(y\\)&lt;/b&gt;\\\\n\\# h"


def test_file_notes_never_paste_raw_names():
    report = ReconcileReport(
        added=["<img src=x onerror=alert(1)>.txt", "ok.txt"],
        removed=["[a](javascript:b)"],
        rejected=[Rejected("<svg onload=x>", "symlink"), Rejected("d/" * 32, "too deep")],
    )
    notes = StepResult("python", "", run=OK, files=report).file_notes()
    assert notes == [
        "Saved: `/mnt/data/<img src=x onerror=alert(1)>.txt`, /mnt/data/ok.txt",
        "Deleted: `/mnt/data/[a](javascript:b)`",
        "Removed `/mnt/data/<svg onload=x>`: a symlink is not allowed, only files and folders",
        "Removed /mnt/data/" + "d/" * 31 + "d: nested too deep; folders that far down are not kept",
    ]
