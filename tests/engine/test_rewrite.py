import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine import References, StreamingRewriter, Target, code_span, find_paths, mention, rewrite
from engine.grammar import MAX_CODE_SPAN
from engine.markup import backtick_fence, escape_text

CSV = Target(url="/cache/functions/cs/TOKEN1/report.csv", name="report.csv")
PNG = Target(url="/cache/functions/cs/TOKEN2/plot.png", name="plot.png", is_image=True)
TARGETS = {"report.csv": CSV, "plot.png": PNG, "missing.txt": None}


def test_bare_and_sandbox_paths_become_links():
    text = "Saved to /mnt/data/report.csv. Also sandbox:/mnt/data/report.csv!"
    assert rewrite(text, TARGETS) == (f"Saved to [report.csv]({CSV.url}). Also [report.csv]({CSV.url})!")


def test_markdown_link_keeps_label_and_images_render_inline():
    text = "[the report](sandbox:/mnt/data/report.csv) and ![a plot](/mnt/data/plot.png)"
    assert rewrite(text, TARGETS) == f"[the report]({CSV.url}) and ![a plot]({PNG.url})"


def test_bare_image_path_becomes_inline_image():
    assert rewrite("see /mnt/data/plot.png", TARGETS) == f"see ![plot.png]({PNG.url})"


def test_image_syntax_for_non_image_becomes_plain_link():
    assert rewrite("![r](/mnt/data/report.csv)", TARGETS) == f"[r]({CSV.url})"


def test_missing_file_stays_plain_text_never_a_link():
    assert rewrite("see /mnt/data/missing.txt", TARGETS) == "see /mnt/data/missing.txt"
    assert rewrite("[x](sandbox:/mnt/data/missing.txt)", TARGETS) == "x (sandbox:/mnt/data/missing.txt)"
    assert rewrite("[x](/mnt/data/unknown.bin)", TARGETS) == "x (/mnt/data/unknown.bin)"


def test_code_is_left_alone():
    text = (
        "Run `open('/mnt/data/report.csv')` then:\n"
        "```python\nprint('/mnt/data/report.csv')\n```\n"
        "~~~\n/mnt/data/plot.png\n~~~\n"
        "Done: /mnt/data/report.csv\n"
    )
    out = rewrite(text, TARGETS)
    assert "`open('/mnt/data/report.csv')`" in out
    assert "print('/mnt/data/report.csv')" in out
    assert "~~~\n/mnt/data/plot.png\n~~~" in out
    assert out.endswith(f"Done: [report.csv]({CSV.url})\n")
    assert find_paths(text) == ["report.csv"]


def test_unclosed_backtick_is_literal_so_path_is_prose():
    assert rewrite("a ` b /mnt/data/report.csv", TARGETS) == f"a ` b [report.csv]({CSV.url})"


def test_labels_are_escaped_for_markdown_and_html():
    evil = Target(url="/cache/x/T/evil.txt", name="a](javascript:alert(1))<img onerror=x>.txt")
    out = rewrite("/mnt/data/evil.txt", {"evil.txt": evil})
    assert out == f"[{escape_text(evil.name)}](/cache/x/T/evil.txt)"  # (tests/engine/test_hostile_names.py)
    assert "](javascript" not in out and re.search(r"(?<!\\)<img", out) is None


def test_percent_encoded_and_angle_bracket_destinations():
    spaced = Target(url="/cache/x/T/my_file.csv", name="my file.csv")
    targets = {"my file.csv": spaced}
    assert find_paths("[f](/mnt/data/my%20file.csv)") == ["my%20file.csv", "my file.csv"]
    assert rewrite("[f](/mnt/data/my%20file.csv)", targets) == f"[f]({spaced.url})"
    assert rewrite("[f](</mnt/data/my file.csv>)", targets) == f"[f]({spaced.url})"


def test_paths_that_are_not_files():
    assert find_paths("the folder /mnt/data/ and /mnt/data") == []
    assert find_paths("http://example.com/mnt/data/x.csv") == []


def test_subdirectories():
    nested = Target(url="/cache/x/T/a.csv", name="a.csv")
    assert rewrite("/mnt/data/out/a.csv", {"out/a.csv": nested}) == f"[a.csv]({nested.url})"


@pytest.mark.parametrize("chunking", [1, 3, 7, 50])
async def test_streaming_matches_whole_text(chunking):
    text = (
        "Here it is: /mnt/data/report.csv\n"
        "```\n/mnt/data/report.csv\n```\n"
        "and ![p](sandbox:/mnt/data/plot.png) done"
    )
    calls: list[str] = []

    async def resolve(path):
        calls.append(path)
        return TARGETS.get(path)

    streamer = StreamingRewriter(resolve)
    out = ""
    for i in range(0, len(text), chunking):
        out += await streamer.feed(text[i : i + chunking])
    out += await streamer.flush()
    assert out == rewrite(text, TARGETS)
    assert sorted(calls) == ["plot.png", "report.csv"]  # each file resolved once


def test_images_can_be_plain_links_in_listings():
    assert (
        rewrite("- Saved: /mnt/data/plot.png", TARGETS, inline_images=False)
        == f"- Saved: [plot.png]({PNG.url})"
    )
    assert rewrite("![p](/mnt/data/plot.png)", TARGETS, inline_images=False) == f"[p]({PNG.url})"


# Where paths are not rewritten: only prose and the destinations of links and images to session files.


def test_html_tags_and_comments_are_left_alone():
    text = (
        '<img src="/mnt/data/plot.png" alt="plot"> <a href=\'/mnt/data/report.csv\'>csv</a>\n'
        "<!-- /mnt/data/report.csv -->, then /mnt/data/report.csv"
    )
    assert rewrite(text, TARGETS) == text.replace(
        "then /mnt/data/report.csv", f"then [report.csv]({CSV.url})"
    )
    assert find_paths(text) == ["report.csv"]  # only the one in prose


def test_link_titles_are_left_alone():
    text = "[x](https://example.com \"/mnt/data/report.csv\") and [y](https://e.com '/mnt/data/plot.png')"
    assert rewrite(text, TARGETS) == text
    # A link to a session file becomes a link to its copy; its title goes with the old destination.
    assert rewrite('[r](/mnt/data/report.csv "/mnt/data/plot.png")', TARGETS) == f"[r]({CSV.url})"


def test_code_span_across_lines_is_code():
    text = "Read it with `pd.read_csv(\n'/mnt/data/report.csv')` first."
    assert rewrite(text, TARGETS) == text
    # A code span does not cross a blank line (nor a list item, heading or fence): there it is prose.
    assert rewrite("a ` b\n\n/mnt/data/report.csv `", TARGETS) == f"a ` b\n\n[report.csv]({CSV.url}) `"
    assert rewrite("- a `b\n- /mnt/data/report.csv `c", TARGETS) == f"- a `b\n- [report.csv]({CSV.url}) `c"


def test_links_that_point_elsewhere_are_left_alone():
    for text in (
        "[see /mnt/data/report.csv](https://example.com/)",
        "[![plot](/mnt/data/plot.png)](https://example.com/)",
        "[docs](https://example.com/mnt/data/report.csv)",
        "[a](<https://example.com/a b>) [b](#/mnt/data/report.csv)",
    ):
        assert rewrite(text, TARGETS) == text, text


def test_urls_and_autolinks_are_left_alone():
    for text in (
        "<https://x.com/mnt/data/report.csv>",
        "https://x.com/mnt/data/report.csv",
        "https://x.com/get?file=/mnt/data/report.csv",
        "file:///mnt/data/report.csv",
        "<user@example.com> /mnt/database/x",
    ):
        assert rewrite(text, TARGETS) == text, text


def test_sandbox_autolink_becomes_a_link_and_unknown_files_never_a_dead_one():
    assert rewrite("<sandbox:/mnt/data/report.csv>", TARGETS) == f"[report.csv]({CSV.url})"
    assert rewrite("<sandbox:/mnt/data/missing.txt>", TARGETS) == "sandbox:/mnt/data/missing.txt"
    assert rewrite("[empty](/mnt/data/)", TARGETS) == "empty (/mnt/data/)"


def test_destinations_with_parentheses_and_escapes():
    chart = Target(url="/cache/x/T/chart.png", name="chart(1).png", is_image=True)
    assert rewrite("![c](/mnt/data/chart(1).png)", {"chart(1).png": chart}) == f"![c]({chart.url})"
    # An escaped bracket opens no link: the path inside the parentheses is prose.
    assert rewrite(r"\[x](/mnt/data/report.csv)", TARGETS) == rf"\[x]([report.csv]({CSV.url}))"


def test_a_line_of_backticks_with_a_backtick_after_it_is_inline_code():
    text = "```not`a fence /mnt/data/report.csv```\n/mnt/data/report.csv"
    assert rewrite(text, TARGETS) == text.replace("\n/mnt/data/report.csv", f"\n[report.csv]({CSV.url})")


def test_a_code_span_too_long_to_wait_for_is_left_as_written():
    # Backticks whose closing run is more than MAX_CODE_SPAN away, in a paragraph that goes on: the rest
    # of the span's paragraph is left as written (CommonMark would say code if it closes, prose if not).
    long = "x " * MAX_CODE_SPAN
    closed = f"`{long}/mnt/data/report.csv` then /mnt/data/report.csv"
    assert rewrite(closed, TARGETS) == closed.replace(
        "then /mnt/data/report.csv", f"then [report.csv]({CSV.url})"
    )
    unclosed = f"`{long}/mnt/data/report.csv\n\n/mnt/data/report.csv"
    assert rewrite(unclosed, TARGETS) == unclosed.replace(
        "\n\n/mnt/data/report.csv", f"\n\n[report.csv]({CSV.url})"
    )
    # Short of that, an unclosed backtick is a literal backtick (see test_unclosed_backtick_is_literal).


def test_backtick_fence_is_longer_than_any_run():
    assert backtick_fence("no ticks") == "`"
    assert backtick_fence("a ``` b `", minimum=3) == "````"
    assert backtick_fence("x", minimum=3) == "```"
    assert code_span("a``b") == "```a``b```"


def test_our_own_mentions_are_linked_whole_or_left_alone():
    for path in ("report.csv", "out/chart.png", "données/été.csv", ".env", "a_b-c+d@e=f%20.txt"):
        target = Target(url="/cache/x/T/file", name=path.rsplit("/", 1)[-1])
        out = rewrite(f"Saved: {mention(path)}, done", {path: target})
        assert out.startswith("Saved: [") and out.endswith("](/cache/x/T/file), done"), out
    hostile = mention("<img src=x onerror=alert(1)>.txt")
    assert rewrite(f"Saved: {hostile}", {"<img src=x onerror=alert(1)>.txt": CSV}) == f"Saved: {hostile}"


def test_references_can_be_built_in_threads():
    # The engine scans large answers in a worker thread: the scan shares no state between calls.
    texts = [f"{i}: /mnt/data/report.csv `x` [p](/mnt/data/plot.png) " * 200 for i in range(16)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda text: References(text).rewrite(TARGETS), texts * 4))
    assert results == [rewrite(text, TARGETS) for text in texts] * 4


def test_a_comment_left_open_ends_with_its_paragraph():
    # An unclosed `<!--` leaves the rest of its paragraph as written, not the rest of the answer; a
    # heading is a paragraph of one line.
    assert rewrite("# Title <!--\n/mnt/data/report.csv", TARGETS) == f"# Title <!--\n[report.csv]({CSV.url})"
    assert rewrite("a <!-- b\n\n/mnt/data/report.csv", TARGETS) == f"a <!-- b\n\n[report.csv]({CSV.url})"
    assert rewrite("a <!-- b\n/mnt/data/report.csv", TARGETS) == "a <!-- b\n/mnt/data/report.csv"
