"""The README's and the docs' promises that can drift: the valves tables and the two commands."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


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
