"""RunResult.changed: the paths a run touched, from a host-side inotify watch. Real runsc where a run is
involved; the give-up cases that need no sandbox drive the watch directly."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from runner import Limits, Outcome, Runner, _changes
from runner._changes import ChangeWatch

LIMITS = Limits(timeout_s=20)


def _tree(workdir: Path) -> None:
    for path, text in {
        "old.txt": "old",
        "keep.txt": "keep",
        "untouched.txt": "same",
        "sub/a.txt": "a",
        "sub/b.txt": "b",
        "gone/x": "x",
        "ren/y": "y",
        "d/e/f": "f",
    }.items():
        (workdir / path).parent.mkdir(parents=True, exist_ok=True)
        (workdir / path).write_text(text)
    shutil.chown(workdir, 65534, 65534)
    for root, dirs, files in os.walk(workdir):
        for name in dirs + files:
            os.chown(os.path.join(root, name), 65534, 65534)


async def test_a_run_reports_exactly_the_paths_it_touched(runner: Runner, workdir: Path) -> None:
    _tree(workdir)
    code = """
import os, shutil
os.chdir('/mnt/data')
open('new.txt', 'w').write('n')                 # created
open('old.txt', 'a').write('more')              # modified
os.remove('sub/a.txt')                          # deleted
os.rename('keep.txt', 'moved.txt')              # renamed file: both names
shutil.rmtree('gone')                           # folder with contents
os.rename('ren', 'ren2')                        # renamed folder
os.utime('d/e/f', (1, 1))                       # attributes only
print(open('untouched.txt').read(), open('sub/b.txt').read(), sorted(os.listdir('.')))
"""
    res = await runner.run(code, "python", workdir, LIMITS)
    assert res.outcome is Outcome.OK, res
    assert res.changed == (
        "d/e/f",
        "gone",
        "gone/x",
        "keep.txt",
        "moved.txt",
        "new.txt",
        "old.txt",
        "ren",
        "ren2",
        "sub/a.txt",
    )


async def test_nothing_changed_is_an_empty_tuple_not_unknown(runner: Runner, workdir: Path) -> None:
    res = await runner.run("print(1)", "python", workdir, LIMITS)
    assert res.ok and res.changed == ()


async def test_a_write_through_a_shared_mapping_is_seen(runner: Runner, workdir: Path) -> None:
    # Stores through mmap raise no IN_MODIFY; the close of the host file when the sandbox is torn
    # down (here: killed at the deadline, the mapping still open) raises IN_CLOSE_WRITE.
    (workdir / "m.bin").write_bytes(b"\0" * 4096)
    os.chown(workdir / "m.bin", 65534, 65534)
    code = """
import mmap, time
f = open('/mnt/data/m.bin', 'r+b')
m = mmap.mmap(f.fileno(), 4096)
m[0:4] = b'abcd'
print('mapped', flush=True)
time.sleep(60)
"""
    res = await runner.run(code, "python", workdir, Limits(timeout_s=5))
    assert res.outcome is Outcome.TIMEOUT and "mapped" in res.stdout, res
    assert (workdir / "m.bin").read_bytes()[:4] == b"abcd"
    assert res.changed == ("m.bin",)


async def test_too_many_paths_is_unknown(
    runner: Runner, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_changes, "MAX_PATHS", 20)
    res = await runner.run("for i in range(30):\n    open(f'/mnt/data/f{i}', 'w')", "python", workdir, LIMITS)
    assert res.ok and res.changed is None
    res = await runner.run("for i in range(20):\n    open(f'/mnt/data/g{i}', 'w')", "python", workdir, LIMITS)
    assert res.ok and res.changed is not None and len(res.changed) == 20


async def test_what_could_hide_a_hard_link_is_unknown(runner: Runner, workdir: Path) -> None:
    # A link made and removed inside a new folder leaves no event naming anything.
    (workdir / "x").write_text("x")
    os.chown(workdir / "x", 65534, 65534)
    code = "import os\nos.mkdir('/mnt/data/nd')\nos.link('/mnt/data/x', '/mnt/data/nd/y')\n"
    code += "open('/mnt/data/nd/y', 'a').write('grown')\nos.remove('/mnt/data/nd/y')"
    res = await runner.run(code, "python", workdir, LIMITS)
    assert res.ok and (workdir / "x").read_text() == "xgrown"
    assert res.changed is None
    # The same in a watched folder: `y` was created and removed again.
    code = "import os\nos.link('/mnt/data/x', '/mnt/data/y')\n"
    code += "open('/mnt/data/y', 'a').write('!')\nos.remove('/mnt/data/y')"
    res = await runner.run(code, "python", workdir, LIMITS)
    assert res.ok and (workdir / "x").read_text() == "xgrown!"
    assert res.changed is None
    # A temporary file moved into place is fine: its inode lives on under a name that is reported.
    code = "import os\nopen('/mnt/data/t.tmp', 'w').write('t')\nos.replace('/mnt/data/t.tmp', '/mnt/data/t')"
    res = await runner.run(code, "python", workdir, LIMITS)
    assert res.ok and res.changed == ("t", "t.tmp")


def test_queue_overflow_is_unknown(tmp_path: Path) -> None:
    # 20,000 creations queue ~40,000 events (create + close), more than fs.inotify.max_queued_events
    # (16384 here) when nothing drains them.
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    watch = ChangeWatch.start(str(tmp_path), max_paths=10**6)
    assert watch.active
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(limit // 2 + 4000):
            os.close(os.open(f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    assert watch.finish() is None
    assert watch.why_unknown == "the inotify queue overflowed"


def test_give_up_cases_without_a_sandbox(tmp_path: Path) -> None:
    dirs = tmp_path / "dirs"
    for i in range(5):
        (dirs / f"d{i}").mkdir(parents=True)
    many = ChangeWatch.start(str(dirs), max_dirs=3)
    assert not many.active and many.finish() is None
    assert many.why_unknown == "more than 3 directories"

    names = tmp_path / "names"
    names.mkdir()
    watch = ChangeWatch.start(str(names))
    assert watch.active
    (names / "fine.txt").write_text("1")
    os.close(os.open(os.fsencode(names) + b"/caf\xe9", os.O_WRONLY | os.O_CREAT, 0o600))
    assert watch.finish() is None and watch.why_unknown == "a changed name is not valid UTF-8"

    bad_dir = tmp_path / "bad-dir"
    bad_dir.mkdir()
    os.mkdir(os.fsencode(bad_dir) + b"/\xff")
    watch = ChangeWatch.start(str(bad_dir))
    assert watch.finish() is None and watch.why_unknown == "a directory name is not valid UTF-8"

    missing = ChangeWatch.start(str(tmp_path / "missing"))
    assert missing.finish() is None and missing.why_unknown


def test_setup_lists_folders_not_files(tmp_path: Path) -> None:
    # A folder with many files and no subfolder is not even listed on ext4/tmpfs (link count 2);
    # either way every folder is watched and a change in the deepest one is named.
    for i in range(3):
        (tmp_path / f"d{i}" / "inner").mkdir(parents=True)
        for j in range(200):
            (tmp_path / f"d{i}" / f"f{j}").write_text("x")
    watch = ChangeWatch.start(str(tmp_path))
    assert sorted(watch._dirs.values()) == ["", "d0", "d0/inner", "d1", "d1/inner", "d2", "d2/inner"]
    (tmp_path / "d2" / "inner" / "new").write_text("1")
    (tmp_path / "d0" / "f7").unlink()
    assert watch.finish() == ("d0/f7", "d2/inner/new")
