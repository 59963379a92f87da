"""Turn the results dict into the printed tables and the list of targets met or missed."""

from __future__ import annotations

import itertools
from typing import Any

from . import (
    branches,
    capacity,
    environment,
    exports,
    filter_stream,
    hibernate,
    idle,
    index_backends,
    previews,
    uploads,
)
from ._tables import ms, num, ratio, table, thousands
from .index_backends import TARGET_STEP_RATIO

# ---------------------------------------------------------------------------- sections


def _overhead(r: dict[str, Any]) -> str:
    scenarios = r.get("scenarios", {})
    if not scenarios:
        return "(no data)"
    rows = []
    for name, s in scenarios.items():
        target = s.get("target_ratio")
        rows.append(
            [
                name,
                ms(s["bare_runsc"]),
                ms(s["full_path"]),
                num(s["overhead_ms"]),
                f"{s['ratio_of_medians']:.3f}",
                ratio(s["pair_ratio"]),
                f"<= {target}" if target else "-",
            ]
        )
    first = next(iter(scenarios.values()))
    out = [
        f"print(1), {first['pairs']} interleaved pairs per session; ms: median (p25-p75)",
        table(
            ["session", "a: bare runsc", "b: full path", "b-a ms", "b/a", "per-pair b/a", "target"],
            rows,
            right=(3, 4),
        ),
        "",
        "where the full path's time goes (median ms):",
    ]
    phase_names = list(first.get("phases", {}))
    out.append(
        table(
            ["phase", *scenarios],
            [[p, *(ms(s["phases"].get(p), spread=False) for s in scenarios.values())] for p in phase_names],
            right=tuple(range(1, len(scenarios) + 1)),
        )
    )
    spawn = r.get("spawn")
    if spawn:
        rows = [
            [
                f"+{spawn['ballast_mib']} MiB" if label != "as is" else label,
                ms(v["setpriv"]),
                ms(v["preexec_fn"]),
            ]
            for label, v in spawn.items()
            if label != "ballast_mib"
        ]
        out += [
            "",
            "starting a process that dies with us (runsc's way), event-loop time, ms: median (p25-p75)",
            table(["our process", "setpriv (vfork)", "preexec_fn (fork)"], rows),
        ]
    return "\n".join(out)


def _growth(values: list[float | None]) -> list[str]:
    out = []
    for a, b in itertools.pairwise(values):
        out.append(f"x{b / a:.1f}" if a and b else "-")
    return out


def _index(r: dict[str, Any]) -> str:
    out: list[str] = []
    q = r.get("quota_check")
    if q:
        out.append(
            f"quota check, user with {q['user_sessions']} sessions among {q['session_rows']:,} session rows: "
            f"{ms(q)} ms (target <= {q['target_ms']:g} ms)"
        )
    for label, fs in r.get("filesystems", {}).items():
        rec = fs.get("reconcile", {})
        sizes = sorted(int(k) for k in rec)
        if not sizes:
            out.append(f"[{label}] no data")
            continue
        clean = fs.get("cleanup", {})
        steps = [f"{thousands(a)}->{thousands(b)}" for a, b in itertools.pairwise(sizes)]
        headers = ["", *(thousands(s) + " files" for s in sizes), *steps, f"us/file @{thousands(sizes[-1])}"]

        def row(
            name: str, pick: Any, source: dict[str, Any], spread: bool = True, sizes: list[int] = sizes
        ) -> list[str]:
            stats = [pick(source.get(str(s))) for s in sizes]
            medians = [st["median_ms"] if st else None for st in stats]
            last = medians[-1]
            per_file = f"{last * 1000 / sizes[-1]:.2f}" if last is not None else "-"
            return [name, *(ms(st, spread) for st in stats), *_growth(medians), per_file]

        rows = [
            row("reconcile after a run, one change", lambda x: x and x.get("one_change_hint"), rec),
            row("full listing, one changed file", lambda x: x and x["one_change"], rec),
            row("full listing, nothing changed", lambda x: x and x["no_change"], rec),
            row("bare scandir+lstat walk", lambda x: x and x["bare_walk"], rec),
            row("first reconcile (index all)", lambda x: x and x["first_reconcile"], rec, False),
            row("cleanup of expired files (the caller waits)", lambda x: x and x["cleanup"], clean, False),
            row(
                "  then the trash emptied (background)",
                lambda x: x and x.get("background_unlink"),
                clean,
                False,
            ),
            row("bare rename, one per folder", lambda x: x and x.get("bare_rename"), clean, False),
            row("bare unlink loop", lambda x: x and x["bare_unlink"], clean, False),
        ]
        ratio_row = ["full listing / bare walk (per pair)"]
        ratio_row += [ratio(rec.get(str(s), {}).get("one_change_over_walk")) for s in sizes]
        cleanup_ratio = ["cleanup / bare unlink"]
        cleanup_ratio += [
            f"{clean[str(s)]['cleanup_over_unlink']:.2f}" if str(s) in clean else "-" for s in sizes
        ]
        background_ratio = ["trash emptied / bare unlink"]
        background_ratio += [
            f"{clean[str(s)]['background_over_unlink']:.2f}"
            if clean.get(str(s), {}).get("background_over_unlink") is not None
            else "-"
            for s in sizes
        ]
        rows += [ratio_row, cleanup_ratio, background_ratio]
        out.append("")
        out.append(f"[{label}: {fs.get('filesystem', '?')}] ms: median (p25-p75); growth = ratio of medians")
        out.append(table(headers, rows, right=tuple(range(1, len(headers)))))
        usage = fs.get("usage")
        if usage:
            out.append(
                f"CLI `python -m storage usage` on a {usage['files']:,}-file index: "
                f"{ms(usage['cli_usage'])} ms "
                f"(of which starting Python and importing storage: {ms(usage['python_import_only'])} ms)"
            )
    return "\n".join(out)


def _concurrency(r: dict[str, Any]) -> str:
    if "chats" not in r:
        return "(no data)"
    rows = [
        [
            "one at a time",
            ms(r["sequential_wall"]),
            f"{r['sequential_steps_per_s']:.2f}",
            ms(r["step_latency_sequential"]),
        ],
        [
            f"{r['chats']} at once",
            ms(r["concurrent_wall"]),
            f"{r['concurrent_steps_per_s']:.2f}",
            ms(r["step_latency_concurrent"]),
        ],
    ]
    return "\n".join(
        [
            f"{r['chats']} chats, each: write a file, print, link it; {r['rounds']} rounds of each mode",
            table(["mode", f"wall for {r['chats']} steps ms", "steps/s", "one step ms"], rows, right=(2,)),
            f"throughput, {r['chats']} at once vs one at a time: x{r['throughput_ratio']:.2f}; "
            f"errors: {r['errors']}",
        ]
    )


def _over_floor(got: dict[str, Any], floor: dict[str, Any] | None) -> str:
    return f"{got['median_ms'] / floor['median_ms']:.2f}x" if floor and floor.get("median_ms") else ""


def _rewrite(r: dict[str, Any]) -> str:
    if "text" not in r:
        return "(no data)"
    full = r.get("chat_session_rewrite", {})
    rows = [
        ["scan + paths + rewrite (targets known)", ms(r["text"]), f"<= {r['target_ms']:g}"],
        ["  of which scan + paths", ms(r["text_find_paths"]), ""],
        ["  of which rewrite", ms(r["text_substitute"]), ""],
        ["StreamingRewriter, 40-char chunks", ms(r["streaming_40_char_chunks"]), ""],
        ["ChatSession.rewrite, first (publishes all)", ms(full.get("first_call_publishes")), ""],
        ["ChatSession.rewrite, again (links reused)", ms(full.get("later_calls_reuse_links")), ""],
    ]
    head = f"an answer of {r['answer_bytes'] / 1000:.0f} KB naming {r['paths']} files"
    text = head + "\n" + table(["", "ms", "target"], rows, right=(1,))
    p = r.get("pathological")
    if p:
        long_rows = []
        for name, case in p["cases"].items():
            streamed = case[f"streamed_{p['piece_chars']}_char_pieces"]
            target = f"<= {p['target_ms']:g}"
            floor = case.get("substitution_floor")
            whole = _over_floor(case["plain"], floor)
            long_rows.append([f"{name!r}: whole", ms(case["plain"]), whole, target])
            long_rows.append(
                [
                    f"{name!r}: streamed, {p['piece_chars']}-char pieces",
                    ms(streamed),
                    _over_floor(streamed, p["push_floor"]),
                    target,
                ]
            )
            if floor:
                long_rows.append(["  floor: one re.sub, same output size", ms(floor), "", ""])
            if "first_out_after_chars" in case:
                long_rows.append(
                    [
                        "  first text out after / most held (characters)",
                        f"{case['first_out_after_chars']:,} / {case['most_held_chars']:,}",
                        "",
                        "",
                    ]
                )
        long_rows.append([f"floor: {p['pieces']:,} calls of a no-op push", ms(p["push_floor"]), "", ""])
        head = f"one line of {p['bytes'] / 1e6:g} MB (ratios: whole / re.sub, streamed / no-op push)"
        text += f"\n\n{head}\n" + table(["", "ms", "ratio", "target"], long_rows, right=(1, 2))
    return text


def _memory(r: dict[str, Any]) -> str:
    rows = []
    labels = {
        "run_printing": "a run printing {printed_mb} MB ({outcome})",
        "reconcile_first": "first reconcile of {files:,} files",
        "reconcile_one_change": "reconcile, one change in {files:,} files",
    }
    for key, label in labels.items():
        m = r.get(key)
        if m:
            rows.append([label.format(**m), m["rss_before_mib"], m["peak_mib"], m["growth_mib"]])
    if not rows:
        return "(no data)"
    return "host process, each in a fresh process\n" + table(
        ["scenario", "RSS before MiB", "peak MiB", "growth MiB"], rows, right=(1, 2, 3)
    )


def _kernel(r: dict[str, Any]) -> str:
    parts = []
    w = r.get("warm_step")
    if w:
        labels = {
            "warm_full_path": "(a) warm step, whole path, live kernel",
            "cold_full_path": "(b) cold step, whole path, fresh sandbox",
            "bare_kernel_round_trip": "(c) bare round trip into the same kernel",
            "floor_echo_in_runsc": "floor: echo of a bare python in one runsc run",
            "floor_print_in_runsc": "floor: print(1) cell of that bare python",
            "jupyter_execute": "peer: a Jupyter kernel's execute (no sandbox)",
        }
        rows = [[label, w[key]["median_ms"], w[key]["p75_ms"]] for key, label in labels.items() if w.get(key)]
        parts.append(table(["print(1)", "median ms", "p75 ms"], rows, right=(1, 2)))
        parts.append(f"a/b = {w['warm_vs_cold']:.3g}x, a/c = {w['warm_vs_bare_kernel']:.3g}x")
        floor = w.get("floor_print_in_runsc")
        if floor:
            line = (
                f"c / bare print(1): {w['bare_kernel_round_trip']['median_ms'] / floor['median_ms']:.3g}x "
                f"(per pair {w['pair_ratio_kernel_vs_bare_print']['median']:.3g}x)"
            )
            jup = w.get("jupyter_execute")
            if jup:
                line += (
                    f"; beside the Jupyter kernel, a {w['warm_beside_jupyter']['median_ms']:.3g} ms: "
                    f"{w['warm_beside_jupyter']['median_ms'] / jup['median_ms']:.3g}x its execute "
                    f"(per pair {w['pair_ratio_warm_vs_jupyter']['median']:.3g}x)"
                )
            parts.append(line)
    f = r.get("first_step")
    if f:
        rows = [
            ["a chat's first step (starts its kernel)", f["first_step_full_path"]["median_ms"]],
            ["bare runsc run of print(1)", f["bare_runsc_run"]["median_ms"]],
        ]
        parts.append(table(["", "median ms"], rows, right=(1,)))
        parts.append(f"ratio {f['first_vs_bare']:.3g}x")
    m = r.get("memory")
    if m:
        spread = m["idle_kernel_mib"]
        parts.append(
            f"idle kernel, RSS of its host processes: {spread['median']} MiB (min {spread['min']}, max "
            f"{spread['max']}); {m['idle_kernels']} idle kernels: {m['idle_kernels_total_mib']} MiB; our "
            f"process grew by {m['our_process_growth_mib']} MiB for them"
        )
    c = r.get("cpu_watch")
    if c:
        parts.append(
            f"CPU watcher: one look at {c['kernels']} idle kernels {c['look_at_all_ms']} ms of our CPU, "
            f"{c['watcher_cpu_share_of_core']:.3%} of a core each second; the idle kernels themselves use "
            f"{c['idle_kernels_cpu_share_of_core']:.1%} (ratio {c['watcher_vs_idle_kernels']})"
        )
    k = r.get("kernel_start")
    if k:
        packages = ", ".join(f"{n} {v}" for n, v in (k.get("packages") or {}).items() if v) or "none"
        started = k["start_and_first_run"]["median_ms"]
        parts.append(f"kernel start + first run: {started} ms; the kernel can import: {packages}")
    return "\n".join(parts) or "(no data)"


def _deleted_chats(r: dict[str, Any]) -> str:
    rows = [
        ["list our sessions", r["list_sessions"]["median_ms"]],
        ["which chats still exist (batched IN queries)", r["which_chats_exist"]["median_ms"]],
        ["mark missing, pick the twice missed", r["mark_missing"]["median_ms"]],
        ["one tick in all", r["tick"]["median_ms"]],
    ]
    head = f"{r['sessions']:,} saved-chat sessions, {r['deleted']} of their chats deleted"
    return head + "\n" + table(["", "median ms"], rows, right=(1,))


# ---------------------------------------------------------------------------- targets


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of issue #6 with the measured value; met is None when not measured (quick mode)."""
    s = results.get("sections", {})
    found: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, unit: str) -> None:
        met = None if value is None else value <= limit
        found.append({"target": name, "value": value, "limit": limit, "unit": unit, "met": met})

    scen = s.get("run_overhead", {}).get("scenarios", {})
    add("run overhead b/a, empty session", scen.get("empty", {}).get("ratio_of_medians"), 1.15, "x")
    add("run overhead b/a, 10k-file session", scen.get("10k files", {}).get("ratio_of_medians"), 1.25, "x")
    heavy = s.get("run_overhead", {}).get("spawn", {}).get("holding ballast")
    add("spawn of runsc, 1 GiB process (event loop)", heavy and heavy["setpriv"]["median_ms"], 5.0, "ms")
    disk = s.get("index_scale", {}).get("filesystems", {}).get("disk", {})
    for size, limit in (("10000", 50.0), ("100000", 500.0)):
        # As a step does it: the runner names the changed path (see the full-listing rows too).
        stats = disk.get("reconcile", {}).get(size, {}).get("one_change_hint")
        add(
            f"reconcile, one change in {thousands(int(size))} files (disk)",
            stats and stats["median_ms"],
            limit,
            "ms",
        )
    tmpfs = s.get("index_scale", {}).get("filesystems", {}).get("tmpfs", {})
    for size, limit in (("10000", 50.0), ("100000", 500.0)):
        # As a step does it: the runner names the changed path (see the full-listing rows too).
        stats = tmpfs.get("reconcile", {}).get(size, {}).get("one_change_hint")
        if stats:
            add(
                f"reconcile, one change in {thousands(int(size))} files (tmpfs)",
                stats["median_ms"],
                limit,
                "ms",
            )
    quota = s.get("index_scale", {}).get("quota_check")
    add("quota check, 100 sessions", quota and quota["median_ms"], 5.0, "ms")
    for label, fs in (("disk", disk), ("tmpfs", tmpfs)):
        c = fs.get("cleanup", {}).get("100000")
        if c or label == "disk":
            limit = c.get("target_s") or 10.0 if c else 1.5
            add(
                f"cleanup of 100k expired files ({label})", c and c["cleanup"]["median_ms"] / 1000, limit, "s"
            )
    rw = s.get("rewrite", {})
    value = rw["text"]["median_ms"] if rw.get("paths") == 1000 and "text" in rw else None
    add("rewrite, 100 KB answer with 1,000 paths", value, 20.0, "ms")
    long = rw.get("pathological")
    if long and long["bytes"] == 1_000_000:
        for name in ("no path", "](/mnt/data/x "):
            case = long["cases"].get(name, {})
            for how, key in (("whole", "plain"), ("streamed", f"streamed_{long['piece_chars']}_char_pieces")):
                got = case.get(key)
                add(f"rewrite, 1 MB line, {name!r}, {how}", got and got["median_ms"], long["target_ms"], "ms")
    conc = s.get("concurrency", {})
    add("8 concurrent chats: errors", conc.get("errors"), 0, "errors")
    kern = s.get("kernel", {})
    warm = kern.get("warm_step")
    add("warm step / cold full path (live kernel)", warm and warm["warm_vs_cold"], 0.1, "x")
    add("warm step, whole path (live kernel)", warm and warm["warm_full_path"]["median_ms"], 2.0, "ms")
    add(
        "bare round trip into the live kernel",
        warm and warm["bare_kernel_round_trip"]["median_ms"],
        1.0,
        "ms",
    )
    first = kern.get("first_step")
    add("a chat's first step / bare runsc", first and first["first_vs_bare"], 1.15, "x")
    hibernate.targets(s.get("hibernate", {}), add)
    idle.targets(s.get("idle_kernels", {}), add)
    capacity.targets(s.get("capacity", {}), add)
    tick = s.get("deleted_chats", {})
    value = tick["tick"]["median_ms"] if tick.get("sessions") == 10_000 else None
    add("deleted-chat tick, 10,000 sessions", value, 500.0, "ms")
    hook = s.get("filter_stream", {})
    value = hook.get("ratio_of_medians") if hook.get("paths") == 1000 else None
    limit = hook.get("target_ratio", 1.5)
    add("Filter stream hook / a minimal rewriting hook, 100 KB answer", value, limit, "x")
    uploads.targets(s.get("uploads", {}), add)
    if "previews" in s:
        previews.targets(s["previews"], add)
    if "index_backends" in s:
        ratio = s["index_backends"].get("step", {}).get("ratio_of_medians")
        add("chat step storage, PostgreSQL / SQLite", ratio, TARGET_STEP_RATIO, "x")
    if "environment" in s:
        for name, value, limit, unit in environment.targets(s["environment"]):
            add(name, value, limit, unit)
    branches.targets(s.get("branches", {}), add)
    if "exports" in s:
        exports.targets(s["exports"], add)
    return found


def _targets_table(found: list[dict[str, Any]]) -> str:
    rows = []
    for t in found:
        value = "-" if t["value"] is None else f"{t['value']:.3g} {t['unit']}"
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        rows.append([t["target"], value, f"<= {t['limit']:g} {t['unit']}", met])
    return table(["target", "measured", "target", ""], rows, right=(1,))


def render(results: dict[str, Any]) -> str:
    meta = results["meta"]
    s = results["sections"]
    parts = [
        f"code-sessions benchmarks, {meta['mode']} mode, {meta['date']}",
        f"machine: {meta['machine']}",
        f"software: {meta['software']}",
        f"scratch: {meta['scratch']}; runner state: {meta['runner_base']}",
        f"load average before / after: {meta['load_before']} / {meta.get('load_after', '?')}",
    ]
    sections = [
        ("1. Run overhead: bare runsc (a) vs our full path (b)", "run_overhead", _overhead),
        ("2. Index scale", "index_scale", _index),
        ("3. Concurrency", "concurrency", _concurrency),
        ("4. Link rewriting", "rewrite", _rewrite),
        ("5. Memory: peak RSS of the host side", "memory", _memory),
        ("6. The live kernel", "kernel", _kernel),
        ("7. Chats deleted in Open WebUI: one background tick", "deleted_chats", _deleted_chats),
        ("8. Kernels saved to disk, resumed, and started warm", "hibernate", hibernate.render),
        ("Idle kernels on systrap and on ptrace", "idle_kernels", idle.render),
        ("9. The Filter's stream hook", "filter_stream", filter_stream.render),
        ("10. Upload links: receiving a file", "uploads", uploads.render),
        ("11. A table preview of a 100 MB CSV", "previews", previews.render),
        ("Index backends: SQLite vs PostgreSQL", "index_backends", index_backends.render),
        ("The sandbox environment", "environment", environment.render),
        ("12. States for the conversation's branches", "branches", branches.render),
        ("13. Runs' records, clones and exports", "exports", exports.render),
        ("14. Capacity: 1,000 saved chats and 50 live kernels on one host", "capacity", capacity.render),
    ]
    for title, key, fn in sections:
        if key in s:
            parts += ["", f"== {title} ==", fn(s[key])]
    parts += ["", "== Targets ==", _targets_table(results["targets"])]
    errors = results["errors"]
    parts += ["", f"errors: {len(errors)}", *(f"  {e}" for e in errors)]
    return "\n".join(parts)
