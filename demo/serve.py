"""Run the product locally: Open WebUI on 127.0.0.1 with Code Sessions installed and ready.

Embedded defaults: SQLite and sessions under .local/open-webui/data, no login (single-user mode). The base
model is, in this order: the OpenAI-compatible server in OPENAI_API_BASE_URL (with OPENAI_API_KEY), a local
Ollama on 127.0.0.1:11434, or the built-in scripted demo model, so the file workflow works offline.

    ./scripts/serve                 # then open http://127.0.0.1:8080
    ./scripts/serve --port 3000 --data-dir /tmp/cs-demo
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
from pathlib import Path

import httpx

from demo import launcher

DEFAULT_DATA = launcher.REPO / ".local" / "open-webui" / "data"


def _ollama_running() -> bool:
    try:
        return httpx.get("http://127.0.0.1:11434/api/tags", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _secret(data_dir: Path) -> str:
    """A per-install secret key, kept beside the data so sessions survive restarts."""
    path = data_dir.parent / "secret_key"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument(
        "--models", default="", help="base model ids for the valves (default: all the backend has)"
    )
    args = parser.parse_args()
    # `kill` (SIGTERM) ends the demo like Ctrl-C does, so Open WebUI and the model server go with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    data_dir = args.data_dir.resolve()
    log = data_dir.parent / "open-webui.log"
    data_dir.mkdir(parents=True, exist_ok=True)

    env = {"WEBUI_AUTH": "False", "WEBUI_SECRET_KEY": _secret(data_dir)}
    helper = None
    openai: tuple[str, str] | None = None
    ollama: str | None = None
    if os.environ.get("OPENAI_API_BASE_URL"):
        source = os.environ["OPENAI_API_BASE_URL"]
        openai = (source, os.environ.get("OPENAI_API_KEY", ""))
    elif _ollama_running():
        source = "Ollama on 127.0.0.1:11434"
        ollama = "http://127.0.0.1:11434"
    else:
        port = launcher.free_port()
        helper = launcher.start_model_server(port, data_dir.parent / "scripted-model.log")
        openai = (f"http://127.0.0.1:{port}/v1", "demo")
        source = f"the built-in scripted demo model ({openai[0]})"
    # Also as environment, so that even Open WebUI's first model listing already has the right source.
    if openai:
        env.update(OPENAI_API_BASE_URL=openai[0], OPENAI_API_KEY=openai[1], ENABLE_OLLAMA_API="false")
    else:
        env.update(OLLAMA_BASE_URL=ollama or "", ENABLE_OPENAI_API="false")

    print(
        f"Starting Open WebUI on http://127.0.0.1:{args.port} (log: {log}); models from {source}", flush=True
    )
    try:
        server = launcher.start_open_webui(data_dir, args.port, log, env)
    except BaseException:
        if helper is not None:
            launcher.stop(helper)
        raise
    try:
        url = f"http://127.0.0.1:{args.port}"
        signin = httpx.post(
            url + "/api/v1/auths/signin", json={"email": "admin@localhost", "password": "admin"}, timeout=60
        )
        signin.raise_for_status()
        admin = launcher.Admin(url, signin.json()["token"])
        admin.use_models_from(openai=openai, ollama=ollama)
        admin.install_function()
        models = [m.strip() for m in args.models.split(",") if m.strip()] or [
            model["id"]
            for model in admin.get("/api/models").json()["data"]
            if not model["id"].startswith(launcher.FUNCTION_ID + ".") and "pipe" not in model
        ]
        admin.set_valves(base_models=",".join(models))
        admin.install_tool_and_filter(models)
        names = ", ".join(f"Code · {m}" for m in models) or "(none: pass --models)"
        plain = ", ".join(models) or "a model"
        print(
            f"Ready: open {url} and pick {names}; or {plain} itself, with the Code Sessions tool"
            " switched on under the message box. Ctrl-C stops.",
            flush=True,
        )
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        launcher.stop(server)
        if helper is not None:
            launcher.stop(helper)
    return 0


if __name__ == "__main__":
    sys.exit(main())
