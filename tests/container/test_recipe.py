"""The recipe is written in three places; they must agree. No container needed (runs in ./scripts/test)."""

from __future__ import annotations

import re

from .recipe import COMPOSE, REPO, flag_groups, readme_recipe

KUBERNETES = REPO / "deploy" / "kubernetes.yaml"


def _yaml_list(text: str, key: str) -> list[str]:
    """Items of the block list `key:` in the compose file, comments dropped (no YAML parser needed)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"{key}:")
    indent = len(lines[start]) - len(lines[start].lstrip())
    items = []
    for line in lines[start + 1 :]:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= indent or not stripped.startswith("-"):
            break
        items.append(re.sub(r"\s+#.*", "", stripped[1:].strip()).strip("\"'"))
    return items


def compose_flags() -> set[str]:
    text = COMPOSE.read_text()
    flags = {f"--cap-add {cap}" for cap in _yaml_list(text, "cap_add")}
    flags |= {f"--security-opt {opt}" for opt in _yaml_list(text, "security_opt")}
    flags |= {f"-v {v}" for v in _yaml_list(text, "volumes") if not v.startswith("open-webui:")}
    if re.search(r"^\s*init: true", text, re.M):
        flags.add("--init")
    if re.search(r"^\s*cgroup: host", text, re.M):
        flags.add("--cgroupns=host")
    if re.search(r"^\s*privileged: true", text, re.M):
        flags.add("--privileged")
    return flags


def test_the_readme_and_docker_compose_have_the_same_flags() -> None:
    readme = {" ".join(group) for group in flag_groups(readme_recipe().flags)}
    assert readme == compose_flags()


def test_kubernetes_adds_the_same_capabilities_and_mounts_the_cgroups() -> None:
    text = KUBERNETES.read_text()
    caps = {g[1] for g in flag_groups(readme_recipe().flags) if g[0] == "--cap-add"}
    added = re.search(r"^\s*add: \[(.*)\]", text, re.M)
    assert added and {c.strip() for c in added.group(1).split(",")} == caps
    assert "type: Unconfined" in text and "path: /sys/fs/cgroup" in text
    assert "shareProcessNamespace: true" in text  # what --init does
