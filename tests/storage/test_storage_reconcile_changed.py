"""Change-driven reconcile (`reconcile(changed=...)`) against the full one.

Each case builds two identical sessions (two users, so quotas see the same totals), applies the same
file operations to both, reconciles one with the changed paths and the other fully, and requires the
same report (added, changed, removed, rejected, renamed, quota removals, totals) and an index that
matches the disk (`store.check()`)."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from storage import Policy, Quotas, ReconcileReport, Session, Store, _reconcile_changed

BASE = {
    "a.txt": b"a",
    "b.txt": b"bb",
    "d/x": b"x",
    "d/y": b"yy",
    "d/sub/z": b"z",
    "e/w": b"w",
    # Neighbours of `d` in the index's sort order: a range for `d/` must not touch them.
    "d.txt": b"dot",
    "d-1/q": b"q",
    "d0": b"zero",
}

Op = Callable[[Path], None]


def _write(path: Path, data: bytes, mtime: float | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


async def _twins(store: Store, policy: Policy | None = None) -> tuple[Session, Session]:
    pair = (
        await store.session("partial", "c", policy=policy),
        await store.session("full", "c", policy=policy),
    )
    for session in pair:
        for i, (rel, data) in enumerate(BASE.items()):
            _write(session.path / rel, data, 1_000_000 + i)
        report = await session.reconcile(enforce_quotas=False)
        assert report.full and len(report.added) == len(BASE)
    return pair


def _essence(report: ReconcileReport) -> tuple[object, ...]:
    return (
        sorted(report.added),
        sorted(report.changed),
        sorted(report.removed),
        sorted((r.path, r.kind) for r in report.rejected),
        sorted((r.old, r.new) for r in report.renamed),
        sorted((r.path, r.size, r.reason) for r in report.quota_removed),
        report.files,
        report.bytes,
    )


async def _compare(
    store: Store, op: Op, changed: list[str], *, full: bool = False, policy: Policy | None = None
) -> ReconcileReport:
    partial, whole = await _twins(store, policy)
    op(partial.path)
    op(whole.path)
    got = await partial.reconcile(changed=changed)
    want = await whole.reconcile()
    assert got.full is full
    assert want.full
    assert _essence(got) == _essence(want)
    rows = [[(f.path, f.size) for f in await s.files.list()] for s in (partial, whole)]
    assert rows[0] == rows[1]
    assert await store.check() == []
    return got


def _rename_dir_and_write(r: Path) -> None:
    os.rename(r / "d", r / "d2")
    _write(r / "d2" / "new", b"new")


def _file_to_dir(r: Path) -> None:
    (r / "b.txt").unlink()
    _write(r / "b.txt" / "inner", b"in")


def _dir_to_file(r: Path) -> None:
    shutil.rmtree(r / "e")
    _write(r / "e", b"now a file")


def _specials(r: Path) -> None:
    os.symlink("/etc/passwd", r / "link")
    os.mkfifo(r / "fifo")
    (r / "nd").mkdir()
    os.symlink("/", r / "nd" / "rootfs")
    _write(r / "nd" / "ok", b"ok")


def _bad_name_in_new_folder(r: Path) -> None:
    (r / "nd").mkdir()
    with open(os.fsencode(r) + b"/nd/caf\xe9.txt", "wb") as fh:
        fh.write(b"x")


def _too_deep(r: Path) -> None:
    _write(r.joinpath(*["n"] * 40) / "f", b"deep")
    _write(r.joinpath(*["n"] * 31) / "ok", b"ok")


CASES: list[tuple[str, Op, list[str]]] = [
    (
        "add",
        lambda r: (_write(r / "new.txt", b"new"), _write(r / "d/new2.txt", b"n2")),
        ["new.txt", "d/new2.txt"],
    ),
    ("modify", lambda r: _write(r / "a.txt", b"longer"), ["a.txt"]),
    ("mtime only", lambda r: os.utime(r / "a.txt", (2_000_000, 2_000_000)), ["a.txt"]),
    ("delete", lambda r: (r / "a.txt").unlink(), ["a.txt"]),
    ("rename file", lambda r: os.rename(r / "a.txt", r / "d" / "a2.txt"), ["a.txt", "d/a2.txt"]),
    # The renamed folder's watch still reports its old name (`d/new`): covered by `d2`.
    ("rename dir", _rename_dir_and_write, ["d", "d2", "d/new"]),
    ("delete dir", lambda r: shutil.rmtree(r / "d"), ["d", "d/x", "d/y", "d/sub", "d/sub/z"]),
    ("new nested dirs", lambda r: _write(r / "n/m/o/f.txt", b"f"), ["n"]),
    ("file becomes dir", _file_to_dir, ["b.txt"]),
    ("dir becomes file", _dir_to_file, ["e", "e/w"]),
    ("symlink, fifo", _specials, ["link", "fifo", "nd"]),
    ("bad name in a new folder", _bad_name_in_new_folder, ["nd"]),
    ("too deep", _too_deep, ["n"]),
    ("nothing", lambda r: None, []),
    ("named but unchanged", lambda r: None, ["a.txt", "never-existed.txt", "d"]),
]


@pytest.mark.parametrize(("op", "changed"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_partial_equals_full(store: Store, op: Op, changed: list[str]) -> None:
    await _compare(store, op, changed)


def _parent_swapped(r: Path) -> None:
    outside = r.parents[3] / f"outside-{r.parent.name}"  # next to the store's root
    _write(outside / "x", b"outside")
    shutil.rmtree(r / "d")
    os.symlink(outside, r / "d")


def _hard_link(r: Path) -> None:
    os.link(r / "a.txt", r / "d" / "h")


def _hard_link_in_new_folder(r: Path) -> None:
    (r / "nd").mkdir()
    os.symlink("/etc", r / "nd" / "etc")  # rejected before the link is found: still reported
    os.link(r / "a.txt", r / "nd" / "h")


FALLBACKS: list[tuple[str, Op, list[str]]] = [
    ("parent swapped for a symlink", _parent_swapped, ["d/x"]),
    ("parent gone without an event", lambda r: shutil.rmtree(r / "e"), ["e/w"]),
    ("hard link", _hard_link, ["d/h"]),
    ("hard link in a new folder", _hard_link_in_new_folder, ["nd"]),
    ("not a relative path", lambda r: None, ["../a.txt"]),
    ("empty component", lambda r: None, ["d//x"]),
    ("the folder itself", lambda r: None, [""]),
    ("too deep a path", lambda r: None, ["/".join(["n"] * 33)]),
    ("not UTF-8", lambda r: None, ["caf\udce9.txt"]),
]


@pytest.mark.parametrize(("op", "changed"), [c[1:] for c in FALLBACKS], ids=[c[0] for c in FALLBACKS])
async def test_unusual_cases_fall_back_to_the_full_listing(store: Store, op: Op, changed: list[str]) -> None:
    await _compare(store, op, changed, full=True)


async def test_a_removed_name_of_a_file_with_several_links_falls_back(store: Store) -> None:
    """`h` and `a.txt` are one file, both indexed. Written through `h`, then `h` removed: nothing
    names `a.txt`, yet it changed. The last full listing saw the link: full listing until it is gone."""
    partial, whole = await _twins(store)
    for session in (partial, whole):
        os.link(session.path / "a.txt", session.path / "d" / "h")
        assert (await session.reconcile()).added == ["d/h"]

    def op(r: Path) -> None:
        with open(r / "d" / "h", "ab") as fh:
            fh.write(b" grown through the other name")
        (r / "d" / "h").unlink()

    op(partial.path)
    op(whole.path)
    got = await partial.reconcile(changed=["d/h"])
    want = await whole.reconcile()
    assert got.full and _essence(got) == _essence(want)
    assert (got.changed, got.removed) == (["a.txt"], ["d/h"])
    assert await store.check() == []
    # That full listing found no link left: the next reconcile looks at its changes only.
    _write(partial.path / "a.txt", b"again")
    assert not (await partial.reconcile(changed=["a.txt"])).full


async def test_too_many_paths_fall_back(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_reconcile_changed, "MAX_PATHS", 3)
    changed = ["p0", "p1", "p2", "p3"]
    with caplog.at_level(logging.DEBUG, "code_sessions.storage"):
        await _compare(store, lambda r: [_write(r / p, b"p") for p in changed], changed, full=True)
    assert "full listing instead of 4 changed paths: more than 3 paths" in caplog.text


async def test_quota_removes_new_and_grown_files_the_same_way(store: Store) -> None:
    now = time.time()

    def op(r: Path) -> None:
        _write(r / "a.txt", b"a" * 140)  # a known file grows, last: the bytes limit takes it first
        _write(r / "big.bin", b"b" * 200, now - 50)  # over the per-file limit
        for i in range(5):
            _write(r / f"new{i}", b"n" * 60, now - 40 + i)
        _write(r / "nd" / "deep", b"d" * 60, now - 1)

    for user in ("partial", "full"):
        other = await store.session(user, "other chat")
        _write(other.path / "kept", b"k" * 100)
        await other.reconcile()
    policy = Policy(
        Quotas(max_files_per_user=100, max_bytes_per_user=450, max_file_bytes=150, max_new_files_per_run=4)
    )
    changed = ["a.txt", "big.bin", *[f"new{i}" for i in range(5)], "nd"]
    report = await _compare(store, op, changed, policy=policy)
    reasons = {r.path: r.reason for r in report.quota_removed}
    assert "per-file limit" in reasons.pop("big.bin")
    assert any("new files allowed in one run" in why for why in reasons.values())
    assert "storage limit" in reasons.pop("a.txt")


async def test_rows_are_read_per_path(store: Store) -> None:
    """Only the named paths' rows are read: a row elsewhere that the disk contradicts stays as is
    (which is why the engine still lists the whole folder now and then)."""
    session, _ = await _twins(store)
    (session.path / "b.txt").unlink()  # behind the index's back, not named below
    _write(session.path / "a.txt", b"changed")
    report = await session.reconcile(changed=["a.txt"])
    assert (report.full, report.changed, report.removed) == (False, ["a.txt"], [])
    assert [d.path for d in await store.check()] == ["b.txt"]
    assert (await session.reconcile()).removed == ["b.txt"]


async def test_a_chat_that_went_on_without_its_index_on_a_full_disk_is_listed_whole(store: Store) -> None:
    # Its index row could not be written on the full disk (Core.ensure kept it in `unsaved`), and a
    # run then wrote a file that no sync indexed. Back with room, the chat's next step must list the
    # folder whole: the catch-up of unsaved sessions skips the one its caller is about to lock.
    session = await store.session("u", "c")
    (session.path / "written-then.txt").write_bytes(b"x")
    store._core.unsaved[(session.user_key, session.chat_key)] = store._core.ref("u", "c")
    again = await store.session("u", "c")
    async with again.lock():
        await again.begin_run()
        report = await again.reconcile(changed=[])
    assert report.full
    assert [f.path for f in await again.files.list()] == ["written-then.txt"]
