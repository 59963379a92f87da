"""The sandbox environment (runner/environment.py, sandbox/build): the sandbox runs on a root of its own,
never the host's /usr, and a missing or damaged environment is a clear error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from runner import Limits, Runner, RunnerConfig, environment
from runner.errors import RunnerError

from .conftest import RUNSC

pytestmark = pytest.mark.runsc


def built() -> environment.SandboxEnvironment:
    env = environment.locate()
    if not env.built:
        pytest.fail("no sandbox environment: scripts/setup builds it (sandbox/build)")
    return env


async def test_the_sandbox_sees_the_environment_and_nothing_of_the_hosts_usr(
    runner: Runner, workdir: Path
) -> None:
    env = built()
    marker = Path("/usr/local/share/code-sessions-host-marker")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("host only\n")
    try:
        code = (
            "import os, platform, sys\n"
            f"print('marker', os.path.exists({str(marker)!r}))\n"
            "print('python', platform.python_version())\n"
            "print('os', platform.freedesktop_os_release()['VERSION_CODENAME'])\n"
            "import pandas; print('pandas', pandas.__version__)\n"
        )
        res = await runner.run(code, "python", workdir, Limits(timeout_s=60))
    finally:
        marker.unlink()
    assert res.ok, res
    assert "marker False" in res.stdout
    assert f"python {env.python}" in res.stdout and env.python != sys.version.split()[0]
    assert "os trixie" in res.stdout
    assert dict(p for p in await runner.packages())["pandas"] in res.stdout


async def test_ls_and_stat_work_in_bash(runner: Runner, workdir: Path) -> None:
    (workdir / "data.csv").write_text("a,b\n")
    res = await runner.run("ls -la /mnt/data && stat -c '%n %s' /mnt/data/data.csv", "bash", workdir)
    assert res.ok, res
    assert "data.csv" in res.stdout and "/mnt/data/data.csv 4" in res.stdout
    assert "Invalid argument" not in res.stderr
    assert await runner.known_issues() == ()


def test_an_environment_folder_named_but_empty_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(environment.EnvironmentNotFound, match="no sandbox environment in"):
        environment.locate(tmp_path)


@pytest.mark.parametrize(
    "manifest",
    [
        "{not json",
        json.dumps({"packages": []}),  # no key
        json.dumps({"key": "k", "packages": [{"name": "evil\nname", "version": "1"}]}),
        json.dumps({"key": "k", "packages": "numpy"}),
    ],
)
def test_a_damaged_manifest_is_an_error_not_a_guess(tmp_path: Path, manifest: str) -> None:
    build = tmp_path / "env-x"
    (build / "rootfs" / "usr" / "bin").mkdir(parents=True)
    (build / "manifest.json").write_text(manifest)
    with pytest.raises(environment.EnvironmentNotFound, match="damaged"):
        environment.locate(build)


def test_without_any_build_the_host_is_the_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(environment.HOME_VARIABLE, raising=False)
    monkeypatch.setattr(environment, "DEFAULT_HOME", tmp_path / "nothing-here")
    assert environment.locate() is environment.HOST


async def test_a_runner_on_a_missing_environment_refuses_with_the_fix(tmp_path: Path) -> None:
    config = RunnerConfig(
        runsc_path=RUNSC,
        state_dir=tmp_path / "state",
        bundle_dir=tmp_path / "bundles",
        environment=tmp_path / "absent",
    )
    with pytest.raises(RunnerError, match="sandbox/build"):
        await Runner(config).run("print(1)", "python", tmp_path)


def test_packages_are_named_by_what_to_import() -> None:
    assert environment.Package("python-docx", "1.2.0", ("docx",)).label == "docx (python-docx)"
    assert environment.Package("numpy", "2.4.6", ("numpy",)).label == "numpy"
    assert environment.Package("duckdb", "2", ("adbc_driver_duckdb", "duckdb")).label == "duckdb"
    assert environment.Package("PyYAML", "6", ("yaml",)).label == "yaml (PyYAML)"


def test_the_manifest_says_which_packages_the_prompt_names(tmp_path: Path) -> None:
    """requirements.txt's "prompt" mark reaches the manifest; an older manifest without it names all."""
    build = tmp_path / "env-x"
    (build / "rootfs" / "usr" / "bin").mkdir(parents=True)
    packages = [
        {"name": "pandas", "version": "2.3.3", "imports": ["pandas"], "prompt": True},
        {"name": "toolz", "version": "1.2.0", "imports": ["tlz", "toolz"], "prompt": False},
        {"name": "old", "version": "1", "imports": ["old"]},
    ]
    manifest = {"key": "k", "python": "3.13.5", "packages": packages, "all_packages": [["a", "1"]] * 7}
    (build / "manifest.json").write_text(json.dumps(manifest))
    env = environment.locate(build)
    assert [p.named for p in env.packages] == [True, False, True]
    assert env.distributions == 7 and "(7 distributions in all)" in env.describe()
