"""The cell loop: the kernel's setup, its requests one at a time, what ends each run and what the process
gets back after it; and main()."""

from __future__ import annotations

import _signal
import builtins
import os
import sys
import types

from .bash_cells import _BashCells
from .basics import _READ_SIZE, _fatal, _os_fstat, _os_getpid, _os_read, _perf_counter, set_diag_fd
from .charts import _Charts
from .codec import _Channel, _json_loads
from .figures import _Figures
from .hooks import _ImportHooks
from .interrupts import _Interrupts
from .leftovers import end_leftovers
from .packages import package_versions
from .protocol import DEFAULT_WORKDIR, MAX_REQUEST, PROTOCOL_VERSION, WORKDIR_ENV
from .pumps import _Pump, end_quietly, quiet_poller
from .python_cells import _PythonCells
from .stdio import _Stdio

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


def _fd_identity(fd: int) -> tuple[int, int]:
    st = _os_fstat(fd)
    return st.st_dev, st.st_ino


class Kernel:
    """The kernel: sets the process up, then runs one request after another until the host closes fd 0,
    putting back after every cell what the kernel needs of the process."""

    def __init__(self, workdir: str) -> None:
        self.workdir = os.path.abspath(workdir)
        self.pid = _os_getpid()
        self._main_module = types.ModuleType("__main__")  # the cells' namespace, installed by start()
        self._main_module.__dict__["__builtins__"] = builtins
        self.namespace: dict[str, Any] = self._main_module.__dict__
        self._interrupts = _Interrupts(self.namespace)
        self._on_sigint = self._interrupts.on_sigint  # one bound method: what getsignal() is compared with
        self._bash = _BashCells(self.workdir, self._interrupts)
        self._inbuf = bytearray()
        self._catchable = [s for s in _signal.valid_signals() if s not in (_signal.SIGKILL, _signal.SIGSTOP)]
        self._recursion_limit = sys.getrecursionlimit()

    # -- setup ---------------------------------------------------------------------------------------

    def start(self) -> None:
        # The pumps must never take a SIGINT: a signal delivered to a thread blocked in read() would
        # not wake the main thread's sleep(). Threads inherit the mask, so block before creating them.
        _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})
        _signal.signal(_signal.SIGINT, self._on_sigint)
        # os.dup and os.pipe give non-inheritable fds: no child (bash, subprocess) gets the channel.
        self.in_fd = os.dup(0)
        self.out_fd = os.dup(1)
        set_diag_fd(os.dup(2))
        null_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.channel = _Channel(self.out_fd)
        self._pumps = (
            _Pump(self.channel.send, out_r, out_w, "o"),
            _Pump(self.channel.send, err_r, err_w, "e"),
        )
        self._stdio = _Stdio(null_fd, out_w, err_w, self._pumps, self._interrupts.send_direct)
        self._stdio.restore_fds()  # /dev/null on 0, the pipes on 1 and 2
        self._stdio.restore_streams()
        private = (self.in_fd, self.out_fd, out_r, err_r, out_w, err_w, null_fd)
        self._private_fds = {fd: _fd_identity(fd) for fd in private}
        self._quiet = quiet_poller(self._pumps)
        for pump in self._pumps:
            pump.start()
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGINT})
        os.chdir(self.workdir)
        self._kernel_module = sys.modules.get("__main__")
        sys.modules["__main__"] = self._main_module  # pickle finds classes the cells define
        self._package_paths = list(sys.path[1:])
        sys.path[0:1] = [self.workdir]  # not /run/code: `import mymodule` finds /mnt/data/mymodule.py
        sys.argv = [""]
        self._figures = _Figures(self.workdir, self._stdio.note)
        self._charts = _Charts(self.workdir, self._figures, self._stdio.note)
        self._python = _PythonCells(
            self.workdir,
            self.pid,
            self.namespace,
            self._interrupts,
            self._charts,
            self._figures,
            self._stdio.live_stdout,
        )
        os.register_at_fork(after_in_child=self._interrupts.after_fork_in_child)
        hooks = {
            "matplotlib.pyplot": self._on_pyplot_import,
            "plotly.io": self._on_plotly_import,
            "linecache": self._python.on_linecache_import,
        }
        sys.meta_path.insert(0, _ImportHooks(hooks))

    def ready_message(self) -> dict[str, Any]:
        return {
            "t": "ready",
            "v": PROTOCOL_VERSION,
            "python": ".".join(map(str, sys.version_info[:3])),
            "pid": self.pid,
            "packages": package_versions(self._package_paths),
        }

    def _on_pyplot_import(self, module: types.ModuleType) -> None:
        try:
            self._figures.patch(module)
        except Exception as exc:  # never fail the cell's import over our convenience
            self._stdio.note(f"[code-sessions: cannot hook plt.show(): {exc!r}]\n")

    def _on_plotly_import(self, module: types.ModuleType) -> None:
        try:
            self._charts.patch(module)
        except Exception as exc:  # never fail the cell's import over our convenience
            self._stdio.note(f"[code-sessions: cannot hook fig.show(): {exc!r}]\n")

    # -- the loop ------------------------------------------------------------------------------------

    def serve(self) -> NoReturn:
        self.channel.send(self.ready_message())
        while True:
            request = self._read_request()
            if request is None:
                end_leftovers(self.pid, self._stdio.note)
                os._exit(0)
            self._run(*request)

    def _read_exact(self, n: int) -> bytes | None:
        while len(self._inbuf) < n:
            chunk = _os_read(self.in_fd, max(_READ_SIZE, n - len(self._inbuf)))
            if not chunk:
                if self._inbuf:
                    _fatal("the host closed the request channel in the middle of a frame")
                return None
            self._inbuf += chunk
        data = bytes(self._inbuf[:n])
        del self._inbuf[:n]
        return data

    def _read_request(self) -> tuple[int, str, str] | None:
        header = self._read_exact(4)
        if header is None:
            return None
        length = int.from_bytes(header, "big")
        if not 0 < length <= MAX_REQUEST:
            _fatal(f"request frame of {length} bytes")
        body = self._read_exact(length)
        if body is None:
            _fatal("the host closed the request channel in the middle of a frame")
        try:
            req = _json_loads(body.decode("utf-8"))
        except ValueError as exc:
            _fatal(f"request is not UTF-8 JSON: {exc}")
        if not (
            type(req) is dict
            and req.keys() == {"t", "id", "lang", "code"}
            and req["t"] == "run"
            and type(req["id"]) is int
            and 0 <= req["id"] < 2**63
            and req["lang"] in ("python", "bash")
            and type(req["code"]) is str
        ):
            _fatal(f"not a run request: {str(req)[:200]}")
        return req["id"], req["lang"], req["code"]

    def _run(self, run_id: int, lang: str, code: str) -> None:
        started = _perf_counter()
        self._interrupts.begin_run()
        self._figures.begin_run()
        self._charts.pending = []
        for pump in self._pumps:
            pump.begin(run_id)
        if lang == "python":
            status, exit_code, report = self._python.run(run_id, code)
        else:
            status, exit_code, report = self._bash.run(code)
        self._restore_python_state()
        if report:
            self._stdio.note(report)
        pio = sys.modules.get("plotly.io")
        if lang == "python" and pio is not None:
            self._on_plotly_import(pio)  # plotly.io reloaded, or our hook removed: patch again
            try:
                self._interrupts.armed = True  # a chart's static picture may take long: an interrupt stops it
                self._charts.save_pending()
                self._interrupts.armed = False
            except KeyboardInterrupt:
                self._interrupts.armed = False
                self._stdio.note("KeyboardInterrupt (while saving charts)\n")
                status, exit_code = "interrupted", None
        pyplot = sys.modules.get("matplotlib.pyplot")
        if lang == "python" and (pyplot is not None or self._figures.pending):
            if pyplot is not None:
                self._on_pyplot_import(pyplot)  # pyplot reloaded, or our hook removed: patch again
            try:
                self._interrupts.armed = True  # drawing a huge figure may take long: an interrupt stops it
                self._figures.save()
                self._interrupts.armed = False
            except KeyboardInterrupt:
                self._interrupts.armed = False
                self._stdio.note("KeyboardInterrupt (while saving figures)\n")
                status, exit_code = "interrupted", None
            self._figures.close()  # as Jupyter's inline backend: the next cell starts with no figure
        self._stdio.flush()
        end_leftovers(self.pid, self._stdio.note)
        if not end_quietly(self._pumps, self._quiet):
            sentinel = b"\x00code-sessions:" + os.urandom(16).hex().encode() + b"\x00"
            for pump in self._pumps:
                pump.drain(sentinel)
            for pump in self._pumps:
                pump.wait_drained()
        self.channel.send(
            {
                "t": "done",
                "id": run_id,
                "status": status,
                "exit_code": exit_code,
                "figures": list(self._figures.saved),
                "more": self._figures.more,
                "ms": round((_perf_counter() - started) * 1000, 3),
            }
        )
        # What the next cell needs, not this run's answer: after "done", while the host takes it in. A
        # private fd a cell closed or replaced ends the kernel here, before it reads another request
        # (the reply channel too: a "done" written elsewhere never reached the host, whose run then
        # ends with the kernel).
        self._restore_process_state()
        self._check_private_fds()

    # -- after every cell: what the kernel needs of the process ---------------------------------------

    def _restore_python_state(self) -> None:
        """Right after a cell, before anything of the kernel's own runs: what a cell may have done to the
        interpreter that could break the kernel's code (sys.std*, signal handlers: a Python handler
        left by a cell could raise inside it; trace and profile hooks; the recursion limit). No
        system call unless the cell changed a handler."""
        self._stdio.restore_streams()
        sys.settrace(None)
        sys.setprofile(None)
        if sys.getrecursionlimit() < self._recursion_limit:  # the kernel's own code needs some depth
            sys.setrecursionlimit(self._recursion_limit)
        threading = sys.modules.get("threading")  # hooks for the threads a cell starts, if it can
        if threading is not None:
            threading.settrace(None)
            threading.setprofile(None)
        # _signal, not signal: the latter wraps every answer in an enum, 50 µs for the loop instead of 5.
        getsignal, setsignal = _signal.getsignal, _signal.signal
        for sig in self._catchable:
            handler = getsignal(sig)
            if callable(handler) and handler is not self._on_sigint:
                setsignal(sig, _signal.SIG_DFL)
        if getsignal(_signal.SIGINT) is not self._on_sigint:
            setsignal(_signal.SIGINT, self._on_sigint)
        if getsignal(_signal.SIGCHLD) != _signal.SIG_DFL:  # SIG_IGN would reap children before our waitpid
            setsignal(_signal.SIGCHLD, _signal.SIG_DFL)
        for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # as Python starts: errors, not deaths
            if getsignal(sig) != _signal.SIG_IGN:
                setsignal(sig, _signal.SIG_IGN)

    def _restore_process_state(self) -> None:
        """What the next cell needs of the process: fd 0/1/2 (a cell may have closed or redirected
        them), no timer left armed (its signal's default action would end the kernel between cells),
        no signal blocked. Done after "done" is sent: seven system calls off the round trip, before
        the next request is read."""
        for which in (_signal.ITIMER_REAL, _signal.ITIMER_VIRTUAL, _signal.ITIMER_PROF):
            _signal.setitimer(which, 0)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
        self._stdio.restore_fds()

    def _check_private_fds(self) -> None:
        for fd, identity in self._private_fds.items():
            try:
                same = _fd_identity(fd) == identity
            except OSError:
                same = False
            if not same:
                _fatal(f"a cell closed or replaced the kernel's private fd {fd}")


def main() -> None:
    try:
        kernel = Kernel(os.environ.get(WORKDIR_ENV) or DEFAULT_WORKDIR)
        kernel.start()
        kernel.serve()
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback

        _fatal("".join(traceback.format_exception(exc)).rstrip())


if __name__ == "__main__":
    main()
