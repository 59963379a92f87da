"""The single file an admin installs: current, loadable the way Open WebUI loads it, self-contained."""

import subprocess
import sys
from pathlib import Path

from tests.support.open_webui import OWUI_VENV
from tests.support.pipe_harness import load_like_open_webui

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / "dist" / "code_sessions.py"


def test_committed_bundle_is_current():
    result = subprocess.run(
        [sys.executable, "tools/bundle.py", "--check"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_frontmatter_is_what_open_webui_reads():
    lines = BUNDLE.read_text().splitlines()
    assert lines[0] == '"""'
    header = dict(line.split(":", 1) for line in lines[1 : lines.index('"""', 1)])
    assert header["title"].strip() == "Code Sessions"
    assert header["required_open_webui_version"].strip()
    # pydantic (and psycopg, for a PostgreSQL index) ship with Open WebUI
    assert header["requirements"].strip() == ""


def test_bundle_loads_in_open_webuis_python_without_the_repository(tmp_path):
    # Open WebUI's own interpreter, outside the repo, where our packages are not installed: only the file.
    script = tmp_path / "load.py"
    script.write_text(
        "import sys, types\n"
        f"content = open({str(BUNDLE)!r}).read()\n"
        "m = types.ModuleType('function_x'); exec(content, m.__dict__)\n"
        "pipe = m.Pipe()\n"
        "print(pipe.pipes())\n"
        "pipe.valves = pipe.Valves(base_models='a, b.c')\n"
        "print([p['id'] for p in pipe.pipes()])\n"
        "import storage\n"
    )
    python = OWUI_VENV / "bin" / "python"
    assert python.exists(), f"{python} is missing: run ./scripts/setup"
    result = subprocess.run([str(python), "-I", str(script)], cwd=tmp_path, capture_output=True, text=True)
    assert "['a', 'b.c']" in result.stdout, result.stderr
    # The embedded packages live under a private name; the plain name is not importable here.
    assert "No module named 'storage'" in result.stderr


def test_loaded_like_open_webui_the_pipe_has_its_valves():
    module = load_like_open_webui(BUNDLE.read_text())
    pipe = module.Pipe()
    schema = pipe.Valves.model_json_schema()["properties"]
    for valve in ("base_models", "max_files_per_user", "purge", "network", "timeout_seconds"):
        assert schema[valve]["description"]
    assert pipe.valves.network is False
    assert module.Pipe.UserValves().show_code is True
