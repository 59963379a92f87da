"""The benchmarks' short mode runs end to end with zero errors (never a timing assertion).

`python -m bench --quick` exercises every section at tiny sizes with the real runsc: run overhead,
index scale, concurrency, link rewriting, memory, saved kernels, idle kernels and a host filled with
saved chats and live kernels (20 and 3 here, 1,000 and 50 in the full run). It fails on errors only: a
run that did not print what it should, a wrong reconcile, a resumed chat without its state, an
exception.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.runsc

REPO = Path(__file__).resolve().parents[2]
SECTIONS = (
    "run_overhead",
    "index_scale",
    "concurrency",
    "rewrite",
    "memory",
    "hibernate",
    "idle_kernels",
    "capacity",
)


def test_quick_mode_completes_without_errors(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--json", str(out), "--dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"
    )
    results = json.loads(out.read_text())
    assert results["errors"] == []
    assert results["meta"]["mode"] == "quick"
    sections = results["sections"]
    assert set(SECTIONS) <= set(sections)

    overhead = sections["run_overhead"]["scenarios"]
    assert set(overhead) == {"empty", "100 files"}
    for scenario in overhead.values():
        assert scenario["bare_runsc"]["n"] == scenario["full_path"]["n"] == scenario["pairs"] > 0
        assert scenario["ratio_of_medians"] > 0

    index = sections["index_scale"]
    assert index["quota_check"]["n"] > 0
    disk = index["filesystems"]["disk"]
    assert set(disk["reconcile"]) == set(disk["cleanup"]) == {"100", "1000"}
    assert disk["usage"]["cli_usage"]["n"] > 0

    concurrency = sections["concurrency"]
    assert concurrency["errors"] == 0 and concurrency["throughput_ratio"] > 0

    rewrite = sections["rewrite"]
    assert rewrite["text"]["n"] > 0 and rewrite["chat_session_rewrite"]["later_calls_reuse_links"]["n"] > 0

    memory = sections["memory"]
    assert {"run_printing", "reconcile_first", "reconcile_one_change"} <= set(memory)
    assert memory["run_printing"]["outcome"] == "output_limit"  # the runner stopped the flood at its cap

    saved = sections["hibernate"]["save_resume"]
    for case in ("plain", "idle data kernel"):  # compressed, and each saved both ways
        assert saved[case]["zstd"]["image_mib"] < saved[case]["none"]["image_mib"] / 2, saved[case]

    idle = sections["idle_kernels"]
    assert set(idle["warm_step"]) == {"kernel systrap", "kernel ptrace", "bare systrap", "bare ptrace"}
    assert set(idle["idle"]) >= {"systrap", "ptrace", "fifty_idle_share_of_core"}

    capacity = sections["capacity"]  # the fill at a small size: every sampled resume gave its state back
    assert capacity["disk"]["saved_chats"] == 20 and capacity["resume"]["sampled"] == 4
    assert capacity["memory"]["live"] == 3 and capacity["idle_cpu"]["live"] == 3
    assert capacity["host"]["live_data_kernels"] > 0 and capacity["host"]["saved_chats_per_100_gib"] > 0

    assert {t["target"] for t in results["targets"]}  # the targets table is there, met or not
    assert "== Targets ==" in done.stdout and "errors: 0" in done.stdout
