"""The README's promises that can drift: the valves table and the two commands."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_valves_table_matches_the_function():
    table = subprocess.run(
        [sys.executable, "tools/valves_table.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) > 20
    missing = [row for row in rows if row not in README]
    assert not missing, "README valves table is stale; paste `python tools/valves_table.py`:\n" + "\n".join(
        missing
    )


def test_the_two_commands_exist_and_ci_runs_the_test_command():
    assert "./scripts/serve" in README and "./scripts/test" in README
    assert "exec ./scripts/test" in (REPO / ".ci" / "run").read_text()
    for script in ("scripts/serve", "scripts/test", "scripts/setup", ".ci/run"):
        assert (REPO / script).stat().st_mode & 0o111, f"{script} is not executable"
