"""A scripted OpenAI-compatible model server: the demo model, and the model of the end-to-end tests.

It serves `GET /v1/models` and `POST /v1/chat/completions` (streamed or not, with tool calls) on
127.0.0.1, with no network and no weights. What it answers is decided by the last messages:

* a user message with a ```python or ```bash block: it runs that block (a `run_code` tool call when tools
  are offered, else it repeats the block so fenced-block mode runs it);
* a user message asking for a csv/report, a plot/chart, a Word document, a zip, a listing or a long job:
  it writes that code itself;
* after a tool result (or code output): it answers with the text of a `reply:` line of the last user
  message if there is one; after a run that was stopped or failed, a sentence that points at the block
  above; else it names each file the run saved once, as a /mnt/data path (a picture on a line of its
  own, so it is shown);
* a user line `call: <tool> <json arguments>` when that tool is offered: a call of it; after its result, an
  upload link (or the sentence why not) is passed on to the user;
* a request for an upload link in words ("give me an upload link for sales.csv", "can I upload a file?"):
  an `upload_link` call for the file it names, or the question which name the file should get (a reply
  that names one is then understood);
* "save it to knowledge" (or "add report.csv to my Research knowledge base"): the Save to Knowledge
  command for the user to send (it is the user's to type, never a tool of the model's), naming the file
  it names or the chat's newest, and the base it names, or asking which;
* anything else: a short help text.

The user's own words are read: what Open WebUI puts around them (the attached files' tags, the sources
of a retrieval) is set aside, and a sentence the Filter left for the model is passed on.

`GET /_requests` returns the chat requests received so far (tests read the system prompt there).

    python demo/scripted_model.py --port 8099
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

MODEL_ID = "demo-scripted"

_BLOCK = re.compile(r"```(python|py|bash|sh)\n(.*?)```", re.S)
_CALL = re.compile(r"^call: ([A-Za-z_][A-Za-z0-9_]*) (\{.*\})$", re.M)
_UPLOAD_LINK = re.compile(r"https?://\S+/code-sessions/upload/[A-Za-z0-9_-]+")

_CSV_CODE = """import csv, random
random.seed(7)
rows = [("month", "visitors", "signups")]
for month in ["Jan", "Feb", "Mar", "Apr", "May", "Jun"]:
    visitors = random.randint(800, 2000)
    rows.append((month, visitors, visitors // random.randint(8, 15)))
with open("/mnt/data/report.csv", "w", newline="") as handle:
    csv.writer(handle).writerows(rows)
try:  # the data, loaded once: later steps of this chat use `df` (the kernel keeps it)
    import pandas as pd
    df = pd.read_csv("/mnt/data/report.csv")
    print(df.to_string(index=False))
except ImportError:
    print(open("/mnt/data/report.csv").read())
"""

# A real chart when matplotlib is there (from the `df` the csv step loaded, if this chat's kernel still
# has it); otherwise a bar chart drawn with the standard library only (zlib + struct).
_PLOT_CODE = """try:
    import matplotlib.pyplot as plt
except ImportError:
    plt = None
if plt is not None:
    if "df" not in globals():
        import os
        import pandas as pd
        if os.path.exists("/mnt/data/report.csv"):
            df = pd.read_csv("/mnt/data/report.csv")
        else:  # asked for a chart before any report: plot example data
            df = pd.DataFrame({"month": ["Jan", "Feb", "Mar", "Apr"], "visitors": [3, 5, 2, 6]})
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.bar(df["month"], df["visitors"], color="#3478f6")
    ax.set_xlabel("month")
    ax.set_ylabel("visitors")
    ax.set_title("Visitors per month")
    fig.tight_layout()
    fig.savefig("/mnt/data/chart.png", dpi=100)
    plt.close(fig)
    print("chart.png: a bar chart of", len(df), "months")
"""

# An interactive chart (plotly, drawn in the message), from the same data.
_PLOTLY_CODE = """import os
import pandas as pd
import plotly.express as px
if "df" not in globals():
    if os.path.exists("/mnt/data/report.csv"):
        df = pd.read_csv("/mnt/data/report.csv")
    else:  # asked for a chart before any report: example data
        df = pd.DataFrame({"month": ["Jan", "Feb", "Mar", "Apr"], "visitors": [3, 5, 2, 6]})
fig = px.bar(df, x="month", y="visitors", title="Visitors per month")
fig.show()
"""

_SUMMARY_CODE = """if "df" in globals():
    print("df is still loaded from the csv step:", len(df), "rows")
    print(df.describe().round(1).to_string())
else:
    print("df is not loaded in this Python session (a fresh one): load the csv again")
"""

# The chart without matplotlib: the standard library only (zlib + struct).
_PLAIN_PLOT_CODE = """import csv, os, struct, zlib
rows = []
if os.path.exists("/mnt/data/report.csv"):
    rows = [int(r["visitors"]) for r in csv.DictReader(open("/mnt/data/report.csv"))]
rows = rows or [3, 5, 2, 6, 4, 7]
width, height, top = 360, 220, max(rows)
pixels = [[(255, 255, 255)] * width for _ in range(height)]
bar = width // (2 * len(rows) + 1)
for i, value in enumerate(rows):
    h = int((height - 20) * value / top)
    for x in range((2 * i + 1) * bar, (2 * i + 2) * bar):
        for y in range(height - h, height):
            pixels[y][x] = (52, 120, 246)
raw = b"".join(b"\\0" + bytes(c for px in row for c in px) for row in pixels)
def chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
png = b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
open("/mnt/data/chart.png", "wb").write(png)
print("chart.png:", len(png), "bytes")
"""
_PLOT_CODE += "else:\n" + textwrap.indent(_PLAIN_PLOT_CODE, "    ")

_ZIP_CODE = """import os, zipfile
names = sorted(n for n in os.listdir("/mnt/data") if os.path.isfile(n) and n != "bundle.zip")
with zipfile.ZipFile("/mnt/data/bundle.zip", "w", zipfile.ZIP_DEFLATED) as archive:
    for name in names:
        archive.write(name)
print("zipped:", ", ".join(names))
"""

# A Word document of the report (python-docx, from the sandbox environment), with the chart if there is one.
_DOCX_CODE = """import csv, os
from docx import Document
from docx.shared import Inches
doc = Document()
doc.add_heading("Visitors report", level=1)
rows = list(csv.reader(open("/mnt/data/report.csv"))) if os.path.exists("/mnt/data/report.csv") else [
    ("month", "visitors"), ("Jan", "1200"), ("Feb", "1500")]
doc.add_paragraph(f"{len(rows) - 1} months of visitors and signups.")
table = doc.add_table(rows=0, cols=len(rows[0]))
table.style = "Light Grid Accent 1"
for row in rows:
    cells = table.add_row().cells
    for cell, value in zip(cells, row):
        cell.text = str(value)
if os.path.exists("/mnt/data/chart.png"):
    doc.add_picture("/mnt/data/chart.png", width=Inches(5.5))
doc.save("/mnt/data/report.docx")
print("report.docx:", len(doc.paragraphs), "paragraphs,", len(rows), "table rows")
"""

_LIST_CODE = """import os
for name in sorted(os.listdir("/mnt/data")):
    print(f"{os.path.getsize(name):>10}  {name}")
"""

# Longer than the time limit: the run is stopped, and the rows written until then stay.
_LONG_CODE = """import csv, time
with open("/mnt/data/progress.csv", "w", newline="") as handle:
    writer = csv.writer(handle)
    writer.writerow(("step", "seconds"))
    for step in range(1, 601):
        writer.writerow((step, step))
        handle.flush()
        time.sleep(1)
print("all 600 steps done")
"""

_HELP = (
    'I am the offline demo model of code-sessions. Try: "make a csv report", then "plot it" (or "an '
    'interactive chart"), then "summarise it" (it reuses the data the first step loaded), then "zip '
    'both", or "list my files", or '
    '"run a long job" (it meets the time limit). "Give me an upload link for sales.csv" gives you a link '
    'to send a file of any size into this chat, and "save it to knowledge" tells you how to put a file '
    "into a Knowledge base. You can also paste a ```python block and I will run it."
)

# What Open WebUI puts around the user's words: the attached files' tags, and the retrieval's template
# (its sources, then the user's words after `</context>`).
_ATTACHED = re.compile(r"<attached_files>.*?</attached_files>\s*", re.S)
# The Filter's sentence after a command it answered: "(The user typed !x. <said> Tell the user this ...)".
_FILTER_SAID = re.compile(
    r"^\(The user typed \S+\. (.*) Tell the user this in one sentence; run no code\.\)$", re.S
)

_UPLOAD = re.compile(r"\bupload\b", re.I)
_ASK_NAME = "Which name should the file have in /mnt/data?"
_KNOWLEDGE = re.compile(r"\b(?:save|add|put|store|copy|send|keep)\b.*\bknowledge\b", re.I | re.S)
# A file the user names: `sales.csv`, `/mnt/data/out/report.csv` (a word with an extension).
_FILE_NAME = re.compile(r"(?<![\w/.-])(?:/mnt/data/)?((?:[\w-]+/)*[\w-][\w.-]*\.[A-Za-z0-9]{1,8})(?![\w/-])")
# The Knowledge base the user names: "... knowledge base Research", "... into my Research knowledge".
_BASE_AFTER = re.compile(r"\bknowledge(?: base)?(?: called| named)? [\"']?(\w[\w .-]*?)[\"']?[.!?]?$", re.I)
_BASE_BEFORE = re.compile(r"\b(?:to|into|in) (?:the |my |our )?[\"']?(\w[\w .-]*?)[\"']? knowledge\b", re.I)
# The newest file of the chat: the first one the system prompt lists ("Files now in /mnt/data ...").
_LISTED_FILE = re.compile(r"^- /mnt/data/(\S+) \(", re.M)


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _last_user(messages: list[dict]) -> str:
    """The user's own words in the last user message."""
    for message in reversed(messages):
        if message.get("role") == "user":
            text = _ATTACHED.sub("", _text(message.get("content")))
            if text.lstrip().startswith("### Task:") and "</context>" in text:
                text = text.rsplit("</context>", 1)[1]
            return text.strip()
    return ""


def _last_answer(messages: list[dict]) -> str:
    for message in reversed(messages[:-1]):
        if message.get("role") == "assistant":
            return _text(message.get("content"))
    return ""


def _newest_file(messages: list[dict]) -> str | None:
    system = next((_text(m.get("content")) for m in messages if m.get("role") == "system"), "")
    listed = _LISTED_FILE.search(system.partition("Files now in /mnt/data")[2])
    if listed:
        return listed.group(1)
    for message in reversed(messages):  # no prompt (a model without the product): the last path named
        if message.get("role") == "assistant":
            named = re.findall(r"/mnt/data/([^\s,)`'\"]+[\w])", _text(message.get("content")))
            if named:
                return named[-1]
    return None


def _upload_link(request: str, messages: list[dict], offered: set) -> dict | None:
    """An upload_link call for the file the user names, or the question which; None: not asked for."""
    asked = bool(_UPLOAD.search(request))
    answering = _last_answer(messages).startswith(_ASK_NAME)
    if not asked and not answering:
        return None
    named = _FILE_NAME.search(request)
    if named is None:
        if not asked:
            return None
        return {"content": f'{_ASK_NAME} Say for example "give me an upload link for sales.csv".'}
    if "upload_link" not in offered:
        return {
            "content": "I cannot make upload links here (the Code Sessions tools are not on in this chat). "
            "Attach the file with + under the message box instead."
        }
    arguments = json.dumps({"path": f"/mnt/data/{named.group(1)}"})
    return {"content": "", "tool_call": ("upload_link", arguments), "raw": True}


def _save_to_knowledge(request: str, messages: list[dict]) -> dict | None:
    """How to put a file into a Knowledge base: the command for the user to send. None: not asked."""
    if not _KNOWLEDGE.search(request):
        return None
    named = _FILE_NAME.search(request)
    path = named.group(1) if named else _newest_file(messages)
    if path is None:
        return {"content": "This chat has no file to save yet. Make one first, for example a csv report."}
    line = request.strip().splitlines()[-1] if request.strip() else ""
    bases = [
        found.group(1).strip() for found in (_BASE_BEFORE.search(line), _BASE_AFTER.search(line)) if found
    ]
    name = next((base for base in bases if base.lower() not in ("a", "the", "my", "base", "knowledge")), "")
    command = f"!save-to-knowledge /mnt/data/{path}"
    mine = "It is a message you send yourself: I cannot write into a Knowledge base."
    # The name as text (a /mnt/data path would become a link, and a preview, once more): the command has it.
    if name:
        return {
            "content": f'To put {path} into your Knowledge base "{name}", send:\n\n'
            f"`{command} {name}`\n\n{mine}"
        }
    return {
        "content": f"Which Knowledge base should {path} go into? Send:\n\n"
        f"`{command} <name of the base>`\n\n`!save-to-knowledge` alone lists the bases you may add "
        f"to. {mine}"
    }


def _code_for(request: str) -> tuple[str, str] | None:
    block = _BLOCK.search(request)
    if block:
        return ("bash" if block.group(1) in ("bash", "sh") else "python"), block.group(2)
    lowered = request.lower()
    for words, language, code in (
        (("long job",), "python", _LONG_CODE),
        (("zip",), "python", _ZIP_CODE),
        (("interactive", "plotly"), "python", _PLOTLY_CODE),
        (("plot", "chart", "graph"), "python", _PLOT_CODE),
        (("summar", "describe", "statistic"), "python", _SUMMARY_CODE),
        (("word", "docx"), "python", _DOCX_CODE),
        (("csv", "report"), "python", _CSV_CODE),
        (("list", "files", " ls"), "python", _LIST_CODE),
    ):
        if any(word in lowered for word in words):
            return language, code
    return None


def _after_run(messages: list[dict]) -> str:
    request = _last_user(messages)
    for line in request.splitlines():
        if line.lower().startswith("reply:"):
            return line.split(":", 1)[1].strip()
    result = _text(messages[-1].get("content"))
    headline = result.split("\n", 1)[0]
    if headline.startswith(("Upload link for", "No upload link")):  # the upload_link tool's result
        link = _UPLOAD_LINK.search(result)
        if link is None:
            return headline
        path = headline.removeprefix("Upload link for ").split(": ", 1)[0]
        within = re.search(r", once, within (.+?)\. Give", result)
        when = f", within {within.group(1)}" if within else ""
        return (
            f"Upload the file here: {link.group()}\n\nIt becomes {path} in this chat. The link takes one "
            f"file, once{when}: open it in a browser, or send the file from anywhere with "
            f"`curl -F file=@{path.rsplit('/', 1)[-1]} {link.group()}`."
        )
    if " was stopped" in headline:  # the block above says which limit, and why
        return "It was stopped before it finished; what it wrote until then is kept."
    if headline.startswith("Not run") or "\nReason: " in result:  # failed: its headline says why
        return "The code did not work; what went wrong is in the block above."
    if "\nInteractive charts: " in result:  # shown in the message already: say how to use it
        return (
            "Here is the interactive chart: hover over a bar for its value, drag to zoom, double-click "
            "to zoom out; the camera button above it downloads it as a PNG."
        )
    saved = re.findall(
        r"/mnt/data/[^\s,]+", "\n".join(line for line in result.splitlines() if line.startswith("Saved:"))
    )
    if saved:
        # Each file once, where the answer names it: a picture shown, the others as links.
        images = [p for p in saved if p.lower().endswith((".png", ".jpg", ".jpeg", ".gif", ".webp"))]
        others = [p for p in saved if p not in images]
        parts = []
        if others:
            files = "Your file is ready" if len(others) == 1 else "Your files are ready"
            parts.append(f"{files}: {', '.join(others)}")
        if images:
            parts.append("Here it is:\n\n" + "\n\n".join(images))
        return "\n\n".join(parts)
    return "Done. The output is above."


def answer(body: dict) -> dict:
    """The assistant message for a chat request: {'content': str} or {'tool_call': (language, code)}."""
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    after_tool = last.get("role") == "tool" or _text(last.get("content")).startswith("Output of the code")
    if after_tool:
        return {"content": _after_run(messages)}
    request = _last_user(messages)
    said = _FILTER_SAID.match(request)
    if said:  # the Filter answered a command the user typed: pass its sentence on
        return {"content": said.group(1)}
    call = _CALL.search(request)
    offered = {t.get("function", {}).get("name") for t in body.get("tools") or []}
    if call and call.group(1) in offered:
        return {"content": "", "tool_call": (call.group(1), call.group(2)), "raw": True}
    if not _BLOCK.search(request):
        worded = _upload_link(request, messages, offered) or _save_to_knowledge(request, messages)
        if worded is not None:
            return worded
    code = _code_for(request)
    if code is None:
        return {"content": _HELP}
    language, source = code
    if body.get("tools"):
        return {"content": "", "tool_call": (language, source)}
    return {"content": f"Running it:\n\n```{language}\n{source.rstrip()}\n```\n"}


class _Handler(BaseHTTPRequestHandler):
    server_version = "scripted-model/1"
    requests_seen: ClassVar[list[dict]] = []
    lock = threading.Lock()

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, payload: object, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/models"):
            self._json({"object": "list", "data": [{"id": MODEL_ID, "object": "model", "owned_by": "demo"}]})
        elif self.path == "/_requests":
            with self.lock:
                self._json(list(self.requests_seen))
        else:
            self._json({"error": "not found"}, 404)

    def do_POST(self) -> None:
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._json({"error": "not found"}, 404)
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        with self.lock:
            self.requests_seen.append(body)
        reply = answer(body)
        if body.get("stream"):
            self._stream(body, reply)
        else:
            self._json(_completion(body, reply))

    def _stream(self, body: dict, reply: dict) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        for chunk in _chunks(body, reply):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


def _base(body: dict) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "created": int(time.time()),
        "model": body.get("model"),
    }


def _call(reply: dict) -> tuple[str, str]:
    """(tool name, JSON arguments) of the reply's tool call."""
    if reply.get("raw"):
        return reply["tool_call"]
    language, code = reply["tool_call"]
    return "run_code", json.dumps({"language": language, "code": code})


def _completion(body: dict, reply: dict) -> dict:
    message: dict = {"role": "assistant", "content": reply["content"]}
    if "tool_call" in reply:
        name, arguments = _call(reply)
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:8]}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        ]
    finish = "tool_calls" if "tool_call" in reply else "stop"
    return {
        **_base(body),
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


def _chunks(body: dict, reply: dict) -> Iterator[dict]:
    """The streamed answer's chunks, made as they are sent (a long answer is never held as thousands of
    objects at once)."""
    base = {**_base(body), "object": "chat.completion.chunk"}

    def delta(payload: dict, finish: str | None = None) -> dict:
        return {**base, "choices": [{"index": 0, "delta": payload, "finish_reason": finish}]}

    yield delta({"role": "assistant", "content": ""})
    content = reply["content"]
    # Small uneven pieces, like a real model, so paths arrive split across chunks.
    for start in range(0, len(content), 7):
        yield delta({"content": content[start : start + 7]})
    if "tool_call" in reply:
        name, arguments = _call(reply)
        half = len(arguments) // 2
        call_id = f"call_{uuid.uuid4().hex[:8]}"
        yield delta(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": arguments[:half]},
                    }
                ]
            }
        )
        yield delta({"tool_calls": [{"index": 0, "function": {"arguments": arguments[half:]}}]})
        yield delta({}, "tool_calls")
    else:
        yield delta({}, "stop")


def serve(port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description="Scripted OpenAI-compatible model server (offline demo).")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    server = serve(args.port, args.host)
    print(f"scripted model '{MODEL_ID}' on http://{args.host}:{args.port}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
