"""The persistent kernel program (runner/_kernel_program/), run for real on the host.

Each test starts the kernel the way the host will (the one program ``program()`` joins, written out
as kernel.py, run by /usr/bin/python3 with the workdir as cwd), but in a fresh pid namespace of its own
(``unshare --pid --fork --kill-child --mount-proc``) instead of gVisor, so it is PID 1 there and its
clean-up of leftover processes is exercised for real without touching the machine's. Everything is
driven through the wire, decoded by runner/_wire.py, with the protocol's ordering rules checked.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runner import _kernel_program
from runner._kernel_program import condition, packages, pumps
from runner._kernel_program.protocol import FATAL_EXIT, MAX_TEXT, PROTOCOL_VERSION, WORKDIR_ENV
from runner._wire import Done, FrameDecoder, Message, Output, ProtocolError, ProtocolState, Ready, encode_run
from tests.support.figure_cells import SURFACE

PYTHON = "/usr/bin/python3"
HAS_MATPLOTLIB = subprocess.run([PYTHON, "-c", "import matplotlib"], capture_output=True).returncode == 0
KERNEL_SOURCE = _kernel_program.program()


@dataclass
class Result:
    done: Done
    outputs: list[Output] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return "".join(o.text for o in self.outputs if o.stream == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(o.text for o in self.outputs if o.stream == "stderr")

    @property
    def status(self) -> str:
        return self.done.status


class Kernel:
    """The host side in miniature: start, send runs (pipelining allowed), decode strictly."""

    def __init__(self, root: Path, *, namespace: bool = True) -> None:
        code_dir = root / "code"
        code_dir.mkdir()
        self.script = code_dir / "kernel.py"
        self.script.write_text(KERNEL_SOURCE, encoding="utf-8")
        self.workdir = root / "data"
        self.workdir.mkdir()
        self.diag_path = root / "diag.log"
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": str(root),
            "MPLBACKEND": "Agg",
            "PYTHONDONTWRITEBYTECODE": "1",
            WORKDIR_ENV: str(self.workdir),
        }
        argv = [PYTHON, str(self.script)]
        if namespace:
            argv = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *argv]
        self.started = time.perf_counter()
        with self.diag_path.open("wb") as diag:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=diag, cwd=self.workdir, env=env
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.decoder = FrameDecoder()
        self.state = ProtocolState()
        self.queue: collections.deque[Message] = collections.deque()
        self.inflight: collections.deque[int] = collections.deque()
        self.outputs: dict[int, list[Output]] = collections.defaultdict(list)
        self.next_id = 1
        self.eof = False
        self.expect_exit: int | None = 0
        ready = self.next_message(timeout=20)
        assert isinstance(ready, Ready), f"no ready frame; diag: {self.diag()}"
        self.ready = ready
        self.ready_s = time.perf_counter() - self.started
        self.host_pid = self._kernel_host_pid() if namespace else self.proc.pid

    def _kernel_host_pid(self) -> int:
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        assert len(children) == 1, children
        return int(children[0])

    def diag(self) -> str:
        return self.diag_path.read_text(errors="replace")

    # -- channel -------------------------------------------------------------------------------------

    def _fill(self, deadline: float) -> None:
        while not self.queue and not self.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no frame from the kernel in time; diag: {self.diag()}")
            readable, _, _ = select.select([self.stdout], [], [], left)
            if not readable:
                continue
            data = os.read(self.stdout.fileno(), 1 << 20)
            if not data:
                self.eof = True
                self.decoder.eof()
                return
            self.queue.extend(self.decoder.feed(data))

    def next_message(self, timeout: float = 30) -> Message | None:
        """The next message, checked against the ordering rules; None at EOF."""
        self._fill(time.monotonic() + timeout)
        if not self.queue:
            return None
        message = self.state.accept(self.queue.popleft())
        if isinstance(message, Output):
            self.outputs[message.run_id].append(message)
        if isinstance(message, Done):
            self.inflight.popleft()
            if self.inflight:
                self.state.start(self.inflight[0])
        return message

    def send(self, code: str, lang: str = "python") -> int:
        run_id = self.next_id
        self.next_id += 1
        if not self.inflight:
            self.state.start(run_id)
        self.inflight.append(run_id)
        self.stdin.write(encode_run(run_id, lang, code))
        self.stdin.flush()
        return run_id

    def wait(self, run_id: int, timeout: float = 30) -> Result:
        deadline = time.monotonic() + timeout
        while True:
            message = self.next_message(max(deadline - time.monotonic(), 0.001))
            if message is None:
                raise EOFError(f"the kernel closed the channel; diag: {self.diag()}")
            if isinstance(message, Done) and message.run_id == run_id:
                return Result(message, self.outputs.pop(run_id, []))

    def run(self, code: str, lang: str = "python", timeout: float = 30) -> Result:
        return self.wait(self.send(code, lang), timeout)

    def wait_for_text(self, run_id: int, text: str, timeout: float = 30) -> None:
        """Read until the run's output so far contains ``text`` (the cell is known to be running)."""
        deadline = time.monotonic() + timeout
        while text not in "".join(o.text for o in self.outputs[run_id]):
            message = self.next_message(max(deadline - time.monotonic(), 0.001))
            assert not isinstance(message, Done), f"run ended before printing {text!r}: {message}"
            assert message is not None, f"EOF; diag: {self.diag()}"

    def interrupt(self) -> None:
        os.kill(self.host_pid, signal.SIGINT)

    def namespace_pids(self) -> list[int]:
        """Pids alive in the kernel's pid namespace, as its own /proc lists them (from a cell)."""
        res = self.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
        assert res.status == "ok", res.stderr
        return json.loads(res.stdout)

    def close(self) -> int:
        """EOF on the request channel: the kernel exits 0. Idempotent; the exit status."""
        if not self.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # unshare --kill-child takes the kernel with it
            self.proc.wait()
        self.stdout.close()
        return self.proc.returncode


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    k = Kernel(tmp_path)
    try:
        yield k
    finally:
        code = k.close()
        if k.expect_exit is not None:
            assert code == k.expect_exit, f"kernel exited {code}; diag: {k.diag()}"
            assert k.diag() == "", k.diag()


# -- the module itself ---------------------------------------------------------------------------------


def test_the_package_is_inert_on_import_and_joins_into_one_program_fit_for_embedding() -> None:
    # Importing its modules (done above, for the program) started nothing and rebound nothing.
    assert sys.stdout is not None and not any(t.name.startswith("kernel-pump") for t in threading.enumerate())
    assert not any(type(f).__name__ == "_ImportHooks" for f in sys.meta_path)
    _kernel_program.check()  # the modules keep the joining rules; the program has no import of ours left
    ours = ["'" * 3, "__" + "file__", "from runner", "from ."]
    words = ours + ["from " + w for w in ("utils", "apps", "main")]
    for word in words:
        assert word not in KERNEL_SOURCE, word
    assert "from " + "config" not in KERNEL_SOURCE
    assert KERNEL_SOURCE.count("from __future__") == 1 and KERNEL_SOURCE.endswith("    main()\n")
    assert MAX_TEXT == 16 * 1024 and PROTOCOL_VERSION == 2


@pytest.mark.parametrize(
    ("module", "source", "complaint"),
    [
        ("pumps", "from .kernel import Kernel\n", "not before it"),
        ("pumps", "from .basics import _nothing\n", "not a name basics.py defines"),
        ("pumps", "from .basics import _fatal as die\n", "not a name basics.py defines"),
        ("pumps", "def f():\n    from .basics import _fatal\n", "at the top level"),
        ("pumps", "from runner import _wire\n", "imports the runner package"),
        ("pumps", "def _fatal():\n    pass\n", "which basics binds too"),
        ("pumps", "x = 1\ndef f():\n    global x\n    x = 2\n", "rebinds a global"),
        ("pumps", 'X = """\nfrom .basics import _fatal\n"""\n', "not the lines program"),
    ],
)
def test_the_joining_rules_are_checked(module: str, source: str, complaint: str) -> None:
    owners: dict[str, str] = {}
    for name in _kernel_program.MODULES[: _kernel_program.MODULES.index(module)]:
        _kernel_program._check_module(name, _kernel_program._source(name), owners)
    with pytest.raises(_kernel_program.JoinError, match=complaint):
        _kernel_program._check_module(module, source, owners)


def test_package_versions_come_from_metadata_names(tmp_path: Path) -> None:
    for name in ("numpy-1.2.3.dist-info", "Pillow-9.4.0.egg-info", "scipy-1.10.1-py3.11.egg-info", "junk"):
        (tmp_path / name).mkdir()
    (tmp_path / "pandas-2.0.egg-info").write_text("Metadata-Version: 1.2\n")  # Debian writes files too
    later = tmp_path / "later"
    later.mkdir()
    (later / "numpy-9.9.9.dist-info").mkdir()
    versions = packages.package_versions([str(tmp_path), str(later), str(tmp_path / "missing")])
    assert versions == {
        "numpy": "1.2.3",  # the first directory on the path wins, as for import
        "pandas": "2.0",
        "matplotlib": None,
        "openpyxl": None,
        "PIL": "9.4.0",
        "scipy": "1.10.1",
    }


# -- the pump, in this process ---------------------------------------------------------------------


class _Collect:
    def __init__(self) -> None:
        self.frames: list[dict[str, object]] = []

    def __call__(self, frame: dict[str, object]) -> None:
        self.frames.append(frame)

    def text(self) -> str:
        return "".join(str(f["d"]) for f in self.frames)


@pytest.fixture
def no_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pump that fails in this process must not os._exit the test run."""

    def fatal(message: str) -> None:
        raise RuntimeError(message)

    monkeypatch.setattr(pumps, "_fatal", fatal)


@pytest.mark.usefixtures("no_fatal")
def test_a_sentinel_split_anywhere_is_found() -> None:
    sentinel = b"\x00code-sessions:" + b"ab" * 16 + b"\x00"
    stream = "héllo wörld\n".encode() + sentinel + b"after"
    for cut in range(1, len(stream)):
        for cut2 in (cut, min(cut + 3, len(stream))):
            r, w = os.pipe()
            try:
                sent = _Collect()
                pump = pumps._Pump(sent, r, w, "o")
                pump.begin(7)
                pump.drain(sentinel)  # only writes it into the pipe: this pump's thread is not running
                for piece in (stream[:cut], stream[cut:cut2], stream[cut2:]):
                    pump.take(piece)
                pump.wait_drained()
                assert sent.text() == "héllo wörld\n", cut
                assert {f["id"] for f in sent.frames} == {7}
                assert bytes(pump._held) == b"after"
            finally:
                os.close(r)
                os.close(w)
    assert pumps._sentinel_prefix_start(b"abc\x00code", sentinel) == 3
    assert pumps._sentinel_prefix_start(b"abc\x00cx", sentinel) == 6


def _until(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.005)


def _in_write(thread: threading.Thread, fd: int, size: int) -> bool:
    """Whether the thread is in a write(fd, ..., size) system call, as the kernel sees it."""
    try:
        fields = Path(f"/proc/self/task/{thread.native_id}/syscall").read_text().split()
    except OSError:
        return False
    return len(fields) > 3 and int(fields[1], 16) == fd and int(fields[3], 16) == size


@pytest.mark.usefixtures("no_fatal")
def test_a_forged_sentinel_and_a_full_pipe_do_not_deadlock_the_drain() -> None:
    sentinel = b"\x00code-sessions:" + b"cd" * 16 + b"\x00"
    r, w = os.pipe()
    forger_w = os.dup(w)
    sent = _Collect()
    pump = pumps._Pump(sent, r, w, "e")
    pump.begin(1)

    def forge() -> None:  # a thread left by a cell that knows the sentinel and keeps the pipe full
        try:
            os.write(forger_w, sentinel)
            while True:
                os.write(forger_w, b"x" * 65536)
        except OSError:
            pass

    with pump._cond:
        pump._sentinel = sentinel  # armed, as drain() does first, before the forger gets in
    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    _until(lambda: select.select([], [w], [], 0)[1] == [], "the forger filled the pipe")
    drained = threading.Thread(target=lambda: (pump.drain(sentinel), pump.wait_drained()), daemon=True)
    drained.start()
    _until(lambda: _in_write(drained, w, len(sentinel)), "the real sentinel waits for room in the pipe")
    pump.start()  # finds the forged one first; must read on until the real one is in
    drained.join(10)
    assert not drained.is_alive(), "drain deadlocked"
    assert not pump._open and pump._written
    deadline = time.monotonic() + 10
    while not pump._paused and time.monotonic() < deadline:  # it holds what follows, up to the cap
        time.sleep(0.01)
    assert pump._paused
    os.close(r)  # the paused pump never reads again; the forger gets EPIPE and ends
    os.close(forger_w)
    forger.join(10)
    assert len(pump._held) <= pumps._HELD_CAP + 100


# -- the kernel through the wire ----------------------------------------------------------------------


def test_ready_frame(kernel: Kernel) -> None:
    script = (
        "import importlib.metadata as m, json, platform\n"
        "def version(dist):\n"
        "    try:\n"
        "        return m.version(dist)\n"
        "    except m.PackageNotFoundError:\n"
        "        return None\n"
        "names = {'numpy': 'numpy', 'pandas': 'pandas', 'matplotlib': 'matplotlib', 'openpyxl': 'openpyxl',\n"
        "         'PIL': 'Pillow', 'scipy': 'scipy'}\n"
        "print(json.dumps([platform.python_version(), {k: version(v) for k, v in names.items()}]))"
    )
    expected = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, check=True).stdout
    python, packages = json.loads(expected)
    assert kernel.ready.version == 2
    assert kernel.ready.pid == 1  # init of its own pid namespace
    assert kernel.ready.python == python
    assert kernel.ready.packages == packages
    if HAS_MATPLOTLIB:
        assert kernel.ready.packages["matplotlib"] is not None


def test_state_persists_across_runs(kernel: Kernel) -> None:
    assert kernel.run("import math\na = 40\ndef f(x):\n    return x + a\nclass C:\n    k = 2").status == "ok"
    res = kernel.run(
        "print(f(math.floor(1.5)) + C.k)\nimport pickle\nprint(type(pickle.loads(pickle.dumps(C()))))"
    )
    assert res.status == "ok", res.stderr
    assert res.stdout == "43\n<class '__main__.C'>\n"
    assert kernel.run("print(__name__, 'f' in dir(), 'Kernel' in dir())").stdout == "__main__ True False\n"


def test_last_expression_is_displayed(kernel: Kernel) -> None:
    assert kernel.run("1 + 1").stdout == "2\n"
    assert kernel.run("x = 5").stdout == ""
    assert kernel.run("None").stdout == ""
    assert kernel.run("print('p')\n'a' * 2").stdout == "p\n'aa'\n"
    assert kernel.run("_").stdout == "'aa'\n"
    assert kernel.run("x;").stdout == ""  # a trailing semicolon hides it, as in IPython
    assert kernel.run("for i in range(2):\n    i").stdout == ""  # only a top-level expression


def test_a_traceback_shows_the_cells_source_and_no_kernel_frames(kernel: Kernel) -> None:
    kernel.run("def f(x):\n    return 1 / x")
    res = kernel.run("y = 1\nf(0)")
    assert (res.status, res.done.exit_code) == ("error", 1)
    assert res.stderr.startswith("Traceback (most recent call last):\n")
    assert 'File "<cell-2>", line 2, in <module>\n    f(0)' in res.stderr
    assert 'File "<cell-1>", line 2, in f\n    return 1 / x' in res.stderr
    assert res.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert "kernel.py" not in res.stderr and "exec(" not in res.stderr
    res = kernel.run("def broken(:\n    pass")
    assert res.status == "error" and "SyntaxError" in res.stderr and "ast.py" not in res.stderr
    assert "<cell-3>" in res.stderr
    assert kernel.run("y").stdout == "1\n"  # the failed cell's earlier statements took effect


def test_system_exit_ends_the_cell_not_the_kernel(kernel: Kernel) -> None:
    cases = {
        "import sys\nsys.exit(3)": ("error", 3, ""),
        "import sys\nsys.exit(0)": ("ok", 0, ""),
        "raise SystemExit": ("ok", 0, ""),
        "import sys\nsys.exit('bye')": ("error", 1, "bye\n"),
        "exit(2)": ("error", 2, ""),
    }
    for code, (status, exit_code, stderr) in cases.items():
        res = kernel.run(code)
        assert (res.status, res.done.exit_code, res.stderr) == (status, exit_code, stderr), code
    assert kernel.run("print('alive')").stdout == "alive\n"


def test_stdout_and_stderr_are_separate_and_ordered(kernel: Kernel) -> None:
    code = (
        "import os, subprocess, sys\n"
        "for i in range(200):\n"
        "    print(i)\n"
        "    print(-i, file=sys.stderr)\n"
        "os.write(1, b'raw\\n')\n"
        "subprocess.run(['echo', 'child'])\n"
        "subprocess.run('echo child-err >&2', shell=True)\n"
        "os.system('echo system')\n"
        "print('end', end='')\n"
    )
    res = kernel.run(code)
    assert res.status == "ok"
    assert res.stdout == "".join(f"{i}\n" for i in range(200)) + "raw\nchild\nsystem\nend"
    assert res.stderr == "".join(f"{-i}\n" for i in range(200)) + "child-err\n"


def test_large_output_arrives_whole_in_small_frames(kernel: Kernel) -> None:
    res = kernel.run("import sys\nsys.stdout.write('x' * 1_000_000)\nn = sys.stderr.write('é€😀' * 100_001)")
    assert res.status == "ok"
    assert res.stdout == "x" * 1_000_000
    assert res.stderr == "é€😀" * 100_001
    assert all(len(o.text) <= 16 * 1024 for o in res.outputs)
    assert len(res.outputs) >= 1_000_000 // (16 * 1024)


def test_utf8_split_across_pipe_reads_is_not_mangled(kernel: Kernel) -> None:
    code = (
        "import os, time\n"
        "os.write(1, b'caf\\xc3')\n"
        "time.sleep(0.2)\n"  # the pump has read and forwarded the first half by now
        "os.write(1, b'\\xa9 \\xf0\\x9f')\n"
        "time.sleep(0.2)\n"
        "n = os.write(1, b'\\x98\\x80 bad:\\xff\\n')\n"
    )
    res = kernel.run(code)
    assert res.stdout == "café 😀 bad:\ufffd\n"
    assert len(res.outputs) >= 2
    # A character cut off by the end of a run is replaced there, never glued to the next run's bytes.
    assert kernel.run("import os\nn = os.write(1, b'cut\\xc3')").stdout == "cut\ufffd"
    assert kernel.run("import os\nn = os.write(1, b'\\xa9ok')").stdout == "\ufffdok"


def test_stdin_is_dev_null_and_cannot_eat_the_next_request(kernel: Kernel) -> None:
    first = kernel.send(
        "import os, sys\n"
        "try:\n"
        "    input('prompt> ')\n"
        "except EOFError:\n"
        "    print('eof')\n"
        "print(repr(sys.stdin.read()), os.read(0, 100))"
    )
    second = kernel.send("print('second')")  # already waiting on the channel while the cell reads stdin
    res = kernel.wait(first)
    assert res.status == "ok", res.stderr
    assert res.stdout == "prompt> eof\n'' b''\n"
    assert kernel.wait(second).stdout == "second\n"


def test_bash_cells_run_in_the_workdir(kernel: Kernel) -> None:
    kernel.run("import os\nos.chdir('/tmp')\nos.environ['FROM_PYTHON'] = 'yes'")
    res = kernel.run('pwd\necho "$FROM_PYTHON"\necho oops >&2\nexit 4', "bash")
    assert (res.status, res.done.exit_code) == ("error", 4)
    assert res.stdout == f"{kernel.workdir}\nyes\n"
    assert res.stderr == "oops\n"
    res = kernel.run("echo 'X = 42' > mymod.py\nread -r line || echo 'stdin: eof'", "bash")
    assert (res.status, res.done.exit_code, res.stdout) == ("ok", 0, "stdin: eof\n")
    assert kernel.run("import mymod\nmymod.X").stdout == "42\n"  # the workdir is first on sys.path
    assert kernel.run("exit 0", "bash").done.exit_code == 0
    assert not list(kernel.workdir.glob("*.sh"))


def test_warnings_show_once_with_their_source_line(kernel: Kernel) -> None:
    res = kernel.run("import warnings\nfor i in range(3):\n    warnings.warn('careful')")
    assert res.stderr.count("UserWarning: careful") == 1
    assert "<cell-1>:3: UserWarning: careful\n  warnings.warn('careful')\n" in res.stderr


def test_interrupting_a_sleep_keeps_the_namespace(kernel: Kernel) -> None:
    kernel.run("x = 41")
    run = kernel.send("import time\nprint('started', flush=True)\ntime.sleep(100)")
    kernel.wait_for_text(run, "started")
    began = time.monotonic()
    kernel.interrupt()
    res = kernel.wait(run, timeout=10)
    assert time.monotonic() - began < 5
    assert (res.status, res.done.exit_code) == ("interrupted", None)
    assert res.stderr.startswith("Traceback (most recent call last):\n")
    # In the sleep, or (the signal checked as print returns, after its output left) on the print line.
    assert re.search(r'File "<cell-\d+>", line [23], in <module>\n', res.stderr), res.stderr
    assert res.stderr.endswith("KeyboardInterrupt\n")
    assert "kernel.py" not in res.stderr
    assert kernel.run("x + 1").stdout == "42\n"


def test_interrupting_a_busy_loop_and_a_cell_that_caught_the_first_one(kernel: Kernel) -> None:
    run = kernel.send("print('started', flush=True)\nwhile True:\n    pass")
    kernel.wait_for_text(run, "started")
    kernel.interrupt()
    assert kernel.wait(run, timeout=10).status == "interrupted"
    run = kernel.send(
        "import time\n"
        "try:\n"
        "    print('started', flush=True)\n"
        "    time.sleep(100)\n"
        "except KeyboardInterrupt:\n"
        "    print('caught', flush=True)\n"
        "while True:\n"
        "    pass"
    )
    kernel.wait_for_text(run, "started")
    kernel.interrupt()
    kernel.wait_for_text(run, "caught")
    kernel.interrupt()  # the cell's own loop is on top: a second interrupt is safe and delivered
    res = kernel.wait(run, timeout=10)
    assert res.status == "interrupted"
    assert kernel.run("print('next')").stdout == "next\n"


def test_sigint_while_idle_or_blocked_by_the_cell_is_harmless(kernel: Kernel) -> None:
    for _ in range(3):
        kernel.interrupt()
    time.sleep(0.2)
    assert kernel.run("print(1)").stdout == "1\n"
    run = kernel.send(
        "import signal, time\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
        "signal.signal(signal.SIGTERM, lambda *a: 1 / 0)\n"
        "print('started', flush=True)\n"
        "time.sleep(0.5)\n"
        "print('finished')"
    )
    kernel.wait_for_text(run, "started")
    kernel.interrupt()  # pending until the kernel unblocks SIGINT after the cell, then ignored
    res = kernel.wait(run)
    assert (res.status, res.stdout) == ("ok", "started\nfinished\n")
    kernel.run("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)")
    run = kernel.send("import time\nprint('started', flush=True)\ntime.sleep(100)")
    kernel.wait_for_text(run, "started")
    kernel.interrupt()  # the kernel put its own handler back after the cell that ignored SIGINT
    assert kernel.wait(run, timeout=10).status == "interrupted"
    assert kernel.run("import signal\nsignal.getsignal(signal.SIGTERM)").stdout == "<Handlers.SIG_DFL: 0>\n"


def test_interrupting_bash(kernel: Kernel) -> None:
    run = kernel.send("echo started\nsleep 100\necho never", "bash")
    kernel.wait_for_text(run, "started")
    began = time.monotonic()
    kernel.interrupt()
    res = kernel.wait(run, timeout=10)
    assert time.monotonic() - began < 1
    assert (res.status, res.done.exit_code, res.stdout) == ("interrupted", 130, "started\n")
    # A script that ignores SIGINT is SIGKILLed about a second later.
    run = kernel.send("trap '' INT\necho started\nsleep 100", "bash")
    kernel.wait_for_text(run, "started")
    began = time.monotonic()
    kernel.interrupt()
    res = kernel.wait(run, timeout=10)
    assert 0.9 < time.monotonic() - began < 5
    assert (res.status, res.done.exit_code) == ("interrupted", 137)
    assert kernel.namespace_pids() == [1]


def test_processes_left_by_a_cell_are_gone_before_the_next_done(kernel: Kernel) -> None:
    res = kernel.run(
        "import os, subprocess, time\n"
        "subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "def count():\n"
        "    return len([p for p in os.listdir('/proc') if p.isdigit()])\n"
        "deadline = time.monotonic() + 10\n"
        "while count() < 3 and time.monotonic() < deadline:\n"  # the grandchild has forked
        "    time.sleep(0.01)\n"
        "print(count())"
    )
    assert res.status == "ok" and int(res.stdout) >= 3
    assert kernel.namespace_pids() == [1]
    res = kernel.run("sleep 1000 &\nsetsid sleep 1000 &\n(sleep 1000 &) &\nsleep 0.2\necho spawned", "bash")
    assert res.stdout == "spawned\n"
    assert kernel.namespace_pids() == [1]
    # And from the host: nothing of the namespace but the kernel itself.
    ns = os.readlink(f"/proc/{kernel.host_pid}/ns/pid")
    members = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{name}/ns/pid") == ns and int(name) != kernel.proc.pid:
                members.append(int(name))
        except OSError:
            pass
    assert members == [kernel.host_pid]


def test_the_resource_tracker_is_spared_and_every_other_leftover_still_goes(kernel: Kernel) -> None:
    # multiprocessing's tracker (and joblib's, the same code) is started once and used from cell to
    # cell: killed with the leftovers, its next use warns and the new one prints a KeyError per
    # resource the old one knew.
    res = kernel.run(
        "import subprocess\n"
        "from multiprocessing import resource_tracker, shared_memory\n"
        "shm = shared_memory.SharedMemory(create=True, size=16)\n"
        "subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
        "print(resource_tracker._resource_tracker._pid)"
    )
    assert res.status == "ok", res.stderr
    tracker = int(res.stdout)
    assert kernel.namespace_pids() == [1, tracker]  # the sleep is gone, the tracker is not
    res = kernel.run("shm.close()\nshm.unlink()\nimport time\ntime.sleep(0.3)\nprint('unlinked')")
    assert (res.status, res.stdout, res.stderr) == ("ok", "unlinked\n", "")
    # A cell that points the pass at a process of its own spares that one alone, and only while the
    # tracker's record says so.
    res = kernel.run(
        "import subprocess\n"
        "keep = subprocess.Popen(['sleep', '1000'])\n"
        "subprocess.Popen(['sleep', '1000'])\n"
        "resource_tracker._resource_tracker._pid = keep.pid\n"
        "print(keep.pid)"
    )
    kept = int(res.stdout)
    assert kernel.namespace_pids() == [1, kept]  # the real tracker, no longer named, went with the rest
    kernel.run("resource_tracker._resource_tracker._pid = None")
    assert kernel.namespace_pids() == [1]


def test_a_forked_child_ends_with_the_cell_and_never_speaks_for_the_kernel(kernel: Kernel) -> None:
    code = (
        "import os\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('in child', flush=True)\n"
        "    {child_end}\n"
        "else:\n"
        "    print('child exit', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    res = kernel.run(code.format(child_end="pass"))  # the child runs off the end of the cell
    assert res.status == "ok"
    assert sorted(res.stdout.splitlines()) == ["child exit 0", "in child"]
    res = kernel.run(code.format(child_end="raise ValueError('boom')"))
    assert "ValueError: boom" in res.stderr and "child exit 1" in res.stdout
    assert kernel.run("print('one kernel')").stdout == "one kernel\n"  # ProtocolState saw one done each


def test_a_child_forked_behind_pythons_back_ends_with_the_cell(kernel: Kernel) -> None:
    # libc's fork through ctypes runs no at-fork hook: the per-cell pid check must catch its child, or
    # it would go on as a second kernel reading and writing the wire.
    res = kernel.run(
        "import ctypes, os\n"
        "pid = ctypes.CDLL(None, use_errno=True).fork()\n"
        "if pid == 0:\n"
        "    os.write(2, b'in child\\n')\n"
        "else:\n"
        "    print('child exit', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    assert res.status == "ok", res
    assert "child exit 0" in res.stdout and "in child" in res.stderr
    for n in range(3):
        assert kernel.run(f"print({n})").stdout == f"{n}\n"
    assert kernel.namespace_pids() == [1]


def test_output_of_a_lingering_thread_waits_for_the_next_run(kernel: Kernel) -> None:
    res = kernel.run(
        "import threading, time\n"
        "def late():\n"
        "    time.sleep(0.3)\n"
        "    print('late', flush=True)\n"
        "threading.Thread(target=late).start()"
    )
    assert res.stdout == ""
    time.sleep(0.6)
    assert select.select([kernel.stdout], [], [], 0)[0] == []  # nothing between a done and a run
    assert kernel.run("print('next')").stdout == "late\nnext\n"


def test_a_thread_writing_on_through_the_end_of_the_run_loses_nothing(kernel: Kernel) -> None:
    # The pipe is not empty when the cell ends: the run ends by a sentinel, not by the quiet check.
    res = kernel.run(
        "import os, threading, time\n"
        "stop = False\n"
        "def ticks():\n"
        "    n = 0\n"
        "    while not stop:\n"
        "        os.write(1, b'tick %d\\n' % n)\n"
        "        n += 1\n"
        "threading.Thread(target=ticks).start()\n"
        "time.sleep(0.2)"
    )
    assert res.status == "ok"
    later = kernel.run("stop = True\nimport time\ntime.sleep(0.1)\nprint('next')")
    lines = (res.stdout + later.stdout).splitlines()
    assert lines[-1] == "next"
    assert lines[:-1] == [f"tick {n}" for n in range(len(lines) - 1)]  # in order, none lost or doubled
    assert res.stdout.endswith("\n") or not res.stdout


def test_interrupting_a_cell_that_prints_without_pause_keeps_the_protocol(kernel: Kernel) -> None:
    # Most interrupts land while the kernel sends a frame of sys.stdout: they wait until it is whole.
    for _ in range(10):
        run = kernel.send("import sys\nprint('started', flush=True)\nwhile True:\n    print('x' * 50)")
        kernel.wait_for_text(run, "started")
        kernel.interrupt()
        res = kernel.wait(run, timeout=10)
        assert res.status == "interrupted"
        assert "KeyboardInterrupt" in res.stderr
        assert set(res.stdout.splitlines()[1:-1]) <= {"x" * 50}
    assert kernel.run("print('alive')").stdout == "alive\n"


def test_a_cell_that_breaks_its_own_stdio_still_gets_its_done(kernel: Kernel) -> None:
    # sys.stdout is the kernel's stream to the host (as in Jupyter), fd 1 the process's.
    res = kernel.run("import os\nos.close(1)\nprint('still shown')\nos.write(1, b'into the void')")
    assert res.status == "error" and "Bad file descriptor" in res.stderr
    assert res.stdout == "still shown\n"
    assert kernel.run("print('back')").stdout.endswith("back\n")
    res = kernel.run("import os\nos.close(2)\nraise ValueError('unseen')")
    assert res.status == "error"
    assert "ValueError: unseen" in res.stderr  # fd 2 is restored before the traceback is written
    assert kernel.run("import io, sys\nsys.stdout = io.StringIO()\nsys.stderr = None").status == "ok"
    assert kernel.run("print('restored')").stdout == "restored\n"
    kernel.run("import sys\nsys.stdout.close()\nsys.stdin.close()")
    assert kernel.run("print('reopened')").stdout == "reopened\n"
    res = kernel.run(
        "import os, subprocess\nos.dup2(os.open('/dev/null', os.O_WRONLY), 1)\nprint('shown')\n"
        "_ = subprocess.run(['echo', 'into /dev/null'])"
    )
    assert res.stdout == "shown\n"
    assert (
        kernel.run("import subprocess\n_ = subprocess.run(['echo', 'fd 1 again'])").stdout == "fd 1 again\n"
    )


def test_process_state_a_cell_leaves_is_undone(kernel: Kernel) -> None:
    res = kernel.run(
        "import signal, sys, threading\n"
        "signal.signal(signal.SIGALRM, lambda *a: 1 / 0)\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.2)\n"  # would fire while the kernel is idle
        "signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGPIPE, signal.SIG_DFL)\n"
        "sys.setrecursionlimit(40)\n"
        "calls = []\n"
        "def trace(*a):\n"
        "    calls.append(a[1])\n"  # runs in the kernel's own code too, until the kernel removes it
        "threading.settrace(trace)\n"
        "sys.setprofile(trace)"
    )
    assert res.status == "ok", res.stderr
    time.sleep(0.4)
    res = kernel.run(
        "import signal, sys\n"
        "print(sys.getrecursionlimit() >= 1000, signal.getsignal(signal.SIGALRM) == signal.SIG_DFL)\n"
        "print(sys.getprofile(), signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN)\n"
        "len(calls) > 0"
    )
    assert res.stdout == "True True\nNone True\nTrue\n"
    assert kernel.run("echo child; exit 5", "bash").done.exit_code == 5  # SIGCHLD is ours again
    assert kernel.run("x = 1  # not hidden;\nx").stdout == "1\n"


def _find_pipe_fd_code(inode: int) -> str:
    return (
        "import os, stat\n"
        "fd = next(fd for fd in range(3, 64)\n"
        "          if os.path.exists(f'/proc/self/fd/{fd}')\n"
        f"          and stat.S_ISFIFO(os.fstat(fd).st_mode) and os.fstat(fd).st_ino == {inode})\n"
    )


def test_a_forged_frame_is_caught_by_the_host(kernel: Kernel) -> None:
    channel = _find_pipe_fd_code(os.fstat(kernel.stdout.fileno()).st_ino)
    # A well-formed forgery for the current run: it cannot be told apart, so the run "ends" early...
    forged = {
        "t": "done",
        "id": 1,
        "status": "ok",
        "exit_code": 0,
        "figures": ["forged.png"],
        "more": 0,
        "ms": 1.0,
    }
    res = kernel.run(
        channel + f"import json, struct\nb = json.dumps({forged!r}).encode()\n"
        "os.write(fd, struct.pack('>I', len(b)) + b)\nprint('after')"
    )
    assert res.done.figures == ("forged.png",)
    # ...and the real done arrives while no run is in flight: a protocol violation.
    with pytest.raises(ProtocolError, match="no run is in flight"):
        kernel.next_message()
    kernel.expect_exit = None


def test_garbage_on_the_channel_is_a_protocol_error(kernel: Kernel) -> None:
    channel = _find_pipe_fd_code(os.fstat(kernel.stdout.fileno()).st_ino)
    run = kernel.send(channel + "os.write(fd, b'\\x00\\x00\\x00\\x05hello')")
    with pytest.raises(ProtocolError, match="not UTF-8 JSON"):
        kernel.wait(run)
    kernel.expect_exit = None


def test_a_cell_closing_the_kernels_private_fd_ends_the_kernel(kernel: Kernel) -> None:
    assert kernel.stdin is not None
    channel = _find_pipe_fd_code(os.fstat(kernel.stdin.fileno()).st_ino)
    # The private fds are checked once "done" is out (off the round trip), before the next request.
    res = kernel.run(channel + "os.close(fd)\nprint('closed', fd)")
    assert res.stdout.startswith("closed")
    run = kernel.send("print('never')")
    with pytest.raises(EOFError):
        kernel.wait(run)
    assert kernel.close() == FATAL_EXIT
    assert "closed or replaced the kernel's private fd" in kernel.diag()
    kernel.expect_exit = None


def test_a_cell_replacing_the_reply_channel_never_gets_its_done(kernel: Kernel) -> None:
    channel = _find_pipe_fd_code(os.fstat(kernel.stdout.fileno()).st_ino)
    run = kernel.send(channel + "os.dup2(os.open('/dev/null', os.O_WRONLY), fd)")
    with pytest.raises(EOFError):  # its "done" went into /dev/null; then the check ends the kernel
        kernel.wait(run)
    assert kernel.close() == FATAL_EXIT
    assert "closed or replaced the kernel's private fd" in kernel.diag()
    kernel.expect_exit = None


def test_os_exit_closes_the_channel(kernel: Kernel) -> None:
    run = kernel.send("import os\nprint('bye', flush=True)\nos._exit(3)")
    with pytest.raises(EOFError):
        kernel.wait(run)
    assert kernel.close() == 3
    kernel.expect_exit = None


def test_figures_are_saved_once_per_change_and_never_overwrite(kernel: Kernel) -> None:
    assert HAS_MATPLOTLIB, "/usr/bin/python3 cannot import matplotlib: ./scripts/setup installs it"
    keep = kernel.workdir / "figure-1.png"
    keep.write_bytes(b"not ours")
    res = kernel.run("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nfig = plt.gcf()")
    assert res.status == "ok", res.stderr
    assert res.done.figures == ("figure-2.png",)
    assert keep.read_bytes() == b"not ours"
    assert (kernel.workdir / "figure-2.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert kernel.run("x = 1").done.figures == ()  # closed at the end of its cell: nothing left to save
    # A figure the cell saved itself is not saved again, unless it changes after; drawing is not changing.
    mine = "plt.plot([1, 1])\nplt.savefig('mine.png')\nplt.gcf().canvas.draw()"
    assert kernel.run(mine).done.figures == ()
    assert (kernel.workdir / "mine.png").exists()
    assert kernel.run("plt.plot([1, 1])\nplt.savefig('mine.png')\nplt.xlabel('x')").done.figures == (
        "figure-3.png",
    )
    res = kernel.run(
        "import os\n"
        "plt.plot([3, 2, 1])\n"
        "plt.show()\n"  # saves now, inside the cell
        "print(sorted(n for n in os.listdir() if n.startswith('figure-')))"
    )
    assert res.stdout == "['figure-1.png', 'figure-2.png', 'figure-3.png', 'figure-4.png']\n"
    assert res.done.figures == ("figure-4.png",)
    res = kernel.run("plt.figure()\nplt.plot([1])\nplt.figure()\nplt.figure()\nplt.title('third')")
    assert res.done.figures == ("figure-5.png", "figure-6.png")  # in creation order; the empty one skipped
    assert kernel.run("plt.close('all')\nplt.show()").done.figures == ()
    # What matplotlib does with fig.stale, for the record (the kernel does not rely on it).
    res = kernel.run("import io\nf = plt.figure()\nplt.plot([1])\nf.savefig(io.BytesIO())\nprint(f.stale)")
    print(f"\nmatplotlib: fig.stale right after savefig = {res.stdout.strip()}")
    assert res.done.figures == ()


def test_each_cell_starts_with_no_figure_as_in_jupyter(kernel: Kernel) -> None:
    """The inline backend's close_figures: a cell's figures are saved, then closed, so a later plt.bar
    draws on a new 2D figure, not on the 3D axes a cell before left; a Figure kept in a variable still
    saves, and shows as a cell's last value."""
    assert HAS_MATPLOTLIB, "/usr/bin/python3 cannot import matplotlib: ./scripts/setup installs it"
    res = kernel.run(SURFACE)
    assert res.status == "ok" and res.done.figures == ("figure-1.png",), res.stderr
    res = kernel.run(
        "bars = plt.bar(['north', 'south', 'east'], [3, 5, 2])\n"
        "print(plt.gca().name, plt.gcf() is fig, plt.get_fignums())"
    )
    assert res.status == "ok", res.stderr
    assert res.stdout == "rectilinear False [1]\n"
    assert res.done.figures == ("figure-2.png",)
    # The kept Figure still works: it saves, and a cell ending with it shows it (not its repr).
    res = kernel.run("fig.savefig('surface.png')\nprint(plt.get_fignums())")
    assert res.stdout == "[]\n" and res.done.figures == ()
    assert (kernel.workdir / "surface.png").read_bytes().startswith(b"\x89PNG")
    res = kernel.run("ax.set_title('again')\nfig")
    assert res.stdout == "" and res.done.figures == ("figure-3.png",), res
    res = kernel.run("fig.suptitle('twice')\nplt.show()\nfig")  # plt.show() cannot show a closed figure
    assert res.done.figures == ("figure-4.png",)
    # "Save it", a cell later, saves the figure last shown (where Jupyter writes an empty image) and
    # opens no new one; once the cell closes a figure itself, plt.savefig() is pyplot's own again.
    res = kernel.run(
        "plt.savefig('again.png')\n"
        "print(plt.get_fignums(), round(plt.imread('again.png')[..., :3].mean(), 2) < 0.99)"
    )
    assert res.stdout == "[] True\n", res.stderr
    res = kernel.run("plt.close('all')\nplt.savefig('blank.png')\nprint(plt.get_fignums())")
    assert res.stdout == "[1]\n" and res.done.figures == ()
    assert kernel.run("plt.figure()").stdout.startswith("<Figure size")  # empty: printed, as in Jupyter


def test_plt_show_saves_and_closes_the_cells_figures_as_in_jupyter(kernel: Kernel) -> None:
    assert HAS_MATPLOTLIB, "/usr/bin/python3 cannot import matplotlib: ./scripts/setup installs it"
    res = kernel.run(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3]); plt.title('first'); plt.show()\n"
        "plt.bar(['a', 'b'], [2, 1]); print(len(plt.gca().lines), plt.gca().get_title() == ''); plt.show()\n"
        "plt.savefig('after_show.png')\n"  # written after show, as scripts do: the bar chart, not a blank
        "print(plt.get_fignums())"
    )
    assert res.status == "ok", res.stderr
    assert res.stdout == "0 True\n[]\n"
    assert res.done.figures == ("figure-1.png", "figure-2.png")
    assert (kernel.workdir / "after_show.png").stat().st_size > 0


def test_startup_and_round_trip_times(tmp_path: Path) -> None:
    plain_times = []
    for i in range(5):
        root = tmp_path / f"plain{i}"
        root.mkdir()
        k = Kernel(root, namespace=False)
        plain_times.append(k.ready_s)
        assert k.run("print(1)").stdout == "1\n"
        assert k.close() == 0
    root = tmp_path / "ns"
    root.mkdir()
    k = Kernel(root)
    try:
        first = time.perf_counter()
        assert k.run("print(1)").stdout == "1\n"
        first_s = time.perf_counter() - first
        times = []
        for _ in range(200):
            began = time.perf_counter()
            res = k.run("print(1)")
            times.append(time.perf_counter() - began)
            assert res.stdout == "1\n"
        bash = []
        for _ in range(20):
            began = time.perf_counter()
            assert k.run("echo 1", "bash").stdout == "1\n"
            bash.append(time.perf_counter() - began)
    finally:
        assert k.close() == 0
    median = statistics.median(times)
    print(
        f"\nkernel startup to ready: plain python3 median {statistics.median(plain_times) * 1000:.1f} ms "
        f"(min {min(plain_times) * 1000:.1f}), under unshare {k.ready_s * 1000:.1f} ms; "
        f"first print(1) {first_s * 1000:.2f} ms; "
        f"print(1) round trip median {median * 1000:.3f} ms (p90 {sorted(times)[179] * 1000:.3f} ms); "
        f"bash echo median {statistics.median(bash) * 1000:.2f} ms"
    )
    assert statistics.median(plain_times) < 1.0
    assert median < 0.02


def test_the_condition_on_thread_locks_times_out_and_wakes_every_waiter() -> None:
    cond = condition._Condition()
    with cond:
        started = time.monotonic()
        assert cond.wait(0.05) is False and time.monotonic() - started >= 0.04
    woken: list[bool] = []

    def waiter() -> None:
        with cond:
            woken.append(cond.wait(10))

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with cond:
            if len(cond._waiters) == 3:
                cond.notify_all()
                break
        time.sleep(0.01)
    for t in threads:
        t.join(5)
    assert woken == [True, True, True]
    assert cond._waiters == []
