"""The persistent kernel: PID 1 of a chat's long-lived gVisor sandbox, running every cell of the chat.

The host writes this module's source (``inspect.getsource``) into the sandbox as /run/code/main.py and
starts ``python3 /run/code/main.py`` with cwd /mnt/data. Importing the module does nothing: everything
happens in ``main()``. Standard library only, and no imports of the runner package: the file stands alone.

Wire, both directions: a frame is a 4-byte big-endian length N, then N bytes of UTF-8 JSON encoding one
object. Requests arrive on the original fd 0; replies leave on the original fd 1:

    host -> kernel   {"t": "run", "id": int, "lang": "python" | "bash", "code": str}    EOF: exit 0
    kernel -> host   {"t": "ready", "v": 2, "python": "3.11.2", "pid": int, "packages": {name: version|null}}
                     {"t": "out", "id": int, "s": "o" | "e", "d": str (at most 16384 characters)}
                     {"t": "done", "id": int, "status": "ok" | "error" | "interrupted",
                      "exit_code": int | null, "figures": [str], "more": int, "ms": float}
                     ("more": figures left open past MAX_FIGURES_PER_RUN, not saved)

One run at a time; every "out" of a run precedes its "done"; nothing is written between a "done" and the
next request. The host's strict decoder is runner/_wire.py. The cell runs inside this process, so it can
write anything to the reply channel: the host must treat every frame as hostile.
"""

from __future__ import annotations

import _ast
import _json
import _signal
import _thread
import builtins
import codecs
import contextlib
import functools
import os
import sys
import time
import types
from _json import encode_basestring as _json_string  # the C escaper json itself uses

# Startup and the first cell are on the critical path of a new chat, and imports are slow in the
# sandbox (measured in gVisor: re 34 ms, json 24 ms on top, linecache 11-21 ms, traceback 11 ms,
# threading 5-21 ms, signal with enum 7-11 ms, struct 3-7 ms). So: annotations are strings here;
# requests are decoded by json's C scanner without the json package (which needs re), and replies
# are encoded below; signals go through the builtin _signal, threads and locks through _thread, frame
# lengths through int.to_bytes; linecache and traceback wait until they are needed. (site has
# already imported contextlib, functools and types.)
TYPE_CHECKING = False
if TYPE_CHECKING:
    import importlib.machinery
    import weakref
    from collections.abc import Callable
    from typing import Any, NoReturn

PROTOCOL_VERSION = 2
MAX_TEXT = 16 * 1024  # characters of text per "out" frame (the host refuses more)
MAX_REQUEST = 64 * 1024 * 1024  # bytes of one request frame (the code of one cell)
# The one bound on a run's figures: saved and shown (the host's wire refuses a "done" listing more).
# The rest are counted ("more"), never saved later: they belong to this run's answer, not the next.
MAX_FIGURES_PER_RUN = 20
DEFAULT_WORKDIR = "/mnt/data"
WORKDIR_ENV = "CODE_SESSIONS_WORKDIR"
PACKAGES = {  # import name -> distribution name as its metadata directory spells it (lowercased)
    "numpy": "numpy",
    "pandas": "pandas",
    "matplotlib": "matplotlib",
    "openpyxl": "openpyxl",
    "PIL": "pillow",
    "scipy": "scipy",
}
BASH = "/bin/bash"
PRIVATE_TMP = "/tmp"
FATAL_EXIT = 70  # EX_SOFTWARE: the kernel itself failed; the host restarts it

_READ_SIZE = 64 * 1024
_HELD_CAP = 1024 * 1024  # output written between runs, kept for the next run; the rest is dropped
_SENTINEL_STALL_S = 5.0  # no byte and no sentinel for this long after draining began: the pipe was tampered
_KILL_PATIENCE_S = 5.0  # SIGKILLed leftovers are normally gone within a millisecond
_BASH_SIGINT_GRACE_S = 1.0
_STDIO = {"encoding": "utf-8", "errors": "backslashreplace"}

# Bound once: a cell may monkeypatch os or time (a test double, a careless experiment) without
# breaking the kernel's own I/O. Nothing defends the kernel against a cell that wants to break it.
_os_read = os.read
_os_write = os.write
_os_dup2 = os.dup2
_os_kill = os.kill
_os_waitpid = os.waitpid
_os_getpid = os.getpid
_os_fstat = os.fstat
_monotonic = time.monotonic
_perf_counter = time.perf_counter
# Frames of this file are kernel frames: hidden from the cell's tracebacks.
_KERNEL_SOURCE = (lambda: None).__code__.co_filename

_diag_fd = 2  # the original fd 2 once main() has set up; only the kernel's own fatal errors go there


def _fatal(message: str) -> NoReturn:
    """End the kernel: a frame it cannot vouch for is worse than none (the host restarts it)."""
    try:
        _os_write(_diag_fd, f"code-sessions kernel: fatal: {message}\n".encode(errors="replace"))
    finally:
        os._exit(FATAL_EXIT)


def to_json(value: object) -> str:
    """Compact JSON for the kernel's own replies (str, int, float, None, bool, list, tuple, dict)."""
    if type(value) is str:
        return _json_string(value)
    if value is None or value is True or value is False:
        return "null" if value is None else "true" if value else "false"
    if type(value) is int:
        return int.__repr__(value)
    if type(value) is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError("JSON has no NaN or infinity")
        return float.__repr__(value)
    if type(value) is dict:
        return "{" + ",".join(_json_string(k) + ":" + to_json(v) for k, v in value.items()) + "}"
    if type(value) in (list, tuple):
        return "[" + ",".join(map(to_json, value)) + "]"  # type: ignore[call-overload]
    raise TypeError(f"cannot encode {type(value).__name__}")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[_os_write(fd, view) :]


class _Condition:
    """threading.Condition's `with`, wait(timeout) and notify_all(), on _thread's locks."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._waiters: list[Any] = []

    def __enter__(self) -> _Condition:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Called holding the lock; gives it up until notified (or the timeout), then takes it back."""
        waiter = _thread.allocate_lock()
        waiter.acquire()
        self._waiters.append(waiter)
        self._lock.release()
        got = False
        try:
            got = waiter.acquire(True, -1 if timeout is None else timeout)
        finally:
            self._lock.acquire()
            if not got and waiter in self._waiters:
                self._waiters.remove(waiter)
        return got

    def notify_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.release()


class _Channel:
    """The reply channel: whole frames, one writer at a time (the pumps and the main thread share it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = _thread.allocate_lock()

    def send(self, message: dict[str, Any]) -> None:
        body = to_json(message).encode("utf-8")
        frame = len(body).to_bytes(4, "big") + body
        try:
            with self._lock:
                _write_all(self.fd, frame)
        except OSError as exc:  # the host went away, or a cell closed the channel: nobody to answer
            _fatal(f"cannot write to the host: {exc}")


def _sentinel_prefix_start(buf: bytes, sentinel: bytes) -> int:
    """Where a tail of ``buf`` that could begin ``sentinel`` starts (len(buf) if none): those bytes wait
    for the next read instead of being forwarded, so a sentinel split across reads is still found."""
    first = sentinel[:1]
    pos = buf.find(first, max(0, len(buf) - len(sentinel) + 1))
    while pos != -1:
        if sentinel.startswith(buf[pos:]):
            return pos
        pos = buf.find(first, pos + 1)
    return len(buf)


class _Pump:
    """Forwards one of the cell's output pipes (fd 1 or fd 2) to the host as "out" frames.

    End of a run: the main thread writes a fresh random sentinel into the pipe; the pump forwards
    everything before it, then reports. Only then does the main thread send "done", so every byte the
    cell (or its children) wrote comes before it. Bytes after the sentinel are held for the next run,
    and the pump stops reading until then (a writer left running blocks on the full pipe instead of
    filling memory), but never before the sentinel's write has completed: a forged sentinel seen early
    cannot leave the main thread blocked writing the real one into a pipe nobody reads."""

    def __init__(self, send: Callable[[dict[str, Any]], None], read_fd: int, write_fd: int, tag: str) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd  # the kernel's own write end: the sentinel gets in even if fd 1 is gone
        self._send = send
        self._tag = tag
        self._cond = _Condition()
        self._run_id = 0
        self._sentinel: bytes | None = None
        self._seen = True  # idle until the first run: nothing is forwarded
        self._written = True
        self._held = bytearray()
        self._held_cut = False
        self._carry = b""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._busy = False  # blocked writing a frame: a slow host, not a lost sentinel
        self._activity = _monotonic()
        self._drain_started = 0.0
        self.running = False  # the pump thread is between start() and its end

    # -- main thread ---------------------------------------------------------------------------------

    def begin(self, run_id: int) -> None:
        with self._cond:
            self._run_id = run_id
            self._sentinel = None
            self._seen = False
            self._written = False
            self._cond.notify_all()

    def drain(self, sentinel: bytes) -> None:
        with self._cond:
            self._sentinel = sentinel
            self._drain_started = _monotonic()
        # Shorter than PIPE_BUF, so the pipe takes it whole; blocks only while the pump still reads.
        _write_all(self.write_fd, sentinel)
        with self._cond:
            self._written = True
            self._cond.notify_all()

    def wait_drained(self) -> None:
        with self._cond:
            while not self._seen:
                self._cond.wait(0.25)
                if self._seen:
                    break
                if not self.running:
                    _fatal(f"the {self._tag} pump is gone")
                quiet = _monotonic() - max(self._activity, self._drain_started)
                if not self._busy and quiet > _SENTINEL_STALL_S:
                    _fatal(f"the sentinel never came back through the {self._tag} pipe")

    # -- pump thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        self.running = True
        _thread.start_new_thread(self._main, ())

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a pump that stops would make "done" lie or never come
            _fatal(f"the {self._tag} pump failed: {exc!r}")
        finally:
            self.running = False

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._seen and self._written:
                    self._cond.wait()
            self.take(b"")  # bytes held since the last run go first
            data = _os_read(self.read_fd, _READ_SIZE)
            if not data:
                _fatal(f"the {self._tag} pipe was closed")
            self._activity = _monotonic()
            self.take(data)

    def take(self, data: bytes) -> None:
        """Account for bytes read from the pipe (split out of the loop so tests can drive it)."""
        with self._cond:
            if self._seen:
                self._hold(data)
                return
            run_id, sentinel = self._run_id, self._sentinel
            if self._held:
                data = bytes(self._held) + data
                self._held.clear()
                self._held_cut = False
        if sentinel is None:
            self._forward(run_id, data)
            return
        buf = self._carry + data if self._carry else data
        at = buf.find(sentinel)
        if at < 0:
            keep = _sentinel_prefix_start(buf, sentinel)
            self._carry = buf[keep:]
            self._forward(run_id, buf[:keep])
            return
        self._carry = b""
        self._forward(run_id, buf[:at], final=True)
        with self._cond:
            self._seen = True
            self._hold(buf[at + len(sentinel) :])
            self._cond.notify_all()

    def _hold(self, data: bytes) -> None:
        room = _HELD_CAP - len(self._held)
        if len(data) <= room:
            self._held += data
            return
        self._held += data[: max(room, 0)]
        if not self._held_cut:
            self._held_cut = True
            self._held += b"\n[code-sessions: output written between runs was cut here]\n"

    def _forward(self, run_id: int, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        if final:
            self._decoder.reset()  # a character cut at the end of a run never joins the next run's bytes
        for start in range(0, len(text), MAX_TEXT):
            self._busy = True
            try:
                self._send({"t": "out", "id": run_id, "s": self._tag, "d": text[start : start + MAX_TEXT]})
            finally:
                self._busy = False
                self._activity = _monotonic()


_VERSION_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+!")


def _is_version(text: str) -> bool:
    return 0 < len(text) <= 64 and text[0].isascii() and text[0].isalnum() and _VERSION_CHARS.issuperset(text)


def package_versions(paths: list[str]) -> dict[str, str | None]:
    """Versions of PACKAGES from the names of their metadata directories on ``paths``, first hit wins
    as for import. Listing a few directories costs well under a millisecond; importlib.metadata costs
    tens of milliseconds to import, and importing the packages themselves, seconds."""
    wanted = {dist: name for name, dist in PACKAGES.items()}
    found: dict[str, str] = {}
    for entry in paths:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for item in names:
            if not item.endswith((".dist-info", ".egg-info")):
                continue
            parts = item[: item.rindex(".")].split("-")
            name = wanted.get(parts[0].lower())
            # A version is a short run of safe characters; anything else (a name that is not UTF-8
            # comes back with surrogates) would make the host refuse the whole "ready".
            if name is not None and len(parts) >= 2 and name not in found and _is_version(parts[1]):
                found[name] = parts[1]
    return {name: found.get(name) for name in PACKAGES}


class _JsonContext:
    """What json's C scanner reads from a decoder: json.loads' defaults, and no NaN or Infinity."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> NoReturn:
        raise ValueError(f"{name} is not JSON")


_scan_json = _json.make_scanner(_JsonContext())


def _json_loads(text: str) -> Any:
    """json.loads for one request frame: a whole JSON value and nothing after it."""
    try:
        value, end = _scan_json(text, 0)
    except StopIteration as exc:
        raise ValueError(f"no JSON value at {exc.value}") from None
    if end != len(text):
        raise ValueError(f"extra data at {end}")
    return value


class _PatchingLoader:
    """Wraps the loader of a watched module so the kernel can patch it as it is imported."""

    def __init__(self, inner: Any, on_import: Callable[[types.ModuleType], None]) -> None:
        self._inner = inner
        self._on_import = on_import

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        create = getattr(self._inner, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        self._on_import(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for inspect and linecache
        return getattr(self._inner, name)


class _ImportHooks:
    """A meta path hook that sees only the modules it is given, each with what to do once it is
    imported: matplotlib.pyplot (plt.show() must save figures from the very cell that first imports
    it) and linecache (filled with the cells' sources when something first needs it). Costs one dict
    lookup per import of anything else."""

    def __init__(self, hooks: dict[str, Callable[[types.ModuleType], None]]) -> None:
        self._hooks = hooks

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        on_import = self._hooks.get(fullname)
        if on_import is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, on_import)
                return spec
        return None


class _Figures:
    """Saves pyplot's open figures that are new or changed into the workdir as figure-N.png.

    ``fig.stale`` cannot tell: matplotlib 3.6 leaves it True after savefig (it restores dpi and colours
    afterwards), and a cell's own ``canvas.draw()`` makes it False without any save. Instead: every
    savefig (ours or the cell's) marks the figure clean, and a wrapper on the figure's stale_callback,
    to which matplotlib reports every change of every artist in it, marks it dirty again. Drawing
    (which savefig does) also reports changes (ticks, layout): those are not the cell's and are
    ignored, by muting the wrapper while a Figure draws or saves."""

    def __init__(self, workdir: str, stderr: Callable[[str], None]) -> None:
        self._workdir = workdir
        self._note = stderr
        self._clean: weakref.WeakKeyDictionary[Any, bool] | None = None  # made when pyplot is imported
        self._muted = 0
        self._next = 1
        self.saved: list[str] = []  # this run's, in order
        self.more = 0  # this run's figures past MAX_FIGURES_PER_RUN: counted, not saved

    def patch(self, pyplot: types.ModuleType) -> None:
        """Make plt.show() save now and every savefig count as a save. Idempotent (also after a reload)."""
        if self._clean is None:
            import weakref

            self._clean = weakref.WeakKeyDictionary()
        if not getattr(pyplot.show, "_code_sessions", False):

            def show(*args: Any, **kwargs: Any) -> None:
                """The sandbox has no display: save new or changed figures now. They stay open."""
                self.save_open()

            show._code_sessions = True  # type: ignore[attr-defined]
            pyplot.show = show  # type: ignore[attr-defined]
        figure_class = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
        if figure_class is None:
            return
        for method, marks_clean in (("savefig", True), ("draw", False)):
            original = getattr(figure_class, method)
            if not getattr(original, "_code_sessions", False):
                setattr(figure_class, method, self._muting(original, marks_clean))

    def _muting(self, original: Callable[..., Any], marks_clean: bool) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(fig: Any, *args: Any, **kwargs: Any) -> Any:
            self._muted += 1
            try:
                result = original(fig, *args, **kwargs)
            finally:
                self._muted -= 1
            if marks_clean:
                self._mark_clean(fig)
            return result

        wrapper._code_sessions = True  # type: ignore[attr-defined]
        return wrapper

    def _mark_clean(self, fig: Any) -> None:
        assert self._clean is not None
        self._clean[fig] = True
        inner = getattr(fig, "stale_callback", None)
        if getattr(inner, "_code_sessions", False):
            return

        def stale_callback(artist: Any, value: bool) -> None:
            if value and not self._muted:
                self._clean[artist] = False
            if inner is not None:
                inner(artist, value)

        stale_callback._code_sessions = True  # type: ignore[attr-defined]
        fig.stale_callback = stale_callback

    def save_open(self) -> None:
        helpers = sys.modules.get("matplotlib._pylab_helpers")
        if helpers is None or self._clean is None:
            return
        managers = list(helpers.Gcf.get_all_fig_managers())
        with contextlib.suppress(TypeError):  # creation order: figure 1 becomes the first file
            managers.sort(key=lambda m: m.num)
        for manager in managers:
            fig = getattr(getattr(manager, "canvas", None), "figure", None)
            if fig is None or self._clean.get(fig) or not _has_content(fig):
                continue
            if len(self.saved) >= MAX_FIGURES_PER_RUN:
                # Counted for this run's answer, and taken as seen: a later run saves it only if it
                # changes again, never as a leftover of this one.
                self.more += 1
                self._mark_clean(fig)
                continue
            name = self._save(fig)
            if name is not None:
                self.saved.append(name)

    def _save(self, fig: Any) -> str | None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        while True:
            name = f"figure-{self._next}.png"
            path = os.path.join(self._workdir, name)
            try:
                fd = os.open(path, flags, 0o644)  # O_EXCL: an existing file (or link) is never touched
                break
            except FileExistsError:
                self._next += 1
            except OSError as exc:
                self._note(f"[code-sessions: cannot save the figure as {name}: {exc}]\n")
                return None
        self._next += 1
        try:
            with os.fdopen(fd, "wb") as file:
                fig.savefig(file, format="png", bbox_inches="tight")
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            if not isinstance(exc, Exception):
                raise
            self._note(f"[code-sessions: cannot save the figure as {name}: {exc!r}]\n")
            return None
        self._mark_clean(fig)
        return name


def _has_content(fig: Any) -> bool:
    """An empty plt.figure() is not worth a file."""
    try:
        return any(
            getattr(fig, attr, None)
            for attr in ("axes", "images", "texts", "lines", "patches", "artists", "legends", "subfigs")
        )
    except Exception:
        return True


def _strip_kernel_frames(te: Any, seen: set[int]) -> None:
    """Drop this file's frames (the exec call, the SIGINT handler) from a TracebackException tree."""
    import traceback

    if id(te) in seen:
        return
    seen.add(id(te))
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != _KERNEL_SOURCE])
    for sub in (te.__cause__, te.__context__, *(getattr(te, "exceptions", None) or ())):
        if sub is not None:
            _strip_kernel_frames(sub, seen)


def format_cell_exception(exc: BaseException) -> str:
    import traceback

    try:
        te = traceback.TracebackException(type(exc), exc, exc.__traceback__, compact=True)
        _strip_kernel_frames(te, set())
        return "".join(te.format())
    except Exception as failure:  # a hostile exception object must not take the kernel down
        return f"{type(exc).__name__} (the traceback could not be formatted: {failure!r})\n"


def _ends_with_semicolon(code: str, node: Any) -> bool:
    """``x;`` as the last statement hides its value, as in IPython (a ``;`` in a comment does not)."""
    lines = code.splitlines()
    if node.end_lineno is None or node.end_lineno > len(lines):
        return False
    rest = lines[node.end_lineno - 1].encode("utf-8", "surrogateescape")[node.end_col_offset :]
    return rest.lstrip().startswith(b";")  # ast counts columns in UTF-8 bytes


def _exit_code_of(code: object) -> tuple[int, str | None]:
    """What ``python3 cell.py`` would exit with, and the message it would print, for SystemExit(code)."""
    if code is None:
        return 0, None
    if isinstance(code, int):
        return code & 0xFF, None
    try:
        return 1, str(code)
    except Exception:
        return 1, None


def _into_linecache(linecache: types.ModuleType, filename: str, code: str) -> None:
    """A cell's source where tracebacks look (no mtime: linecache.checkcache leaves it alone)."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)


class Kernel:
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

    # -- setup ---------------------------------------------------------------------------------------

    def start(self) -> None:
        global _diag_fd
        # The pumps must never take a SIGINT: a signal delivered to a thread blocked in read() would
        # not wake the main thread's sleep(). Threads inherit the mask, so block before creating them.
        _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})
        self._on_sigint_bound = self._on_sigint
        _signal.signal(_signal.SIGINT, self._on_sigint_bound)
        # os.dup and os.pipe give non-inheritable fds: no child (bash, subprocess) gets the channel.
        self.in_fd = os.dup(0)
        self.out_fd = os.dup(1)
        _diag_fd = os.dup(2)
        self.null_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        out_r, self.out_w = os.pipe()
        err_r, self.err_w = os.pipe()
        self._restore_fds()  # /dev/null on 0 (input() gets EOF, never protocol bytes), the pipes on 1 and 2
        self._stdin = self._stdout = self._stderr = None
        self._restore_streams()
        self._private_fds = {fd: self._identity(fd) for fd in (self.in_fd, self.out_fd, out_r, err_r)}
        self._private_fds.update({fd: self._identity(fd) for fd in (self.out_w, self.err_w, self.null_fd)})
        self.channel = _Channel(self.out_fd)
        self._pumps = (
            _Pump(self.channel.send, out_r, self.out_w, "o"),
            _Pump(self.channel.send, err_r, self.err_w, "e"),
        )
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
        # Cell sources for tracebacks: linecache (with tokenize and re, ~50 ms to import in the
        # sandbox) is filled only once something imports it (a traceback, the code itself).
        self._cell_sources: dict[str, str] = {}
        hooks = {"matplotlib.pyplot": self._on_pyplot_import, "linecache": self._on_linecache_import}
        sys.meta_path.insert(0, _ImportHooks(hooks))

    def ready_message(self) -> dict[str, Any]:
        return {
            "t": "ready",
            "v": PROTOCOL_VERSION,
            "python": ".".join(map(str, sys.version_info[:3])),
            "pid": self.pid,
            "packages": package_versions(self._package_paths),
        }

    @staticmethod
    def _identity(fd: int) -> tuple[int, int]:
        st = _os_fstat(fd)
        return st.st_dev, st.st_ino

    def _restore_fds(self) -> None:
        _os_dup2(self.null_fd, 0)
        _os_dup2(self.out_w, 1)
        _os_dup2(self.err_w, 2)

    def _restore_streams(self) -> None:
        """Our stdio objects back in sys (recreated if a cell closed them); closefd=False, so closing
        them never closes fd 0/1/2."""
        if self._stdin is None or self._stdin.closed:
            self._stdin = open(0, closefd=False, **_STDIO)  # noqa: SIM115
        if self._stdout is None or self._stdout.closed:
            self._stdout = open(1, "w", buffering=1, closefd=False, **_STDIO)  # noqa: SIM115
        if self._stderr is None or self._stderr.closed:
            self._stderr = open(2, "w", buffering=1, closefd=False, **_STDIO)  # noqa: SIM115
        sys.stdin = sys.__stdin__ = self._stdin
        sys.stdout = sys.__stdout__ = self._stdout
        sys.stderr = sys.__stderr__ = self._stderr

    def _note(self, text: str) -> None:
        """The kernel's own words (a traceback, a notice) on the cell's stderr. Written after the cell's
        damage to fd 2 and sys.stderr is undone; from inside a cell (plt.show()) it may find fd 2 closed
        by the cell, and then the notice is lost rather than the kernel."""
        with contextlib.suppress(Exception):
            if self._stderr is None or self._stderr.closed:
                self._restore_streams()
            self._stderr.write(text)

    def _live_stdout(self) -> Any:
        if self._stdout is None or self._stdout.closed:
            self._restore_streams()
        return self._stdout

    def _on_linecache_import(self, module: types.ModuleType) -> None:
        for filename, code in self._cell_sources.items():
            _into_linecache(module, filename, code)
        self._cell_sources.clear()  # from now on _compile puts them straight into linecache

    def _on_pyplot_import(self, module: types.ModuleType) -> None:
        try:
            self._figures.patch(module)
        except Exception as exc:  # never fail the cell's import over our convenience
            self._note(f"[code-sessions: cannot hook plt.show(): {exc!r}]\n")

    def _on_sigint(self, signum: int, frame: Any) -> None:
        # Idle, or in the kernel's own code after a cell: ignored. Armed: one KeyboardInterrupt, and
        # disarmed first, so a second SIGINT can never raise inside the kernel's own code. A cell that
        # caught it and runs on is interrupted again only where that is safe to tell: while the frame
        # on top is the cell's own code (its globals are the namespace; kernel code never runs there).
        if self._armed or (self._cell_running and frame is not None and frame.f_globals is self.namespace):
            self._armed = False
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
        self._figures.saved = []
        self._figures.more = 0
        for pump in self._pumps:
            pump.begin(run_id)
        if lang == "python":
            status, exit_code, report = self._run_python(run_id, code)
        else:
            status, exit_code, report = self._run_bash(code)
        self._restore_process_state()
        if report:
            self._note(report)
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
        self._check_private_fds()
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

    # -- python --------------------------------------------------------------------------------------

    def _cell_filename(self, run_id: int) -> str:
        name = f"<cell-{run_id}>"
        n = 1
        while name in self._cell_names:  # the host reused an id: keep the old cell's source lines
            n += 1
            name = f"<cell-{run_id}.{n}>"
        self._cell_names.add(name)
        return name

    def _compile(self, run_id: int, code: str) -> tuple[Any, Any]:
        """(statements, last expression or None), IPython style: a last expression statement is
        evaluated apart so its value can be shown."""
        filename = self._cell_filename(run_id)
        linecache = sys.modules.get("linecache")
        if linecache is not None:
            _into_linecache(linecache, filename, code)
        else:
            self._cell_sources[filename] = code
        # The builtin _ast, not the ast module (a few ms more to import in the sandbox): the same nodes.
        tree = compile(code, filename, "exec", _ast.PyCF_ONLY_AST, dont_inherit=True)
        last = None
        final = tree.body[-1] if tree.body else None
        if isinstance(final, _ast.Expr) and not _ends_with_semicolon(code, final):
            last = compile(_ast.Expression(tree.body.pop().value), filename, "eval", dont_inherit=True)
        return compile(tree, filename, "exec", dont_inherit=True), last

    def _run_python(self, run_id: int, code: str) -> tuple[str, int | None, str]:
        """(status, exit code, what to print on stderr once the cell's stdio damage is undone)."""
        # A module the previous cell wrote into the workdir must be importable now, even within the
        # granularity of the directory's mtime, by which the import system notices new files.
        finder = sys.path_importer_cache.get(self.workdir)
        if finder is not None and hasattr(finder, "invalidate_caches"):
            finder.invalidate_caches()
        try:
            body, last = self._compile(run_id, code)
        except Exception as exc:  # SyntaxError, ValueError (NUL bytes), RecursionError (deep nesting)
            import traceback

            return "error", 1, "".join(traceback.format_exception_only(type(exc), exc))
        ns = self.namespace
        failure: BaseException | None = None
        message: str | None = None
        try:
            self._armed = self._cell_running = True
            exec(body, ns)
            if last is not None:
                value = eval(last, ns)
                if value is not None:
                    ns["_"] = value
                    self._live_stdout().write(repr(value) + "\n")
            self._armed = self._cell_running = False
            status, exit_code = "ok", 0
        except KeyboardInterrupt as exc:
            self._armed = self._cell_running = False
            failure, status, exit_code = exc, "interrupted", None
        except SystemExit as exc:
            self._armed = self._cell_running = False
            exit_code, message = _exit_code_of(exc.code)
            status = "ok" if exit_code == 0 else "error"
        except BaseException as exc:
            self._armed = self._cell_running = False
            failure, status, exit_code = exc, "error", 1
        if _os_getpid() != self.pid:
            self._exit_forked_child(failure, exit_code)
        if failure is not None:
            sys.last_type, sys.last_value, sys.last_traceback = type(failure), failure, failure.__traceback__
            return status, exit_code, format_cell_exception(failure)
        return status, exit_code, "" if message is None else message + "\n"

    def _exit_forked_child(self, failure: BaseException | None, exit_code: int | None) -> NoReturn:
        """A cell forked and the child ran off the end of the cell: it must not become a second kernel
        (it shares the channel). End it the way a forked script would end."""
        try:
            if failure is not None and not isinstance(failure, KeyboardInterrupt):
                sys.stderr.write(format_cell_exception(failure))
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(exit_code or 0)

    # -- bash ----------------------------------------------------------------------------------------

    def _script_path(self) -> str:
        if self._bash_dir is None or not os.path.isdir(self._bash_dir):
            # Created on first use and again if a cell removed it; not in the workdir: it is not the
            # user's file.
            self._bash_dir = os.path.join(PRIVATE_TMP, f".code-sessions-kernel-{os.urandom(8).hex()}")
            os.mkdir(self._bash_dir, 0o700)
        self._bash_count += 1
        return os.path.join(self._bash_dir, f"cell-{self._bash_count}.sh")

    def _run_bash(self, code: str) -> tuple[str, int | None, str]:
        try:
            data = code.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            data = code.encode("utf-8", "replace")
        try:
            script = self._script_path()
            fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            return "error", None, f"[code-sessions: cannot write the bash script: {exc}]\n"
        try:
            return self._spawn_and_wait(script)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(script)

    def _spawn_and_wait(self, script: str) -> tuple[str, int | None, str]:
        # posix_spawn has no cwd argument: step into the workdir for the spawn only. A Python cell's
        # os.chdir persists for Python cells; bash cells always start in the workdir.
        try:
            here: int | None = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:  # the cell's cwd is gone or unreadable: Python cells carry on in the workdir
            here = None
        try:
            os.chdir(self.workdir)
            pid = os.posix_spawn(
                BASH,
                [BASH, script],
                os.environ,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
                setpgroup=0,  # its own group: an interrupt reaches the whole pipeline
                setsigmask=(),
                # Python ignores these; ignored signals survive exec. A shell expects the defaults.
                setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGINT),
            )
        except OSError as exc:
            return "error", None, f"[code-sessions: cannot start {BASH}: {exc}]\n"
        finally:
            if here is not None:
                with contextlib.suppress(OSError):
                    os.fchdir(here)
                os.close(here)
        status: int | None = None
        try:
            self._armed = True
            status = _os_waitpid(pid, 0)[1]
            self._armed = False
            interrupted = False
        except KeyboardInterrupt:
            self._armed = False
            interrupted = True
            status = self._stop_group(pid) if status is None else status
        if status is None:
            return ("interrupted" if interrupted else "error"), None, ""
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            code = 128 - code  # killed by a signal: report it as a shell would ($? = 128 + n)
        if interrupted:
            return "interrupted", code, ""
        return ("ok" if code == 0 else "error"), code, ""

    @staticmethod
    def _stop_group(pid: int) -> int | None:
        """SIGINT to the shell's group, SIGKILL after a grace period; the shell's wait status."""
        for sig, patience in ((_signal.SIGINT, _BASH_SIGINT_GRACE_S), (_signal.SIGKILL, _KILL_PATIENCE_S)):
            with contextlib.suppress(OSError):
                os.killpg(pid, sig)
            deadline = _monotonic() + patience
            while True:
                try:
                    done, status = _os_waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    return None
                if done:
                    return status
                if _monotonic() > deadline:
                    break
                time.sleep(0.005)
        return None

    # -- after every cell ----------------------------------------------------------------------------

    def _restore_process_state(self) -> None:
        """Undo what a cell may have done to the process that the kernel relies on: fd 0/1/2 and
        sys.std*, signal handlers and mask (a Python handler left by a cell could raise inside the
        kernel's own code between cells), timers, trace and profile hooks."""
        self._restore_fds()
        self._restore_streams()
        sys.settrace(None)
        sys.setprofile(None)
        if sys.getrecursionlimit() < self._recursion_limit:  # the kernel's own code needs some depth
            sys.setrecursionlimit(self._recursion_limit)
        threading = sys.modules.get("threading")  # hooks for the threads a cell starts, if it can
        if threading is not None:
            threading.settrace(None)  # type: ignore[arg-type]
            threading.setprofile(None)  # type: ignore[arg-type]
        for which in (_signal.ITIMER_REAL, _signal.ITIMER_VIRTUAL, _signal.ITIMER_PROF):
            _signal.setitimer(which, 0)
        # _signal, not signal: the latter wraps every answer in an enum, 50 µs for the loop instead of 5.
        getsignal, setsignal = _signal.getsignal, _signal.signal
        for sig in self._catchable:
            handler = getsignal(sig)
            if callable(handler) and handler is not self._on_sigint_bound:
                setsignal(sig, _signal.SIG_DFL)
        if getsignal(_signal.SIGINT) is not self._on_sigint_bound:
            setsignal(_signal.SIGINT, self._on_sigint_bound)
        if getsignal(_signal.SIGCHLD) != _signal.SIG_DFL:  # SIG_IGN would reap children before our waitpid
            setsignal(_signal.SIGCHLD, _signal.SIG_DFL)
        for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):  # as Python starts: errors, not deaths
            if getsignal(sig) != _signal.SIG_IGN:
                setsignal(sig, _signal.SIG_IGN)
        _signal.pthread_sigmask(_signal.SIG_SETMASK, ())

    def _flush_streams(self) -> None:
        for stream in (self._stdout, self._stderr):
            try:
                stream.flush()
            except Exception:  # a write the pipe refused: the text is lost, start the stream afresh
                with contextlib.suppress(Exception):
                    stream.close()
        self._restore_streams()

    def _end_leftovers(self) -> None:
        """Kill every process the cell left (daemons, double forks, a shell's background jobs) and reap
        them. Only as PID 1: then kill(-1) means every other process of our own pid namespace. Anywhere
        else (say as root on a host) it would mean every process of the machine."""
        if _os_getpid() != 1:
            return
        deadline = _monotonic() + _KILL_PATIENCE_S
        while True:
            try:
                _os_kill(-1, _signal.SIGKILL)  # zombies count too, so ESRCH means: nobody else is left
            except ProcessLookupError:
                break
            except PermissionError:  # only processes we may not signal are left: nothing to do
                break
            if not self._reap() and _monotonic() > deadline:
                self._note("[code-sessions: some processes of the cell would not die]\n")
                break
            time.sleep(0.0002)
        self._reap()

    @staticmethod
    def _reap() -> int:
        n = 0
        while True:
            try:
                pid, _status = _os_waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return n
            if pid == 0:
                return n
            n += 1

    def _check_private_fds(self) -> None:
        for fd, identity in self._private_fds.items():
            try:
                same = self._identity(fd) == identity
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
