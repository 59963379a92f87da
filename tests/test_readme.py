"""The README's and the docs' promises that can drift: the valves tables, the two commands, the container
recipe's copies, the README's size, and the relative links between the pages."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_valves_tables_in_the_docs_are_current():
    done = subprocess.run(
        [sys.executable, "tools/valves_table.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    page = (REPO / "docs" / "configuration.md").read_text()
    assert sum(line.startswith("| `") for line in page.splitlines()) > 20
    assert "docs/configuration.md" in README


def test_the_two_commands_exist_and_ci_runs_the_test_command():
    assert "./scripts/serve" in README and "./scripts/test" in README
    assert "exec ./scripts/test" in (REPO / ".ci" / "run").read_text()
    for script in ("scripts/serve", "scripts/test", "scripts/setup", ".ci/run"):
        assert (REPO / script).stat().st_mode & 0o111, f"{script} is not executable"


def test_the_readme_stays_a_front_page():
    assert len(README.encode()) <= 8000, "README.md is over 8 KB: move the detail into docs/"


def _docker_run(text: str) -> str:
    """The first `docker run -d ...` command of a page, its continuation lines joined."""
    match = re.search(r"^[ \t]*(docker run -d .*?)(?<!\\)\n", text, re.M | re.S)
    assert match, "no `docker run -d ...` line"
    return " ".join(match.group(1).replace("\\\n", " ").split())


def test_the_docs_copies_of_the_container_recipe_are_the_readmes():
    # tests/container/recipe.py runs the README's line; the copies a reader may take instead must match it.
    for page in ("docs/install.md", "docs/runner.md"):
        assert _docker_run((REPO / page).read_text()) == _docker_run(README), page


def _unfenced(text: str) -> str:
    """The text outside fenced code blocks, where a `#` starts a heading."""
    return re.sub(r"^ *```.*?^ *```", "", text, flags=re.M | re.S)


def _prose(text: str) -> str:
    """The text outside code blocks and inline code, where a link is a link."""
    return re.sub(r"`[^`\n]*`", "", _unfenced(text))


def _anchors(page: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", _unfenced(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-")
        n, unique = 0, slug
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


def test_every_relative_link_in_the_readme_and_the_docs_reaches_its_file_and_heading():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            name = f"{page.relative_to(REPO)}: {target}"
            if not file.exists():
                broken.append(f"{name} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{name} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
