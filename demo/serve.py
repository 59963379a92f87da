"""Run the product locally: Open WebUI on 127.0.0.1 with Code Sessions installed and ready.

Embedded defaults: SQLite and sessions under .local/open-webui/data, no login (single-user mode). The base
model is, in this order: the OpenAI-compatible server in OPENAI_API_BASE_URL (with OPENAI_API_KEY), a local
Ollama on 127.0.0.1:11434, or the built-in scripted demo model, so the file workflow works offline.
Everything it writes stays in the data folder: Open WebUI's data, its log, the secret key, the demo
model's log. Knowledge is embedded offline (the all-MiniLM-L6-v2 that scripts/setup installs), and Open
WebUI's own code execution in the browser (Pyodide, without /mnt/data) is off.

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
    """A per-install secret key, kept with the data so logins survive restarts."""
    path = data_dir / "secret_key"
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
    log = data_dir / "open-webui.log"
    data_dir.mkdir(parents=True, exist_ok=True)

    env = {"WEBUI_AUTH": "False", "WEBUI_SECRET_KEY": _secret(data_dir)}
    embedding = launcher.embedding_model()
    if embedding:  # what a new data folder starts with; an older one is set through the API below
        env.update(RAG_EMBEDDING_ENGINE="", RAG_EMBEDDING_MODEL=embedding)
    else:
        print("No offline embedding model (run ./scripts/setup): Save to Knowledge will fail.", flush=True)
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
        helper = launcher.start_model_server(port, data_dir / "scripted-model.log")
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
        server = launcher.start_open_webui(data_dir, args.port, log, env, home=data_dir)
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
        twins = {f"{launcher.FUNCTION_ID}.{m}": f"Code · {m}" for m in models}
        admin.switch_off_builtin_code({**twins, **{m: m for m in models}})
        admin.install_actions([*twins, *models])
        if embedding:
            admin.use_embedding_model(embedding)
        # Open WebUI's cache of models, rebuilt with the entries just made: an API caller's first
        # message then finds the Code models (the page lists the models first anyway).
        admin.get("/api/models").raise_for_status()
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
