"""The Runner: run one piece of code in a fresh gVisor sandbox with the session folder at /mnt/data."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from . import _bundle, _cgroups, _orphans, _supervise, environment
from ._bytecode import BytecodeCache
from ._changes import ChangeWatch
from ._diagnose import read_runsc_errors
from ._outcome import classify
from ._plan import Sandbox
from ._supervise import Supervision
from .capabilities import RunscInfo, detect_runsc
from .environment import SandboxEnvironment
from .errors import RunnerError, RunscNotFound, UnsupportedLanguage, WorkdirError
from .models import Limits, RunnerConfig, RunResult

DEFAULT_STATE_DIR = Path("/run/code-sessions-runsc")
DEFAULT_BUNDLE_DIR = Path("/run/code-sessions-runner")
PROBE_LIMITS = Limits(timeout_s=20, memory_mb=256, max_output_bytes=4096)
# What users bring data work for; the doctor and the system prompt say which of these import.
DATA_PACKAGES = ("numpy", "pandas", "matplotlib", "scipy", "openpyxl", "PIL")
_PACKAGES_PROBE = (
    "import importlib.util, importlib.metadata as m\n"
    f"for name in {DATA_PACKAGES!r}:\n"
    "    if importlib.util.find_spec(name) is None:\n"
    "        continue\n"
    "    dist = {'PIL': 'pillow'}.get(name, name)\n"
    "    try:\n"
    "        print(name, m.version(dist))\n"
    "    except m.PackageNotFoundError:\n"
    "        print(name, '?')\n"
)


@dataclass(frozen=True)
class HostSetup:
    """What the runner settled on for this host; prepared once, on the first run."""

    runsc: RunscInfo
    platform: str  # of a fresh sandbox per run
    kernel_platform: str  # of a live kernel's sandbox (RunnerConfig.kernel_platform)
    environment: SandboxEnvironment  # what the sandbox's / holds (see runner/environment.py)
    rootfs: Path
    cgroups: _cgroups.CgroupSupport | None
    cgroups_note: str  # why cgroups are not used, when they are not

    @property
    def memory_enforcement(self) -> str:
        if self.cgroups is not None:
            return f"cgroup v{self.cgroups.version} (whole sandbox)"
        return "RLIMIT_AS per process (no usable cgroups: " + self.cgroups_note + ")"


class Runner:
    def __init__(self, config: RunnerConfig | None = None) -> None:
        self.config = config or RunnerConfig()
        self.state_dir = self.config.state_dir or DEFAULT_STATE_DIR
        self.bundle_dir = self.config.bundle_dir or DEFAULT_BUNDLE_DIR
        self._setup: HostSetup | None = None
        self._bytecode = BytecodeCache()
        self._setup_lock = threading.Lock()  # not asyncio.Lock: a Runner may outlive one event loop
        self._interpreters: dict[str, str] = {}
        self._probed: tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | None = None

    @property
    def sandbox_uid(self) -> int:
        return self.config.sandbox_uid

    @property
    def sandbox_gid(self) -> int:
        return self.config.sandbox_gid

    @property
    def host_setup(self) -> HostSetup | None:
        """What `setup` found, once it has run; None before (for code that must not start it, such as
        saving kernels at interpreter exit)."""
        return self._setup

    async def setup(self) -> HostSetup:
        """Detect runsc and prepare the host (idempotent). Raises RunnerError on misconfiguration."""
        if self._setup is None:
            info = await detect_runsc(self.config.runsc_path)
            self._setup = await asyncio.to_thread(self._setup_host, info)
        return self._setup

    def _setup_host(self, info: RunscInfo) -> HostSetup:
        with self._setup_lock:
            if self._setup is not None:
                return self._setup
            if self.config.network and self.config.netns_path is None:
                # runsc's sandbox network takes over the interfaces of the namespace it runs in (it
                # refuses the host's root namespace; inside a container it would take the container's
                # own address). It needs a namespace prepared for it.
                raise RunnerError(
                    "network=True needs RunnerConfig.netns_path: a network namespace prepared for the "
                    "sandbox (e.g. `ip netns add code-sessions` plus a veth pair and NAT); see docs/runner.md"
                )
            # Looked for here, in a worker thread, so that no spawn on the event loop waits for it.
            _supervise.setpriv_prefix()
            platform = self.config.platform or info.auto_platform()
            kernel_platform = self.config.kernel_platform or platform
            if info.platforms and kernel_platform not in info.platforms:
                if "kernel_platform" in self.config.model_fields_set:
                    platform = kernel_platform  # refused just below, with the platforms it offers
                kernel_platform = platform
            for wanted in (platform, kernel_platform):
                if info.platforms and wanted not in info.platforms:
                    raise RunnerError(
                        f"platform {wanted!r} is not offered by {info.path} {info.version} "
                        f"(it offers: {', '.join(info.platforms)})"
                    )
            env = environment.locate(self.config.environment)
            _bundle.ensure_private_dir(self.state_dir)
            _bundle.ensure_private_dir(self.bundle_dir)
            rootfs = _bundle.build_image(
                self.bundle_dir, self.sandbox_uid, self.sandbox_gid, self.config.network, env
            )
            support: _cgroups.CgroupSupport | None = None
            note = "disabled by RunnerConfig(use_cgroups=False)"
            if self.config.use_cgroups is not False:
                found = _cgroups.detect(self.config.cgroup_parent)
                if isinstance(found, str):
                    if self.config.use_cgroups:
                        raise RunnerError(f"use_cgroups=True but {found}")
                    note = found
                else:
                    support, note = found, ""
            # A process that died mid-run (a crash) left its runs' state, bundles and cgroups here.
            _orphans.sweep(info.path, self.state_dir, self.bundle_dir, support, self.config.cgroup_parent)
            for language in ("python", "bash"):  # fail at setup on a missing interpreter
                configured = self.config.python if language == "python" else self.config.bash
                self._interpreters[language] = _bundle.find_interpreter(language, configured, env)
            return HostSetup(info, platform, kernel_platform, env, rootfs, support, note)

    async def sweep_leftovers(self) -> list[str]:
        """Remove what runs of processes that died left here (container state, bundles, cgroups; their
        sandboxes died with them), as setup does; the function's periodic tick calls it, so a worker
        killed while it held kernels is cleaned up within a tick, not at some later Runner's setup.
        Runs of live processes are never touched. Returns the container ids removed."""
        setup = await self.setup()
        return await asyncio.to_thread(
            _orphans.sweep,
            setup.runsc.path,
            self.state_dir,
            self.bundle_dir,
            setup.cgroups,
            self.config.cgroup_parent,
        )

    def _interpreter(self, language: str) -> str:
        """The interpreter's path in the sandbox (known once setup() has run)."""
        if language not in _bundle.LANGUAGES:
            raise UnsupportedLanguage(f"language must be 'python' or 'bash', not {language!r}")
        return self._interpreters[language]

    def _runsc_argv(self, setup: HostSetup, bundle: Path, *, kernel: bool = False) -> list[str]:
        info = setup.runsc
        platform = setup.kernel_platform if kernel else setup.platform
        argv = [info.path, "--root", str(self.state_dir), "--platform", platform]
        argv.append("--network=sandbox" if self.config.network else "--network=none")
        if info.supports("overlay2"):
            # Newer runsc overlays the root by default; we want exactly the spec: a read-only root and
            # /mnt/data written straight through to the host.
            argv.append("--overlay2=none")
        if setup.cgroups is None and info.supports("ignore-cgroups"):
            argv.append("--ignore-cgroups")
        # gVisor's own errors go to a file, not into the code's stderr, so they can't be confused.
        argv += ["--log", str(bundle / "runsc.log")]
        if info.supports("log-format"):
            argv.append("--log-format=json")
        if info.supports("panic-log"):
            argv += ["--panic-log", str(bundle / "panic.log")]
        if self.config.debug_log_dir is not None:
            argv += ["--debug", "--debug-log", str(self.config.debug_log_dir).rstrip("/") + "/"]
        argv += list(self.config.extra_runsc_flags)
        return argv

    def _check_workdir(self, workdir: Path | str) -> Path:
        path = Path(os.path.realpath(workdir))
        if not path.is_dir():
            raise WorkdirError(f"workdir {workdir} does not exist or is not a directory")
        if path == Path("/"):
            raise WorkdirError("refusing to mount / as the session folder")
        return path

    def _prepare_and_watch(
        self,
        setup: HostSetup,
        cid: str,
        code: str,
        language: str,
        workdir: Path,
        limits: Limits,
        compile_once: bool,
        restore_from: Path | None = None,
        restore_unpacked: bool = False,
        kernel: bool = False,
    ) -> tuple[Sandbox, ChangeWatch]:
        """prepare()'s work, in a worker thread: the workdir's owner, the bundle, the cgroup, the
        spec, then the watch."""
        if os.geteuid() == 0:
            st = workdir.stat()
            # Only the top directory: the sandbox user must create files in it; what is inside
            # (possibly 100k files) keeps its owners and is not walked.
            if (st.st_uid, st.st_gid) != (self.sandbox_uid, self.sandbox_gid):
                os.chown(workdir, self.sandbox_uid, self.sandbox_gid)
            if st.st_mode & 0o700 != 0o700:
                workdir.chmod(st.st_mode | 0o700)
        interpreter = self._interpreter(language)
        bytecode = None
        if compile_once and language == "python":
            main = f"{_bundle.CODE_MOUNT}/{_bundle.code_file_name(language, False)}"
            bytecode = self._bytecode.get(setup.environment.host_command(interpreter), main, code)
        bundle = _bundle.write_bundle(self.bundle_dir, cid, code, language, bytecode)
        cgroup = None
        try:
            if setup.cgroups is not None:
                cgroup = _cgroups.RunCgroup(setup.cgroups, self.config.cgroup_parent, cid)
                cgroup.create(limits.memory_mb * 1024 * 1024, _bundle.pids_backstop(limits))
            spec = _bundle.make_spec(
                rootfs=setup.rootfs,
                bundle=bundle,
                workdir=workdir,
                language=language,
                interpreter=interpreter,
                limits=limits,
                uid=self.sandbox_uid,
                gid=self.sandbox_gid,
                cgroups_path=cgroup.path if cgroup else None,
                rlimit_as=cgroup is None,
                netns_path=self.config.netns_path if self.config.network else None,
                bytecode=bytecode is not None,
                env=setup.environment,
            )
            (bundle / "config.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
        except BaseException as exc:
            if cgroup is not None:
                cgroup.remove()
            shutil.rmtree(bundle, ignore_errors=True)
            if isinstance(exc, OSError):
                raise RunnerError(f"cannot prepare the sandbox: {exc}") from exc
            raise
        # A restore starts the same sandbox from a saved image instead of from its first process.
        if restore_unpacked:
            restore_from = bundle / "image"  # Sandbox.image_dir, filled by the caller before it starts
        command = ["run"] if restore_from is None else ["restore", f"--image-path={restore_from}"]
        sandbox = Sandbox(
            cid=cid,
            bundle=bundle,
            cgroup=cgroup,
            argv=[*self._runsc_argv(setup, bundle, kernel=kernel), *command, "--bundle", str(bundle), cid],
            runsc_base=[setup.runsc.path, "--root", str(self.state_dir)],
            workdir=workdir,
        )
        # After the chown of the workdir, before the sandbox exists: nothing can race the setup.
        return sandbox, ChangeWatch.start(str(workdir))

    async def prepare(
        self,
        code: str,
        language: str,
        workdir: Path | str,
        limits: Limits,
        *,
        prefix: str = "cs-",
        compile_once: bool = False,
        restore_from: Path | None = None,
        restore_unpacked: bool = False,
        kernel: bool = False,
    ) -> tuple[Sandbox, ChangeWatch]:
        """Everything a sandbox needs before it starts (bundle, cgroup, command), and a watch of the
        workdir set up before anything in the sandbox can write. `discard()` undoes it.

        ``compile_once``: Python ``code`` that this Runner starts many times (the kernel program) is
        compiled once by the sandbox's interpreter and started from bytecode (see _bytecode).
        ``restore_from``: a `runsc checkpoint` image folder; the sandbox resumes it (`runsc restore`)
        with this bundle's mounts, cgroup and limits instead of starting ``code``.
        ``restore_unpacked``: the same, from the image the caller unpacks into ``Sandbox.image_dir``
        (in the bundle: private, and removed with it) before the sandbox starts.
        ``kernel``: a live kernel's sandbox, on ``RunnerConfig.kernel_platform``."""
        if language not in _bundle.LANGUAGES:  # fail fast, before anything is prepared
            raise UnsupportedLanguage(f"language must be 'python' or 'bash', not {language!r}")
        wd = self._check_workdir(workdir)
        setup = await self.setup()
        cid = prefix + secrets.token_hex(8)
        return await asyncio.to_thread(
            self._prepare_and_watch,
            setup,
            cid,
            code,
            language,
            wd,
            limits,
            compile_once,
            restore_from,
            restore_unpacked,
            kernel,
        )

    async def sandbox_identity(self) -> dict[str, object]:
        """What a saved kernel image depends on besides the kernel program and its limits: the
        runsc build and platform, the root file system (its content-addressed path follows any change
        of the sandbox's environment), the interpreter, the sandbox user and the network."""
        return self.sandbox_identity_now(await self.setup())

    def checkpoint_flags(self) -> list[str]:
        """Flags for `runsc checkpoint`: an uncompressed image without the zero pages. Measured here
        for a kernel holding 100 MB of DataFrames: 0.26 s to save and 0.7 s to resume, against 4.8 s
        and 7.7 s with runsc's default compression, for 137 MiB on disk instead of 101 MiB."""
        offered = self._setup.runsc.checkpoint_flags if self._setup is not None else frozenset()
        flags = []
        if "compression" in offered:
            flags.append("--compression=none")
        if "exclude-committed-zero-pages" in offered:
            flags.append("--exclude-committed-zero-pages")
        return flags

    def sandbox_identity_now(self, setup: HostSetup) -> dict[str, object]:
        """sandbox_identity() for a Runner already set up (no awaiting: also usable at exit)."""
        return {
            "runsc": setup.runsc.version,
            "platform": setup.kernel_platform,  # images are of kernels
            "rootfs": str(setup.rootfs),
            "python": self._interpreter("python"),
            "user": [self.sandbox_uid, self.sandbox_gid],
            "network": self.config.network,
            "cgroups": setup.cgroups is not None,
        }

    async def discard(self, sandbox: Sandbox) -> None:
        """Remove a sandbox's bundle (its processes must be gone; its cgroup is the caller's)."""
        with contextlib.suppress(OSError):
            await asyncio.to_thread(shutil.rmtree, sandbox.bundle, True)

    async def run(
        self, code: str, language: str, workdir: Path | str, limits: Limits | None = None
    ) -> RunResult:
        """Run ``code`` ("python" or "bash") with ``workdir`` at /mnt/data in a fresh sandbox. Never
        raises for what the code does; raises RunnerError subclasses for host-side misconfiguration."""
        limits = limits or Limits()
        sandbox, watch = await self.prepare(code, language, workdir, limits)
        bundle, cgroup, wd, cid = sandbox.bundle, sandbox.cgroup, sandbox.workdir, sandbox.cid
        sup = Supervision(
            argv=sandbox.argv,
            runsc_base=sandbox.runsc_base,
            container_id=cid,
            workdir=wd,
            limits=limits,
            cgroup=cgroup,
            marker=str(bundle),
        )
        pump = asyncio.create_task(watch.pump())
        try:
            try:
                facts = await sup.run()
            except (FileNotFoundError, PermissionError) as exc:  # runsc vanished since setup()
                raise RunscNotFound(sandbox.argv[0], str(exc)) from exc
            errors = await asyncio.to_thread(read_runsc_errors, bundle / "runsc.log", bundle / "panic.log")
        finally:
            pump.cancel()
            try:
                # Shielded: even if the caller cancels us, the sandbox is killed and the bundle removed.
                await asyncio.shield(asyncio.ensure_future(self._finish(sup, bundle)))
            finally:
                # After _finish every sandbox process is gone, so their last writes (and the closes
                # of their host files) are queued.
                changed = watch.finish()
        outcome, exit_code, reason = classify(
            facts, limits, errors, sup.stderr.text()[-2000:], memory_by_rlimit=cgroup is None
        )
        if facts.leftover_pids:
            reason = f"{reason or outcome.value}; warning: host processes {facts.leftover_pids} did not exit"
            changed = None  # they may still be writing: what the run changed is not known yet
        return RunResult(
            outcome=outcome,
            exit_code=exit_code,
            stdout=sup.stdout.text(),
            stderr=sup.stderr.text(),
            stdout_truncated=sup.stdout.truncated,
            stderr_truncated=sup.stderr.truncated,
            duration_s=round(facts.duration_s, 3),
            reason=reason,
            container_id=cid,
            changed=changed,
        )

    async def _finish(self, sup: Supervision, bundle: Path) -> None:
        try:
            await sup.close()
        finally:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(shutil.rmtree, bundle, True)

    async def known_issues(self) -> tuple[str, ...]:
        """Quirks of this gVisor build that code authors should know, probed once per Runner.

        Debian's runsc 20221219 rejects statx(AT_NO_AUTOMOUNT), so coreutils' `ls` and `stat` fail
        with "Invalid argument" while Python's os.listdir/os.stat work. A version check would guess;
        one tiny run knows."""
        return (await self._probe())[0]

    async def packages(self, *, named_only: bool = False) -> tuple[tuple[str, str], ...]:
        """The packages the sandbox's Python can import, as (what to import, version): a built
        environment's from its manifest (`named_only`: those the system prompt names); on the host's
        /usr, the data packages a probe finds."""
        env = (await self.setup()).environment
        if env.built:
            return tuple((p.label, p.version) for p in env.packages if p.named or not named_only)
        return (await self._probe())[1]

    async def data_packages(self) -> tuple[tuple[str, str], ...]:
        """Which of DATA_PACKAGES the sandbox's Python really imports, with versions (a probe run)."""
        return (await self._probe())[1]

    async def environment(self) -> SandboxEnvironment:
        """The sandbox environment this Runner runs on."""
        return (await self.setup()).environment

    async def _probe(self) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
        if self._probed is None:  # two first callers at once both probe: harmless
            await self.setup()
            python = self._interpreter("python")
            script = f"ls / >/dev/null\n{python} - <<'PY'\n{_PACKAGES_PROBE}PY\n"
            with tempfile.TemporaryDirectory(prefix="runner-probe-") as tmp:
                probe = await self.run(script, "bash", Path(tmp), PROBE_LIMITS)
            issues = []
            if "Invalid argument" in probe.stderr:
                issues.append(
                    "`ls` and `stat` fail with 'Invalid argument' in this sandbox (an old gVisor); "
                    "list files with Python (os.listdir, os.stat) or `find`."
                )
            found: list[tuple[str, str]] = []
            for line in probe.stdout.splitlines():
                name, _, version = line.partition(" ")
                if name in DATA_PACKAGES and version and len(version) < 40:
                    found.append((name, version))
            self._probed = (tuple(issues), tuple(found))
        return self._probed
