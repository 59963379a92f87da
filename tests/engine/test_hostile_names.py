"""File names are chosen by sandboxed code: our notes must show them, never interpret them as markup.

The rules of Open WebUI's renderer that these checks encode (engine/markup.py says which and why) are
proven in Chromium through a real Open WebUI by tests/e2e/test_browser.py; here every output is checked
against them, for many hostile strings."""

from __future__ import annotations

import random
import re

from engine import StepResult, code_span, escape_text, mention
from engine.markup import JOINER, details, details_as_read, visible
from runner import Outcome, RunResult
from storage import ReconcileReport, Rejected

OK = RunResult(outcome=Outcome.OK, exit_code=0, stdout="", stderr="", duration_s=0.1)
J = JOINER
PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")  # what a backslash escapes in markdown
# What markdown, marked's GFM and Open WebUI's extensions read in one line of text.
ACTIVE = frozenset("\\`*_{}<>#+!|~$@^[]")
HOSTILE = [
    "the cell ran out of memory (512 MB).",
    r"literal \(x\) and \[y\] \b C:\bin\build \\[z] \ce{H2O} \pu{1 kg} \begin{equation}x\end{equation}",
    "[x](http://evil.example) ![x](http://evil.example/x.png) [x][1] [1] [^1] [1]: http://e",
    "$x^2$ and $5 or $$y$$",
    "a & b &lt; c &amp; d &#91;x&#93;(http://e)",
    "<script>alert(1)</script> <img src=x onerror=alert(2)> <details> </details> <@user> <u>u</u>",
    "`code` ```fence``` _under_ *star* **bold** __bold__ ~~del~~ ~x~ ==hl==",
    "http://evil.example/x www.evil.example WWW.EVIL.EXAMPLE a@b.example HTTPS://x.y ftp://f.g",
    "line one\nline two\r\n\u202eexe.txt\u200b",
    "{{user}} {{HTML_FILE_ID_0a1b}} :smile: x^2^",
    "[draft].txt a[1] x [y]. [z] ]x[ \\",
    "- dash",
    "1. one",
    "2) two",
    "--- hr",
    "> quote",
    "# h",
    "[lead",
]


def unescaped(written: str) -> str:
    """What markdown shows of a text made of escapes and plain characters (joiners show nothing); also
    checks that every backslash starts an escape (no backslash is left for what follows it)."""
    shown, i = [], 0
    while i < len(written):
        if written[i] == "\\":
            assert written[i + 1 : i + 2] in PUNCTUATION, (written, i)
            shown.append(written[i + 1])
            i += 2
        else:
            if written[i] != J:
                shown.append(written[i])
            i += 1
    return "".join(shown)


def plain_characters(written: str) -> str:
    """The characters of `written` that are not escaped (escapes replaced by a space)."""
    return re.sub(r"\\.", " ", written)


def assert_shows_as_written(text: str) -> None:
    written = escape_text(text)
    assert unescaped(written) == " ".join(visible(text).split()), (text, written)
    plain = plain_characters(written)
    assert not ACTIVE & set(plain), (text, written)
    # Autolinks: no `://`, `www.` or e-mail address left whole.
    assert "://" not in plain and not re.search("www[.]", plain, re.I) and "@" not in plain, written
    # Open WebUI's KaTeX: no `\(` or `\)` escape ever; a `\]` is never a closer (a joiner follows it).
    assert "\\(" not in written.replace("\\\\", "") and "\\)" not in written.replace("\\\\", "")
    assert all(written[m.end() : m.end() + 1] == J for m in re.finditer(r"(?<!\\)(?:\\\\)*\\\]", written))
    # ... and its paragraph cut: `\[` or `\b` after a joiner only (and never as a paragraph's 2nd
    # character), `$$` never.
    for cut in re.finditer(r"\\[\[b]|\$\$", written):
        assert cut.group() != "$$" and cut.start() >= 2 and written[cut.start() - 1] == J, written
    # A line's start: no list item or thematic break.
    assert not re.match(r"[-+*]|\d{1,9}[.)](\s|$)", written), written
    # A link's text, where marked takes the backslashes off brackets: no citation, footnote or link.
    label = re.sub(r"\\([\[\]])", r"\1", written)
    assert not re.search(r"\[[\d^]|\][^\u2060]|\]$", label), label


def random_hostile(rng: random.Random) -> str:
    pieces = [*"\\[]()$`*_&<>b1^@-#!.:~|é \n", "$$", "&lt;", "://", "www.", "http", "{{", "}}", "user"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 24)))


def test_hostile_text_is_written_to_show_as_itself():
    for text in HOSTILE:
        assert_shows_as_written(text)
    rng = random.Random(2024)
    for _ in range(5000):
        assert_shows_as_written(random_hostile(rng))


def test_what_the_escapes_look_like():
    # Parentheses stay as they are: `\(` is math to Open WebUI.
    assert escape_text("out of memory (512 MB)") == "out of memory (512 MB)"
    assert escape_text("<b>[x](y)</b>\n# h") == f"\\<b\\>{J}\\[x\\]{J}(y)\\</b\\>\\\\n\\# h"
    assert escape_text("a & b &lt; c") == "a & b &lt; c"  # entities show as written: `&` means itself
    assert escape_text("$5 and $6") == "\\$5 and \\$6"
    assert escape_text("C:\\bin\\x") == f"C:\\\\{J}bin\\\\x"
    assert escape_text("see http://e.example or www.e.example") == "see http\\://e.example or www\\.e.example"
    assert escape_text("[1]") == f"{J}{J}\\[{J}1\\]{J}"
    assert escape_text("- a") == "\\- a" and escape_text("3. a") == "3\\. a"
    assert escape_text("3) a") == f"3{J}) a"


def test_plain_paths_stay_bare_so_they_become_links():
    for path in ("report.csv", "out/chart.png", "données/été.csv", ".env", "a_b-c+d@e=f%20.txt", "my_v2.csv"):
        assert mention(path) == "/mnt/data/" + path


def test_a_bare_name_that_would_still_be_read_as_markdown_is_a_code_span():
    # A file that no longer exists is not linked: its bare name would stay text, read as markdown.
    for path in ("__init__.py", "_x_.csv", "d/_x", "x_.csv", "photo@2x.png", "www.site.html", "a/WWW.b"):
        assert mention(path) == f"`/mnt/data/{path}`"


def test_anything_markdown_or_html_would_read_becomes_a_literal_code_span():
    assert mention("<img src=x onerror=alert(1)>.txt") == "`/mnt/data/<img src=x onerror=alert(1)>.txt`"
    assert mention("](javascript:alert(1))") == "`/mnt/data/](javascript:alert(1))`"
    assert mention("a\n# heading") == "`/mnt/data/a\\n# heading`"  # one line, newline shown
    assert mention("\u202eexe.txt") == "`/mnt/data/\\u202eexe.txt`"  # bidi override shown, not obeyed
    assert mention("x.") == "`/mnt/data/x.`"  # trailing dot: the link rewriter would cut it off
    assert code_span("a``b") == "```a``b```"
    assert code_span("`x`") == "`` `x` ``"


def test_a_code_span_keeps_open_webuis_extensions_out():
    assert code_span("a``b") == "```a``b```"
    # Its paragraph cut (a space in the code) and its `{{...}}` tokens (read between backticks too).
    assert code_span("C:\\bin a \\[x $$y") == f"`C:{J}\\bin a {J}\\[x ${J}$y`"
    tokens = code_span("{{user}} {{HTML_FILE_ID_ab}} {{x}}")
    assert tokens == "`{{user}} {{HTML_FILE_ID_ab}} {{x}}`".replace("{{u", f"{{{J}{{u").replace(
        "{{H", f"{{{J}{{H"
    )


def test_a_block_shows_its_summary_and_body_as_written():
    body = "```\n&#96;&#96;&#96; <details> </details> &lt; {{user}}\n```\n_Why: a &amp; b_"
    block = details("Not run: '<details>' </summary> &lt;", body)
    assert block == (
        f"<details>\n<summary>Not run: '<{J}details>' <{J}/summary> &lt;</summary>\n\n"
        f"```\n&amp;#96;&amp;#96;&amp;#96; <{J}details> <{J}/details> &amp;lt; {{{J}{{user}}}}\n```\n"
        "_Why: a &amp;amp; b_\n</details>"
    )
    # What the model reads of it later: the body as given (joiners aside), the text around as it was.
    read = details_as_read(f"Before.\n{block}\n\nAfter, &amp; as written.").replace(J, "")
    summary = "Not run: '<details>' </summary> &lt;"
    block = f"<details>\n<summary>{summary}</summary>\n\n{body}\n</details>"
    assert read == f"Before.\n{block}\n\nAfter, &amp; as written."


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
