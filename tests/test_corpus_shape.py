"""The corpus of model-written cells (tests/corpus/) is what the issue asked of it: at least 150 cells
over the categories people use a code interpreter for, bash among them, nearly all of them expected to
pass, and every known failure with its reason."""

from __future__ import annotations

from tests.support import corpus


def test_the_corpus_is_large_and_nearly_all_of_it_is_expected_to_pass() -> None:
    categories = corpus.load()
    cells = [c for cells in categories.values() for c in cells]
    assert len(cells) >= 150
    assert len(categories) >= 12
    known = [c for c in cells if c.known_failure]
    assert (len(cells) - len(known)) / len(cells) >= 0.95, [c.id for c in known]
    assert all(len(c.known_failure or "") > 20 for c in known)  # a reason, not a tag
    assert sum(c.language == "bash" for c in cells) >= 15


def test_a_cell_that_does_not_parse_is_an_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "broken.md").write_text("## one\n> asked\n\n```python\nprint(1)\n```\n\n## two\nno request\n")
    try:
        corpus.load(tmp_path)
    except ValueError as exc:
        assert "two" in str(exc)
    else:
        raise AssertionError("a broken cell was accepted")
