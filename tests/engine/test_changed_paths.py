"""A step reconciles only what its run changed (RunResult.changed), and lists the whole folder when it
must: the first step of a session in a process, every FULL_RECONCILE_EVERY_S, a runner that failed or
does not know. Real runsc for the 10k-file session and the random sequences; a stand-in runner for
the policy."""

from __future__ import annotations

import os
import random
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import Engine, Settings
from engine import service as engine_service
from runner import Limits, Outcome, Runner, RunnerError, RunResult
from storage import Quotas, Store

LIMITS = Limits(timeout_s=20, memory_mb=256)


@pytest.fixture
async def real(tmp_path: Path):
    runner = Runner()
    store = Store(
        tmp_path / "root",
        quotas=Quotas(max_files_per_user=50_000, max_new_files_per_run=0),
        owner=(runner.sandbox_uid, runner.sandbox_gid),
    )
    async with store:
        yield Engine(store, runner, Settings(limits=LIMITS))


def _make_files(folder: Path, count: int, per_dir: int = 1000) -> None:
    # World-writable, so the sandbox user may change them (the runner only chowns the top folder).
    for d in range(count // per_dir):
        sub = folder / f"d{d:03}"
        sub.mkdir(mode=0o777)
        sub.chmod(0o777)
        fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(per_dir):
                f = os.open(f"f{i:04}.txt", os.O_WRONLY | os.O_CREAT, 0o666, dir_fd=fd)
                os.fchmod(f, 0o666)
                os.write(f, b"x")
                os.close(f)
        finally:
            os.close(fd)


async def test_a_step_in_a_10k_file_session_looks_only_at_its_changes(real: Engine) -> None:
    chat = await real.chat("u", "big")
    _make_files(chat.session.path, 10_000)
    first = await chat.run("print(1)", "python")
    assert first.ok and first.files.full and first.files.files == 10_000  # first step here: full
    step = await chat.run(
        "import os\n"
        "open('/mnt/data/d003/f0005.txt', 'a').write('more')\n"
        "os.remove('/mnt/data/d007/f0001.txt')\n"
        "open('/mnt/data/d009/c.png', 'wb').write(b'png')\n"
        "print(1)",
        "python",
    )
    assert step.ok, step.for_model()
    report = step.files
    assert report.full is False
    assert (report.added, report.changed, report.removed) == (
        ["d009/c.png"],
        ["d003/f0005.txt"],
        ["d007/f0001.txt"],
    )
    assert report.files == 10_000
    assert await real.store.check() == []
    nothing = await chat.run("print(2)", "python")
    assert nothing.files.full is False and nothing.files.summary().startswith("0 added, 0 changed, 0 removed")
    # A new folder could hide a hard link made and removed in it: the runner does not vouch.
    folder = await chat.run("import os\nos.makedirs('/mnt/data/out/charts')", "python")
    assert folder.run.changed is None and folder.files.full and await real.store.check() == []


# One random step, run inside the sandbox: it picks among the current files and folders itself.
STEP = textwrap.dedent(
    """
    import os, random, shutil
    rng = random.Random({seed})
    os.chdir('/mnt/data')

    def listing():
        files, dirs = [], ['.']
        for root, ds, fs in os.walk('.'):
            dirs += [os.path.join(root, d) for d in ds]
            files += [os.path.join(root, f) for f in fs]
        return files, dirs

    def fresh(dirs):
        return os.path.join(rng.choice(dirs), rng.choice('abcdefgh') + str(rng.randrange(50)))

    def write(path, data, flags):
        # O_NONBLOCK: a FIFO made by an earlier op fails to open instead of blocking forever.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | flags, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    for _ in range(rng.randrange(1, 8)):
        files, dirs = listing()
        op = rng.choice({ops!r})
        try:
            if op == 'create' or not files and op in ('append', 'truncate', 'delete', 'rename',
                                                      'utime', 'hardlink', 'unlink_link'):
                write(fresh(dirs), os.urandom(rng.randrange(100)), os.O_TRUNC)
            elif op == 'append':
                write(rng.choice(files), b'+' * rng.randrange(1, 50), os.O_APPEND)
            elif op == 'truncate':
                os.truncate(rng.choice(files), rng.randrange(5))
            elif op == 'delete':
                os.remove(rng.choice(files))
            elif op == 'rename':
                os.replace(rng.choice(files), fresh(dirs))
            elif op == 'mkdir':
                os.makedirs(os.path.join(fresh(dirs), 'x', 'y'))
                write(os.path.join(fresh(dirs), 'n'), b'n', 0)
            elif op == 'rename_dir' and len(dirs) > 1:
                src = rng.choice(dirs[1:])
                dst = fresh(dirs)
                if not (dst + '/').startswith(src + '/'):
                    os.rename(src, dst)
            elif op == 'rmtree' and len(dirs) > 1:
                shutil.rmtree(rng.choice(dirs[1:]))
            elif op == 'utime':
                t = rng.randrange(10**9)
                os.utime(rng.choice(files), (t, t))
            elif op == 'symlink':
                os.symlink(rng.choice(['/etc/passwd', '/', '..']), fresh(dirs))
            elif op == 'fifo':
                os.mkfifo(fresh(dirs))
            elif op == 'hardlink':
                os.link(rng.choice(files), fresh(dirs))
            elif op == 'unlink_link':
                # A write through a temporary second name of an existing file.
                target, temp = rng.choice(files), fresh(dirs)
                os.link(target, temp)
                write(temp, b'#' * rng.randrange(1, 9), os.O_APPEND)
                os.remove(temp)
        except OSError:
            pass  # a name already taken, a folder that is not empty...: the next op
    print('ok')
    """
)


# Weighted: mostly what keeps a step change-driven; 'mkdir' (a new folder), 'unlink_link' (a write
# through a temporary second name) and 'hardlink' (a lasting one) make a step list everything.
OPS = ["create"] * 3 + ["append"] * 3 + ["truncate", "delete", "rename", "rename", "rename_dir"]
OPS += ["rmtree", "utime", "utime", "symlink", "fifo", "mkdir", "unlink_link"]


@pytest.mark.parametrize(("seed", "ops"), [(1, OPS), (2, OPS), (3, [*OPS, "hardlink"])])
async def test_random_steps_leave_the_index_equal_to_the_disk(
    real: Engine, seed: int, ops: list[str]
) -> None:
    chat = await real.chat("u", f"random-{seed}")
    rng = random.Random(seed)
    kinds = []
    for n in range(8):
        step = await chat.run(STEP.format(seed=rng.randrange(10**9), ops=ops), "python")
        assert step.ok, step.for_model()
        drift = await real.store.check()
        assert drift == [], f"seed {seed}, step {n}: {drift}"
        kinds.append("full" if step.files.full else "partial")
    assert kinds[0] == "full"  # the session's first step in this process
    if "hardlink" not in ops:
        assert kinds.count("partial") >= 3, kinds


# ---------------------------------------------------------------- the policy, with a stand-in runner


class FakeRunner:
    """Writes into the folder like a run would, and reports what it is told to."""

    sandbox_uid = sandbox_gid = os.getuid()

    def __init__(self) -> None:
        self.action: Callable[[Path], None] = lambda folder: None
        self.changed: tuple[str, ...] | None = ()
        self.outcome = Outcome.OK
        self.fail = False

    async def run(self, code: str, language: str, workdir: Path, limits: Limits) -> RunResult:
        self.action(Path(workdir))
        if self.fail:
            raise RunnerError("runsc vanished")
        return RunResult(
            outcome=self.outcome, exit_code=0, stdout="", stderr="", duration_s=0.0, changed=self.changed
        )


@pytest.fixture
async def fake(tmp_path: Path):
    async with Store(tmp_path / "root") as store:
        yield Engine(store, FakeRunner(), Settings(limits=LIMITS))


def _writes(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_text(name)


async def test_first_step_is_full_then_changes_only(fake: Engine) -> None:
    runner: FakeRunner = fake.runner
    chat = await fake.chat("u", "c")
    runner.action, runner.changed = _writes("a"), ("a",)
    assert (await chat.run("x", "python")).files.full
    runner.action, runner.changed = _writes("b"), ("b",)
    step = await chat.run("x", "python")
    assert not step.files.full and step.files.added == ["b"]


async def test_unknown_changes_or_a_failed_run_list_everything(fake: Engine) -> None:
    runner: FakeRunner = fake.runner
    chat = await fake.chat("u", "c")
    await chat.run("x", "python")
    runner.action, runner.changed = _writes("a"), None
    step = await chat.run("x", "python")
    assert step.files.full and step.files.added == ["a"]
    runner.action, runner.changed, runner.outcome = _writes("b"), (), Outcome.SANDBOX_FAILURE
    step = await chat.run("x", "python")
    assert step.files.full and step.files.added == ["b"]
    runner.action, runner.fail = _writes("c"), True
    step = await chat.run("x", "python")
    assert step.refused and "runsc vanished" in step.refused
    assert [f.path for f in await chat.session.files.list()] == ["a", "b", "c"]


async def test_a_missed_change_is_repaired_by_the_periodic_full_listing(
    fake: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner: FakeRunner = fake.runner
    chat = await fake.chat("u", "c")
    await chat.run("x", "python")
    runner.action, runner.changed = _writes("missed"), ()  # the watch missed it
    assert not (await chat.run("x", "python")).files.full
    assert [d.kind for d in await fake.store.check()] == ["file not indexed"]
    monkeypatch.setattr(engine_service, "FULL_RECONCILE_EVERY_S", 0.0)
    runner.action = lambda folder: None
    step = await chat.run("x", "python")
    assert step.files.full and step.files.added == ["missed"]
    assert await fake.store.check() == []
