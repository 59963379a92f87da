"""Write the sandbox environment's manifest.json (run by sandbox/build with the environment's own
python3, chrooted into it): what the runner, the doctor and the system prompt say is there.

Environment: REQUESTED (the packages asked for by name: requirements.txt and the admin's extra file),
PROMPT (those of them the system prompt names), TOOLS (command-line tools to look for), KEY (the
build's key).
"""

import importlib.metadata as md
import json
import os
import platform
import shutil
import sys


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def import_names(dist: md.Distribution) -> list[str]:
    """The top-level modules a distribution installs (python-docx: docx), from its RECORD."""
    names = set()
    for path in dist.files or ():
        top = path.parts[0] if path.parts else ""
        if top.endswith((".dist-info", ".data")) or top.startswith(("_", ".")) or top == "..":
            continue
        name = top[:-3] if top.endswith(".py") else top if "." not in top else ""
        if name.isidentifier():
            names.add(name)
    return sorted(names)


wanted = [norm(n) for n in os.environ["REQUESTED"].split() if n.strip()]
named = {norm(n) for n in os.environ.get("PROMPT", "").split()}
dists = {norm(d.metadata["Name"]): d for d in md.distributions()}
packages = []
for name in wanted:
    dist = dists.get(name)
    if dist is not None:
        name, version = dist.metadata["Name"], dist.version
        entry = {"name": name, "version": version, "imports": import_names(dist)}
        packages.append({**entry, "prompt": norm(name) in named})
with open("/etc/os-release", encoding="utf-8") as f:
    os_release = dict(line.split("=", 1) for line in f.read().splitlines() if "=" in line)
json.dump(
    {
        "key": os.environ["KEY"],
        "os": os_release.get("PRETTY_NAME", "").strip('"'),
        "python": platform.python_version(),
        "packages": packages,
        "all_packages": sorted([d.metadata["Name"], d.version] for d in dists.values()),
        "tools": [t for t in os.environ["TOOLS"].split() if shutil.which(t)],
    },
    sys.stdout,
    indent=1,
)
