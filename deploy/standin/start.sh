#!/usr/bin/env bash
# TEST STAND-IN's start script (see Containerfile). The official image's start.sh keeps a generated
# secret key in /app/backend/.webui_secret_key and runs uvicorn on 0.0.0.0:8080; `open-webui serve` does
# the same from this directory and also finds the frontend shipped in the PyPI package.
set -euo pipefail
cd /app/backend
exec open-webui serve --host "${HOST:-0.0.0.0}" --port "${PORT:-8080}"
