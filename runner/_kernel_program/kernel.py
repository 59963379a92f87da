"""The cell loop: the kernel's setup, its requests one at a time, and what ends each run; and main()."""

from __future__ import annotations

import _signal
import _thread
import builtins
import os
import sys
import types

from .bash_cells import _BashCells
from .basics import _READ_SIZE, _fatal, _os_getpid, _os_read, _perf_counter, set_diag_fd
from .charts import _Charts
from .codec import _Channel, _json_loads
from .figures import _Figures
from .hooks import _ImportHooks
from .packages import package_versions
from .protocol import DEFAULT_WORKDIR, MAX_REQUEST, PROTOCOL_VERSION, WORKDIR_ENV
from .pumps import _Direct, _Pump, end_quietly, quiet_poller
from .python_cells import _into_linecache, _PythonCells
from .restore import _Restoring

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn


class Kernel(_PythonCells, _BashCells, _Restoring):
    """The kernel: sets the process up, then runs one request after another until the host closes fd 0."""

    def __init__(self, workdir: str) -> None:
        self.workdir = os.path.abspath(workdir)
        self.pid = _os_getpid()
        self._armed = False  # a SIGINT now interrupts the cell (one shot: the handler disarms)
        self._cell_running = False  # between the start and the end of a Python cell's own code
        self.namespace: dict[str, Any] = {}
        self._inbuf = bytearray()
        self._cell_names: set[str] = set()
        self._bash_dir: str | None = None
        self._bash_count = 0
        self._catchable = [s for s in _signal.valid_signals() if s not in (_signal.SIGKILL, _signal.SIGSTOP)]
        self._recursion_limit = sys.getrecursionlimit()
        self._main_thread = _thread.get_ident()
        self._writing = False  # the main thread is sending a frame of sys.stdout/stderr (_send_direct)
        self._deferred = False  # a SIGINT came meanwhile: raised once the frame is whole
        self._forked = False  # this is a child a cell forked: its prints go through the pipes
        self._print_path = {_Direct.write.__code__, Kernel._send_direct.__code__}

    # -- setup ---------------------------------------------------------------------------------------

    def start(self) -> None:
        # The pumps must never take a SIGINT: a signal delivered to a thread blocked in read() would
        # not wake the main thread's sleep(). Threads inherit the mask, so block before creating them.
        _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})
        self._on_sigint_bound = self._on_sigint
        _signal.signal(_signal.SIGINT, self._on_sigint_bound)
        # os.dup and os.pipe give non-inheritable fds: no child (bash, subprocess) gets the channel.
        self.in_fd = os.dup(0)
        self.out_fd = os.dup(1)
        set_diag_fd(os.dup(2))
        self.null_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        out_r, self.out_w = os.pipe()
        err_r, self.err_w = os.pipe()
        self._restore_fds()  # /dev/null on 0 (input() gets EOF, never protocol bytes), the pipes on 1 and 2
        self.channel = _Channel(self.out_fd)
        self._pumps = (
            _Pump(self.channel.send, out_r, self.out_w, "o"),
            _Pump(self.channel.send, err_r, self.err_w, "e"),
        )
        self._stdin = self._stdout = self._stderr = None
        self._restore_streams()
        self._private_fds = {fd: self._identity(fd) for fd in (self.in_fd, self.out_fd, out_r, err_r)}
        self._private_fds.update({fd: self._identity(fd) for fd in (self.out_w, self.err_w, self.null_fd)})
        self._quiet = quiet_poller(self._pumps)
        for pump in self._pumps:
            pump.start()
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, {_signal.SIGINT})
        os.chdir(self.workdir)
        main_module = types.ModuleType("__main__")
        main_module.__dict__["__builtins__"] = builtins
        self._kernel_module = sys.modules.get("__main__")
        sys.modules["__main__"] = main_module  # pickle finds classes the cells define
        self.namespace = main_module.__dict__
        self._package_paths = list(sys.path[1:])
        sys.path[0:1] = [self.workdir]  # not /run/code: `import mymodule` finds /mnt/data/mymodule.py
        sys.argv = [""]
        self._figures = _Figures(self.workdir, self._note)
        self._charts = _Charts(self.workdir, self._figures, self._note)
        # Cell sources for tracebacks: linecache (with tokenize and re, ~50 ms to import in the
        # sandbox) is filled only once something imports it (a traceback, the code itself).
        self._cell_sources: dict[str, str] = {}
        os.register_at_fork(after_in_child=self._after_fork)
        hooks = {
            "matplotlib.pyplot": self._on_pyplot_import,
            "plotly.io": self._on_plotly_import,
            "linecache": self._on_linecache_import,
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

    def _on_linecache_import(self, module: types.ModuleType) -> None:
        for filename, code in self._cell_sources.items():
            _into_linecache(module, filename, code)
        self._cell_sources.clear()  # from now on _compile puts them straight into linecache

    def _on_pyplot_import(self, module: types.ModuleType) -> None:
        try:
            self._figures.patch(module)
        except Exception as exc:  # never fail the cell's import over our convenience
            self._note(f"[code-sessions: cannot hook plt.show(): {exc!r}]\n")

    def _on_plotly_import(self, module: types.ModuleType) -> None:
        try:
            self._charts.patch(module)
        except Exception as exc:  # never fail the cell's import over our convenience
            self._note(f"[code-sessions: cannot hook fig.show(): {exc!r}]\n")

    def _after_fork(self) -> None:
        self._forked = True  # the pumps (and their locks, maybe held at the fork) are the parent's

    def _send_direct(self, pump: _Pump, data: bytes) -> bool:
        """pump.send_direct, with an interrupt that comes in the middle of the frame raised once the frame
        is whole (a frame cut short would break the protocol, and the kernel with it)."""
        if self._forked:
            return False
        if _thread.get_ident() != self._main_thread:  # only the main thread runs signal handlers
            return pump.send_direct(data)
        self._writing = True
        try:
            sent = pump.send_direct(data)
        finally:
            self._writing = False
        if self._deferred:
            self._armed = self._deferred = False
            raise KeyboardInterrupt
        return sent

    def _on_sigint(self, signum: int, frame: Any) -> None:
        # Idle, or in the kernel's own code after a cell: ignored. Armed: one KeyboardInterrupt, and
        # disarmed first, so a second SIGINT can never raise inside the kernel's own code. A cell that
        # caught it and runs on is interrupted again only where that is safe to tell: while the frame
        # on top is the cell's own code (its globals are the namespace; kernel code never runs there),
        # or the print path's own code outside a frame being sent (_Direct.write, _send_direct: the
        # cell's text is then either not sent yet or sent whole). In the middle of a frame: deferred,
        # and raised by _send_direct once the frame is whole.
        if self._writing:
            if self._armed or self._cell_running:
                self._deferred = True
            return
        if self._armed or (
            self._cell_running
            and frame is not None
            and (frame.f_globals is self.namespace or frame.f_code in self._print_path)
        ):
            self._armed = self._deferred = False
            raise KeyboardInterrupt

    # -- the loop ------------------------------------------------------------------------------------

    def serve(self) -> NoReturn:
        self.channel.send(self.ready_message())
        while True:
            request = self._read_request()
            if request is None:
                self._end_leftovers()
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
        self._deferred = False
        self._figures.saved = []
        self._figures.more = 0
        self._charts.pending = []
        for pump in self._pumps:
            pump.begin(run_id)
        if lang == "python":
            status, exit_code, report = self._run_python(run_id, code)
        else:
            status, exit_code, report = self._run_bash(code)
        self._restore_python_state()
        if report:
            self._note(report)
        pio = sys.modules.get("plotly.io")
        if lang == "python" and pio is not None:
            self._on_plotly_import(pio)  # plotly.io reloaded, or our hook removed: patch again
            try:
                self._armed = True  # a chart's static picture may take long: an interrupt stops it
                self._charts.save_pending()
                self._armed = False
            except KeyboardInterrupt:
                self._armed = False
                self._note("KeyboardInterrupt (while saving charts)\n")
                status, exit_code = "interrupted", None
        pyplot = sys.modules.get("matplotlib.pyplot")
        if lang == "python" and pyplot is not None:
            self._on_pyplot_import(pyplot)  # pyplot reloaded, or our hook removed: patch again
            try:
                self._armed = True  # drawing a huge figure may take long: an interrupt stops it
                self._figures.save_open()
                self._armed = False
            except KeyboardInterrupt:
                self._armed = False
                self._note("KeyboardInterrupt (while saving figures)\n")
                status, exit_code = "interrupted", None
        self._flush_streams()
        self._end_leftovers()
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
