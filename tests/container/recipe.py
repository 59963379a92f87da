"""The container recipe as the README states it, and podman to run it with.

The README's `docker run` line is the source: the tests take its flags from there, so what they prove is
what a reader copies. Podman runs them here (there is no Docker engine on the test machines); the few
flags this machine's podman needs on top are PODMAN_EXTRA, and docs/runner.md says which those are.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
COMPOSE = REPO / "deploy" / "docker-compose.yml"

IMAGE = os.environ.get("CODE_SESSIONS_CONTAINER_IMAGE", "")
# Every container and volume a test run makes carries this label; scripts/test-container removes
# whatever still has it when it exits, also after a failure or Ctrl-C.
RUN_ID = os.environ.get("CODE_SESSIONS_CONTAINER_RUN_ID", f"pytest-{os.getpid()}")
LABEL = f"code-sessions-test={RUN_ID}"
OUT = Path(os.environ.get("CODE_SESSIONS_CONTAINER_OUT", "/tmp/code-sessions-container"))


def _podman_extra() -> list[str]:
    """What this machine's podman needs besides the recipe (none of it is about gVisor).

    * crun, podman's default runtime, fails here ("cgroups in hybrid mode not supported"); runc works.
    * podman's default rlimits exceed this host's hard limits, and the host has no CAP_SYS_RESOURCE to
      raise them ("setrlimit: Operation not permitted"). Docker inherits its daemon's limits instead.
      The nofile hard limit must stay high: at 1024 gVisor's sentry runs out of host descriptors and
      `import pandas` fails in the sandbox with EMFILE (measured; docs/runner.md).
    """
    nofile_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return [
        "--runtime", "runc",
        "--ulimit", f"nofile=1024:{nofile_hard}",
        "--ulimit", "nproc=4096:4096",
    ]  # fmt: skip


PODMAN_EXTRA = _podman_extra()


def readme_command() -> list[str]:
    """The README's `docker run ...` command, as tokens."""
    text = README.read_text()
    match = re.search(r"^[ \t]*(docker run -d .*?)(?<!\\)\n", text, re.M | re.S)
    assert match, "README.md has no `docker run -d ...` line"
    return shlex.split(match.group(1).replace("\\\n", " "))


@dataclass
class Recipe:
    """The README's command split into what is about deployment and what gVisor needs."""

    name: str
    port: str
    volume: str
    image: str
    flags: list[str] = field(default_factory=list)  # the gVisor flags, as written


def readme_recipe() -> Recipe:
    tokens = readme_command()
    assert tokens[:3] == ["docker", "run", "-d"], tokens
    rest, image = tokens[3:-1], tokens[-1]
    recipe = Recipe(name="", port="", volume="", image=image)
    i = 0
    while i < len(rest):
        token = rest[i]
        value = rest[i + 1] if i + 1 < len(rest) else ""
        if token == "--name":
            recipe.name, i = value, i + 2
        elif token == "-p":
            recipe.port, i = value, i + 2
        elif token == "-v" and value.endswith(":/app/backend/data"):
            recipe.volume, i = value, i + 2
        elif token in ("-v", "--security-opt", "--cap-add", "--ulimit", "--device"):
            recipe.flags += [token, value]
            i += 2
        else:
            recipe.flags.append(token)
            i += 1
    return recipe


def flag_groups(flags: list[str]) -> list[list[str]]:
    """The flags as units: ["--cap-add", "SYS_ADMIN"] is one, "--init" is one."""
    groups: list[list[str]] = []
    i = 0
    while i < len(flags):
        if flags[i] in ("-v", "--security-opt", "--cap-add", "--ulimit", "--device"):
            groups.append(flags[i : i + 2])
            i += 2
        else:
            groups.append([flags[i]])
            i += 1
    return groups


def without(flags: list[str], group: list[str]) -> list[str]:
    return [token for g in flag_groups(flags) if g != group for token in g]


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        command = shlex.join(args)
        raise AssertionError(f"podman {command} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


def unique(prefix: str) -> str:
    return f"{prefix}-{RUN_ID}-{time.monotonic_ns() % 10**9}"


def remove_container(name: str) -> None:
    podman("rm", "--force", "--time", "5", name, check=False, timeout=120)
