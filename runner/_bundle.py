"""Everything the sandbox sees, written as an OCI bundle: a shared read-only root skeleton (with a
generated minimal /etc) and, per run, a config.json plus the code file.

Code never passes through a shell or argv: it is written to ``<bundle>/code/main.<ext>`` and the
interpreter is started with that file's in-sandbox path (/run/code/main.py, mounted read-only).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from . import _orphans
from .environment import HOST, SandboxEnvironment
from .errors import InterpreterNotFound, StateDirError, UnsupportedLanguage
from .models import Limits

SANDBOX_HOME = "/home/sandbox"
SANDBOX_USER = "sandbox"
DATA_MOUNT = "/mnt/data"
CODE_MOUNT = "/run/code"
_LANG_EXT = {"python": "py", "bash": "sh"}
LANGUAGES = tuple(_LANG_EXT)
# Debian's usrmerge makes these symlinks into /usr; older layouts have real directories.
_TOP_LEVEL_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# /etc entries of the environment (or the host) that interpreters need; nothing secret (no shadow,
# no ssl/private, no host env files).
_ETC_COPIES = (
    "ld.so.cache",
    "localtime",
    "mime.types",
    "alternatives",
    "ssl/certs",
    "ssl/openssl.cnf",
    "matplotlibrc",  # Debian's matplotlib reads its defaults here
    "fonts",  # fontconfig's configuration, for libraries that render text
    "os-release",  # what platform.freedesktop_os_release() and tools read
    "debian_version",
)
_ENV = (
    "PATH=/usr/local/bin:/usr/bin:/bin",
    f"HOME={SANDBOX_HOME}",
    f"USER={SANDBOX_USER}",
    "LANG=C.UTF-8",
    "TMPDIR=/tmp",
    "PYTHONUNBUFFERED=1",
    "PYTHONDONTWRITEBYTECODE=1",
    "MPLBACKEND=Agg",
)


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` mode 0700; refuse one that someone else owns (a pre-planted trap)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError as exc:
        raise StateDirError(f"cannot create the runner directory {path}: {exc}") from exc
    if not path.is_dir() or path.is_symlink():
        raise StateDirError(f"{path} must be a real directory")
    if st.st_uid != os.geteuid():
        raise StateDirError(f"{path} belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()})")
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


def _system_dirs(env: SandboxEnvironment) -> tuple[list[tuple[str, str]], list[str]]:
    """(symlinks to recreate as (name, target), real directories to bind read-only) at the root the
    sandbox runs on: a built environment's, or the host's own /."""
    links, binds = [], []
    for name in _TOP_LEVEL_SYSTEM_DIRS:
        host = env.root / name
        if host.is_symlink():
            links.append((name, os.readlink(host)))
        elif host.is_dir():
            binds.append(f"/{name}")
    return links, binds


def visible_roots(env: SandboxEnvironment = HOST) -> tuple[str, ...]:
    """Directories the sandbox sees read-only (sandbox paths; on the host they lie under env.root)."""
    return ("/usr", *_system_dirs(env)[1])


def find_interpreter(language: str, configured: Path | None, env: SandboxEnvironment = HOST) -> str:
    """The interpreter's path inside the sandbox, which must lie inside a directory the sandbox sees
    (on the host it lies under env.root)."""
    if language not in _LANG_EXT:
        raise UnsupportedLanguage(f"language must be 'python' or 'bash', not {language!r}")
    exe = "python3" if language == "python" else "bash"
    # A built environment's python3 is Debian's /usr/bin/python3 with the wheels in /usr/local/lib. On
    # the host's own /usr, Debian's /usr/bin/python3 comes first too (its python3-* packages), then an
    # image's own /usr/local Python.
    folders = (
        ("/usr/bin", "/usr/local/bin", "/bin")
        if language == "python"
        else ("/usr/local/bin", "/usr/bin", "/bin")
    )
    candidates = [str(configured)] if configured else [f"{d}/{exe}" for d in folders]
    roots = visible_roots(env)
    for cand in candidates:
        host = str(env.host_path(cand))
        if not (os.path.isfile(host) and os.access(host, os.X_OK)):
            continue
        real = _resolve_inside(env, cand)
        if real is not None and any(real == r or real.startswith(r + "/") for r in roots):
            return cand
        if configured:
            raise InterpreterNotFound(
                f"{cand} resolves to {real}, outside what the sandbox sees ({', '.join(roots)})"
            )
    where = f" in {env.root}" if env.built else ""
    raise InterpreterNotFound(
        f"no {exe} found{where} ({', '.join(candidates)}); install it or set RunnerConfig.{language}"
    )


def _resolve_inside(env: SandboxEnvironment, path: str) -> str | None:
    """``path`` with its symlinks resolved as the sandbox would (absolute links stay in env.root)."""
    if not env.built:
        return os.path.realpath(path)
    parts: list[str] = []
    todo = [p for p in path.split("/") if p]
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        host = env.root.joinpath(*parts, part)
        if host.is_symlink():
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(host)
            if target.startswith("/"):
                parts = []
            todo = [p for p in target.split("/") if p] + todo
            continue
        parts.append(part)
    return "/" + "/".join(parts)


def _etc_files(uid: int, gid: int, network: bool) -> dict[str, str]:
    files = {
        "passwd": (
            "root:x:0:0:root:/root:/usr/sbin/nologin\n"
            f"{SANDBOX_USER}:x:{uid}:{gid}::{SANDBOX_HOME}:/bin/bash\n"
        ),
        "group": f"root:x:0:\n{SANDBOX_USER}:x:{gid}:\n",
        "hosts": "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        "hostname": "sandbox\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
    }
    if network:
        with contextlib.suppress(OSError):
            files["resolv.conf"] = Path("/etc/resolv.conf").read_text(encoding="utf-8", errors="replace")
    return files


def _image_key(
    env: SandboxEnvironment, etc_files: dict[str, str], links: list[tuple[str, str]], binds: list[str]
) -> str:
    """Digest of everything an image is built from, so an existing identical image is reused as is."""
    h = hashlib.sha256(repr((env.key, str(env.root), sorted(etc_files.items()), links, binds)).encode())
    etc_root = env.host_path("/etc")
    for rel in _ETC_COPIES:
        for dirpath, dirnames, filenames in os.walk(etc_root / rel):
            dirnames.sort()
            for name in sorted(filenames) or [""]:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(dirpath, name))
                    h.update(f"{dirpath}/{name}:{st.st_mode}:{st.st_size}:{st.st_mtime_ns}".encode())
        with contextlib.suppress(OSError):
            st = os.lstat(etc_root / rel)
            h.update(f"{rel}:{st.st_mode}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_image(base: Path, uid: int, gid: int, network: bool, env: SandboxEnvironment = HOST) -> Path:
    """The shared read-only root skeleton over ``env``'s /usr. Content-addressed: built once per
    environment and distinct /etc, reused by every runner process; concurrent builders agree."""
    etc_files = _etc_files(uid, gid, network)
    links, binds = _system_dirs(env)
    final = base / f"image-{_image_key(env, etc_files, links, binds)}"
    if (final / "rootfs").is_dir():
        return final / "rootfs"
    tmp = base / f".image-{secrets.token_hex(6)}"
    rootfs = tmp / "rootfs"
    for d in ("usr", "etc", "proc", "dev", "sys", "tmp", "home/sandbox", "mnt/data", "run/code"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for name, target in links:
        (rootfs / name).symlink_to(target)
    for path in binds:
        (rootfs / path.lstrip("/")).mkdir(exist_ok=True)
    etc = rootfs / "etc"
    for name, text in etc_files.items():
        (etc / name).write_text(text, encoding="utf-8")
    for rel in _ETC_COPIES:
        src, dst = env.host_path("/etc") / rel, etc / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            if src.is_dir() and not src.is_symlink():
                shutil.copytree(src, dst, symlinks=True)
            elif src.is_symlink() or src.is_file():
                shutil.copy2(src, dst, follow_symlinks=False)
    for p in [tmp, *tmp.rglob("*")]:
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    try:
        tmp.rename(final)
    except OSError:  # another runner built the identical image first
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "rootfs"


def code_file_name(language: str, bytecode: bool) -> str:
    """The file the interpreter starts, in the bundle's code/ folder (/run/code in the sandbox)."""
    return "main.pyc" if bytecode else f"main.{_LANG_EXT[language]}"


def write_bundle(
    base: Path, container_id: str, code: str, language: str, bytecode: bytes | None = None
) -> Path:
    """``bytecode``, if given, is ``code`` compiled by the sandbox's interpreter, and is what starts."""
    bundle = base / container_id
    code_dir = bundle / "code"
    code_dir.mkdir(parents=True, mode=0o700)
    # Who supervises this run: if that process dies, the next Runner removes what the run left.
    (bundle / _orphans.OWNER_FILE).write_text(_orphans.owner_stamp(), encoding="ascii")
    code_dir.chmod(0o755)  # the sandbox user must be able to read it
    code_file = code_dir / code_file_name(language, bytecode is not None)
    if bytecode is not None:
        code_file.write_bytes(bytecode)
    else:
        code_file.write_text(code, encoding="utf-8", errors="surrogateescape")
    code_file.chmod(0o644)
    return bundle


def _bind(src: str, dst: str, writable: bool = False) -> dict[str, Any]:
    opts = ["rbind", "rw" if writable else "ro", "nosuid", "nodev"]
    return {"destination": dst, "type": "bind", "source": src, "options": opts}


def make_spec(
    *,
    rootfs: Path,
    bundle: Path,
    workdir: Path,
    language: str,
    interpreter: str,
    limits: Limits,
    uid: int,
    gid: int,
    cgroups_path: str | None,
    rlimit_as: bool,
    netns_path: Path | None,
    bytecode: bool = False,
    env: SandboxEnvironment = HOST,
) -> dict[str, Any]:
    memory = limits.memory_mb * 1024 * 1024
    rlimits = [
        ("RLIMIT_NPROC", limits.max_processes),  # gVisor counts threads too, per uid, inside the sandbox
        ("RLIMIT_NOFILE", 4096),
        ("RLIMIT_CORE", 0),
    ]
    if limits.max_file_bytes is not None:  # None: no limit (the sandbox's own default, unlimited)
        rlimits.append(("RLIMIT_FSIZE", limits.max_file_bytes))
    if rlimit_as:  # only without cgroups: per process and virtual, so a weaker stand-in
        rlimits.append(("RLIMIT_AS", memory))
    net_ns: dict[str, str] = {"type": "network"}
    if netns_path is not None:
        net_ns["path"] = str(netns_path)
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
        # POSIX semaphores and shared memory live here: without it multiprocessing.Pool (and joblib,
        # scikit-learn's n_jobs) cannot start. Memory, like /tmp: the sandbox's memory limit bounds it.
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "nodev", "noexec", "mode=1777"],
        },
        {
            "destination": "/tmp",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777"],
        },
        {
            "destination": SANDBOX_HOME,
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=700", f"uid={uid}", f"gid={gid}"],
        },
        *(_bind(str(env.host_path(d)), d) for d in visible_roots(env)),
        _bind(str(bundle / "code"), CODE_MOUNT),
        _bind(str(workdir), DATA_MOUNT, writable=True),
    ]
    linux: dict[str, Any] = {
        "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")] + [net_ns],
        "resources": {
            "memory": {"limit": memory, "swap": memory},
            # Backstop only: on ptrace every sandbox process is several host threads, so a tight host
            # pids limit would crash gVisor itself; RLIMIT_NPROC does the real work inside.
            "pids": {"limit": pids_backstop(limits)},
        },
    }
    if cgroups_path:
        linux["cgroupsPath"] = cgroups_path
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid, "additionalGids": []},
            "args": [interpreter, f"{CODE_MOUNT}/{code_file_name(language, bytecode)}"],
            "env": list(_ENV),
            "cwd": DATA_MOUNT,
            "capabilities": {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")},
            "rlimits": [{"type": name, "hard": value, "soft": value} for name, value in rlimits],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "sandbox",
        "mounts": mounts,
        "linux": linux,
    }


def pids_backstop(limits: Limits) -> int:
    # Measured on ptrace: a python fork bomb held at 64 sandbox processes peaked at ~1,500 host tasks
    # (each sandbox process has a stub process with one thread per sentry thread). Generous on purpose:
    # hitting this limit crashes gVisor instead of failing a fork inside the sandbox.
    return 128 * limits.max_processes
