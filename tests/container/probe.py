"""What the runner can still do inside a container started with a given set of flags.

Run INSIDE the container with the image's Python and the image's copy of the runner package:

    PYTHONPATH=/opt/code-sessions python3 /tmp/probe.py [--runsc-flag=--rootless] [--checks=write,memory]

Prints one JSON object: per check its outcome and reason, plus what the host side (the container) saw:
the owner of a file the sandbox wrote, the interpreters' data stack, zombie processes left behind.
Standard library + the runner only: it must run on the image as built.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from runner import Limits, Runner, RunnerConfig

# A sample of the sandbox environment's packages (sandbox/requirements.txt)
STACK = "numpy, pandas, matplotlib, openpyxl, PIL, scipy, docx, pptx, polars, duckdb, pyarrow, sklearn, cv2"
STACK_CODE = f"""import sys
missing = []
for name in "{STACK}".split(", "):
    try:
        __import__(name)
    except Exception as exc:
        missing.append(f"{{name}} ({{type(exc).__name__}})")
print(sys.executable, "missing:", ", ".join(missing) or "none")
"""
MPL_CODE = """import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
plt.plot([1, 3, 2]); plt.savefig("/mnt/data/mpl.png")
print("saved")
"""


def zombies() -> list[str]:
    """Zombie processes in this PID namespace (what PID 1 failed to reap)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        if rest.startswith("Z"):
            found.append(f"{pid}:{name}")
    return found


async def probe(flags: tuple[str, ...], only: list[str]) -> dict:
    runner = Runner(RunnerConfig(extra_runsc_flags=flags))
    base = Path(tempfile.mkdtemp(prefix="probe-"))
    report: dict = {"flags": list(flags)}

    async def run(name: str, code: str, language: str = "python", **limits) -> dict:
        workdir = base / name
        workdir.mkdir()
        start = time.monotonic()
        res = await runner.run(code, language, workdir, Limits(**{"timeout_s": 20, **limits}))
        entry = {
            "outcome": str(res.outcome),
            "reason": res.reason,
            "stdout": res.stdout[-300:],
            "stderr": res.stderr[-300:],
            "seconds": round(time.monotonic() - start, 2),
        }
        report[name] = entry
        return entry

    checks = {
        "write": lambda: run("write", "open('/mnt/data/probe.txt', 'w').write('x'); print('written')"),
        # A cold import of the whole sample takes a while in a fresh sandbox on a busy machine.
        "stack_default_python": lambda: run("stack_default_python", STACK_CODE, timeout_s=120),
        "stack_usr_bin_python3": lambda: run(
            "stack_usr_bin_python3", f"/usr/bin/python3 - <<'EOF'\n{STACK_CODE}EOF\n", "bash", timeout_s=120
        ),
        "matplotlib": lambda: run("matplotlib", MPL_CODE),
        "shell": lambda: run("shell", "ls -la /mnt/data && stat /mnt/data >/dev/null && jq -n 1", "bash"),
        "memory": lambda: run(
            "memory", "x = bytearray(400 * 2**20)\nfor i in range(0, len(x), 4096): x[i] = 1\n", memory_mb=128
        ),
        "timeout": lambda: run("timeout", "while True: pass", timeout_s=2),
        "unlinked_flood": lambda: run(
            "unlinked_flood",
            "import os, time\nf = open('/mnt/data/h', 'wb'); os.unlink('/mnt/data/h')\n"
            "for _ in range(64): f.write(b'x' * 2**20)\nf.flush(); time.sleep(10)\n",
            max_write_bytes=32 * 2**20,
        ),
        "fork_bomb": lambda: run(
            "fork_bomb", ":(){ :|:& };:\nsleep 60", "bash", timeout_s=3, max_processes=16
        ),
    }
    for name in only or checks:
        await checks[name]()
    written = base / "write" / "probe.txt"
    if "write" in report:
        report["write"]["host_owner"] = os.stat(written).st_uid if written.exists() else None
    await asyncio.sleep(1)
    report["zombies"] = zombies()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runsc-flag", action="append", default=[], help="passed to runsc, e.g. --rootless")
    parser.add_argument("--checks", default="", help="comma-separated subset of the checks")
    args = parser.parse_args()
    only = [c for c in args.checks.split(",") if c]
    print(json.dumps(asyncio.run(probe(tuple(args.runsc_flag), only))))


if __name__ == "__main__":
    main()
