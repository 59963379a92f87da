"""The single file an admin installs: current, loadable the way Open WebUI loads it, self-contained."""

import subprocess
import sys
from pathlib import Path

import pytest

from runner._kernel_program import program
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
        "import importlib\n"
        "kernel = importlib.import_module(m._CS_PACKAGE + '.runner._kernel')\n"
        "open('kernel.py', 'w').write(kernel.KERNEL_SOURCE)\n"
        "import storage\n"
    )
    python = OWUI_VENV / "bin" / "python"
    assert python.exists(), f"{python} is missing: run ./scripts/setup"
    result = subprocess.run([str(python), "-I", str(script)], cwd=tmp_path, capture_output=True, text=True)
    assert "['a', 'b.c']" in result.stdout, result.stderr
    # The embedded packages live under a private name; the plain name is not importable here.
    assert "No module named 'storage'" in result.stderr
    # The kernel program, joined from the embedded modules, is the one the repository's modules give.
    assert (tmp_path / "kernel.py").read_text() == program()


def test_loaded_like_open_webui_the_pipe_has_its_valves():
    module = load_like_open_webui(BUNDLE.read_text())
    pipe = module.Pipe()
    schema = pipe.Valves.model_json_schema()["properties"]
    for valve in ("base_models", "max_files_per_user", "purge", "network", "timeout_seconds"):
        assert schema[valve]["description"]
    assert pipe.valves.network is False
    assert module.Pipe.UserValves().show_code is True


TOOL = REPO / "dist" / "code_sessions_tool.py"
FILTER = REPO / "dist" / "code_sessions_filter.py"
ACTIONS = REPO / "dist" / "code_sessions_actions.py"


@pytest.mark.parametrize(
    ("bundle", "title"),
    [(TOOL, "Code Sessions Tool"), (FILTER, "Code Sessions Filter"), (ACTIONS, "Code Sessions Actions")],
    ids=["tool", "filter", "actions"],
)
def test_the_tool_and_the_filter_have_their_frontmatter_and_nothing_the_loader_rewrites(bundle, title):
    text = bundle.read_text()
    lines = text.splitlines()
    assert lines[0] == '"""'
    header = dict(line.split(":", 1) for line in lines[1 : lines.index('"""', 1)])
    assert header["title"].strip() == title
    assert header["requirements"].strip() == ""
    for needle in ("from utils", "from apps", "from main", "from config"):
        assert needle not in text, needle


def test_each_file_loads_alone_in_open_webuis_python(tmp_path):
    # Each in a process of its own, outside the repository: one file is all an admin installs.
    python = OWUI_VENV / "bin" / "python"
    assert python.exists(), f"{python} is missing: run ./scripts/setup"
    checks = {
        TOOL: "t = m.Tools(); print(sorted(n for n in dir(t) if not n.startswith('_')"
        " and callable(getattr(t, n)) and not isinstance(getattr(t, n), type)), t.valves.kernel)",
        FILTER: "f = m.Filter(); print(f.valves.tool_id, *(callable(getattr(f, n)) for n in "
        "('inlet', 'stream', 'outlet')))",
        # Open WebUI picks the class Pipe, Filter, Action in that order: the Action file has only Action.
        ACTIONS: "a = m.Action(); print(hasattr(m, 'Pipe') or hasattr(m, 'Filter'), a.valves.pipe_id,"
        " a.valves.tool_id, [b['id'] for b in a.actions], all(b['icon_url'].startswith('data:image/svg')"
        " for b in a.actions))",
    }
    outputs = {}
    for bundle, check in checks.items():
        script = tmp_path / f"load_{bundle.stem}.py"
        script.write_text(
            "import types\n"
            f"content = open({str(bundle)!r}).read()\n"
            "m = types.ModuleType('x'); exec(content, m.__dict__)\n" + check + "\n"
        )
        command = [str(python), "-I", str(script)]
        result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        outputs[bundle] = result.stdout.strip()
    # Open WebUI offers every public method to the model.
    assert outputs[TOOL] == "['run_code', 'upload_link'] persistent"
    assert outputs[FILTER] == "code_sessions_tool True True True"
    assert outputs[ACTIONS] == (
        "False code_sessions code_sessions_tool ['notebook', 'files', 'zip', 'knowledge'] True"
    )


def test_the_four_files_of_one_version_share_their_embedded_packages():
    packages = {load_like_open_webui(b.read_text())._CS_PACKAGE for b in (BUNDLE, TOOL, FILTER, ACTIONS)}
    assert len(packages) == 1, packages
