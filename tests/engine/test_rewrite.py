import pytest

from engine.rewrite import StreamingRewriter, Target, find_paths, rewrite

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
    assert "](javascript" not in out
    assert "<img" not in out
    assert out.endswith("(/cache/x/T/evil.txt)")


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
