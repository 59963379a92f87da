"""Code Sessions for any model: the bundled Tool and Filter installed in a real Open WebUI 0.12.4 as an
admin would, enabled on a plain model (the scripted OpenAI-compatible one, which calls `run_code`
natively), no Pipe model selected; then the same chat continued through the Pipe. Real gVisor.

Open WebUI runs native tool calls only on its streaming path, as the web UI drives it: a request with a
`session_id`, answered by a background task that saves the message in the chat. These tests send that
request and read the saved chat, as the browser would after its socket said the answer was done.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser

from storage._keys import id_key
from tests.e2e.test_browser import Rendered, drawn_chart, logged_in, open_chat
from tests.support.open_webui import (
    BASE_MODEL,
    LINK,
    MODEL,
    Account,
    OpenWebUI,
    Reply,
    message_text,
    running_open_webui,
    saved_answer,
    say_streamed,
)

pytestmark = [pytest.mark.e2e, pytest.mark.runsc]

REPO = Path(__file__).resolve().parents[2]
TOOL_ID = "code_sessions_tool"
FILTER_ID = "code_sessions_filter"
TOOLS_MODEL = BASE_MODEL  # the plain model, with the Tool and the Filter enabled on it
EVERYONE = [{"principal_type": "user", "principal_id": "*", "permission": "read"}]


def run(code: str, reply: str = "") -> str:
    return f"```python\n{code}\n```\n" + (f"reply: {reply}" if reply else "")


def _install(server: OpenWebUI) -> None:
    """What an admin does: Workspace → Tools → import the Tool; Functions → import the Filter and
    switch it on; set the Tool's valves; enable both on a model."""
    admin = server.admin
    tool = {
        "id": TOOL_ID,
        "name": "Code Sessions Tool",
        "content": (REPO / "dist" / "code_sessions_tool.py").read_text(),
        "meta": {"description": "run_code in the chat's /mnt/data and kernel"},
        "access_grants": EVERYONE,
    }
    response = admin.post("/api/v1/tools/create", tool)
    assert response.status_code == 200, response.text
    valves = admin.get(f"/api/v1/tools/id/{TOOL_ID}/valves").json() or {}
    changed = {**valves, "timeout_seconds": 20}
    admin.post(f"/api/v1/tools/id/{TOOL_ID}/valves/update", changed).raise_for_status()
    function = {
        "id": FILTER_ID,
        "name": "Code Sessions Filter",
        "content": (REPO / "dist" / "code_sessions_filter.py").read_text(),
        "meta": {"description": "Code Sessions: prompt, uploads, links"},
    }
    admin.post("/api/v1/functions/create", function).raise_for_status()
    admin.post(f"/api/v1/functions/id/{FILTER_ID}/toggle").raise_for_status()
    # Admin Panel → Settings → Models → the plain model: tick the Tool and the Filter, share it.
    model = {
        "id": TOOLS_MODEL,
        "base_model_id": None,
        "name": "demo-scripted",
        "meta": {"toolIds": [TOOL_ID], "filterIds": [FILTER_ID]},
        "params": {},
        "access_grants": EVERYONE,
    }
    response = admin.post("/api/v1/models/create", model)
    assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model_server: str) -> Iterator[OpenWebUI]:
    # An Open WebUI of its own: the Pipe is installed but no Pipe model is used until the last test,
    # so its background loop never starts and the Tool's and the Filter's do the maintenance alone.
    with running_open_webui(tmp_path_factory.mktemp("open-webui-tools"), model_server, ["bob"]) as found:
        _install(found)
        yield found


def say(
    account: Account,
    text: str,
    previous: Reply | None = None,
    *,
    files: list[dict] | None = None,
    model: str = TOOLS_MODEL,
    tool_ids: tuple[str, ...] = (TOOL_ID,),
) -> Reply:
    """One message as the web UI sends it for a model with tools (`tool_ids`: the model's tools the UI
    preselects), then the saved answer once its task is done."""
    return say_streamed(account, text, previous, files=files, model=model, tool_ids=tool_ids)


def tool_results(account: Account, reply: Reply) -> list[str]:
    chat = account.get(f"/api/v1/chats/{reply.chat_id}").json()["chat"]
    message = chat["history"]["messages"][reply.message_id]
    return [
        "".join(part.get("text", "") for part in item.get("output") or [] if isinstance(part, dict))
        for item in message.get("output") or []
        if item.get("type") == "function_call_output"
    ]


Deleted = tuple[Path, str, float]


@pytest.fixture(scope="module")
def deleted(server: OpenWebUI) -> Deleted:
    """A chat with a linked file, deleted in Open WebUI before the module's other tests: its files go
    after two looks a background minute apart, which then pass while the other tests run."""
    bob = server.accounts["bob"]
    reply = say(bob, run("open('/mnt/data/doomed.txt', 'w').write('d')", "Doomed: /mnt/data/doomed.txt"))
    [link] = set(reply.links())
    folder = server.sessions_root / "sessions" / id_key(bob.user_id) / id_key(reply.chat_id)
    assert folder.is_dir() and bob.download(link).status_code == 200
    assert bob.delete(f"/api/v1/chats/{reply.chat_id}").status_code == 200
    return folder, link.split("/")[4], time.monotonic()


@pytest.fixture(scope="module")
def first(server: OpenWebUI, deleted: Deleted) -> Reply:
    return say(
        server.admin,
        run(
            "import csv\n"
            "with open('/mnt/data/report.csv', 'w', newline='') as f:\n"
            "    csv.writer(f).writerows([('name', 'score'), ('ada', 3), ('bob', 5)])\n"
            "total = 8",
            "Here is your report: /mnt/data/report.csv",
        ),
    )


def test_a_plain_model_with_the_tool_writes_a_csv_whose_link_downloads(server: OpenWebUI, first: Reply):
    assert "Here is your report: [report.csv](/api/v1/files/code-sessions-" in first.content, first.content
    [link] = set(first.links())
    download = server.admin.download(link)
    assert download.status_code == 200
    assert download.content == b"name,score\r\nada,3\r\nbob,5\r\n"
    assert "attachment" in download.headers.get("content-disposition", "")
    # The run happened in the sandbox, as the model's tool call, in this chat's folder.
    [result] = tool_results(server.admin, first)
    assert "Python finished" in result and "/mnt/data/report.csv" in result, result
    folder = server.sessions_root / "sessions" / id_key(server.admin.user_id) / id_key(first.chat_id)
    assert (folder / "report.csv").is_file()
    # The model was offered run_code (the Tool's only public method, with the schema Open WebUI built
    # from its signature), and the Filter told it about /mnt/data and that tool.
    request = next(r for r in server.model_requests() if r.get("tools"))
    offered = {t["function"]["name"]: t["function"] for t in request["tools"]}
    spec = offered["run_code"]
    # Open WebUI adds its builtin tools; of the Tool's methods, run_code and upload_link are offered.
    assert not {"release", "settings", "_sessions"} & set(offered), sorted(offered)
    assert "upload_link" in offered, sorted(offered)
    assert set(spec["parameters"]["properties"]) == {"code", "language"}, spec
    assert spec["parameters"]["required"] == ["code"], spec
    system = request["messages"][0]
    assert system["role"] == "system" and "`run_code` tool" in system["content"], system


def test_the_answer_was_linked_as_it_streamed_and_its_file_attached(server: OpenWebUI, first: Reply):
    chat = server.admin.get(f"/api/v1/chats/{first.chat_id}").json()["chat"]
    message = chat["history"]["messages"][first.message_id]
    # What streamed (and Open WebUI saved as the output) already had the link: the outlet only added
    # the table's preview after it (Open WebUI keeps what streamed as `originalContent`).
    streamed = message["originalContent"]
    assert LINK.search(streamed), message
    preview = "\n\n_Preview · 2 rows, 2 columns (name: text, score: int)_"
    assert message_text(message).startswith(streamed + preview), message
    files = message.get("files") or []
    assert [f["name"] for f in files] == ["report.csv"], files
    assert files[0]["url"] == first.links()[0]


def test_a_variable_persists_across_turns(server: OpenWebUI, first: Reply):
    second = say(server.admin, run("print('total is', total + 1)", "ok"), previous=first)
    results = tool_results(server.admin, second)
    assert any("total is 9" in r for r in results), results


def test_a_chart_is_shown_inline(server: OpenWebUI):
    reply = say(server.admin, "please plot a chart\nreply: The chart: /mnt/data/chart.png")
    match = re.search(r"!\[chart\.png\]\((" + LINK.pattern + r")\)", reply.content)
    assert match, reply.content
    image = server.admin.download(match.group(1))
    assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
    assert image.headers["content-type"] == "image/png"
    # Shown inline, so not an attachment as well: each file once.
    message = server.admin.get(f"/api/v1/chats/{reply.chat_id}").json()["chat"]["history"]["messages"]
    files = message[reply.message_id].get("files") or []
    assert "chart.png" not in [f["name"] for f in files], files


@pytest.mark.browser
def test_the_tool_shows_a_table_preview_and_an_interactive_chart(
    server: OpenWebUI, browser: Browser, tmp_path: Path
):
    source = (
        "import plotly.graph_objects as go\n"
        "with open('/mnt/data/sales.csv', 'w') as f:\n"
        "    f.write('region,sales\\nnorth,<b>12</b>\\nsouth,7\\n')\n"
        "go.Figure(go.Bar(x=['north', 'south'], y=[12, 7])).show()"
    )
    reply = say(server.admin, run(source, "The sales: /mnt/data/sales.csv"))
    # The Filter's outlet puts the preview after the answer's text; the Tool's run showed the chart.
    assert "_Preview · 2 rows, 2 columns (region: text, sales: text)_" in reply.content, reply.content
    messages = server.admin.get(f"/api/v1/chats/{reply.chat_id}").json()["chat"]["history"]["messages"]
    assert len(messages[reply.message_id]["embeds"]) == 1
    [result] = tool_results(server.admin, reply)
    assert "Interactive charts: /mnt/data/chart-1.plotly.json (already shown to the user" in result, result

    context = logged_in(browser, server, server.admin, height=900)
    page = context.new_page()
    answer = Rendered(page, reply)
    outer = answer.message.locator(f"[id='{reply.message_id}-embeds-container'] iframe")
    errors = open_chat(page, server, reply, outer, tmp_path)
    chart = drawn_chart(outer)
    assert chart.evaluate("() => Array.from(document.getElementById('chart-0').data[0].y)") == [12, 7]
    table = answer.content.locator("table")
    assert [c.strip() for c in table.locator("td").all_inner_texts()] == ["north", "<b>12</b>", "south", "7"]
    assert not errors, errors
    context.close()


def test_a_file_the_run_saved_that_the_answer_did_not_name_is_attached(server: OpenWebUI):
    reply = say(
        server.admin,
        run(
            "open('/mnt/data/named.csv', 'w').write('a\\n1\\n')\n"
            "open('/mnt/data/extra.txt', 'w').write('extra bytes')",
            "Here it is: /mnt/data/named.csv",
        ),
    )
    assert "extra.txt" not in reply.content, reply.content
    message = server.admin.get(f"/api/v1/chats/{reply.chat_id}").json()["chat"]["history"]["messages"]
    files = {f["name"]: f for f in message[reply.message_id].get("files") or []}
    assert set(files) == {"named.csv", "extra.txt"}, files
    download = server.admin.download(files["extra.txt"]["url"])
    assert download.status_code == 200 and download.content == b"extra bytes"


def test_an_upload_is_copied_into_mnt_data(server: OpenWebUI):
    bob = server.accounts["bob"]
    upload = bob.upload("scores.csv", b"name,score\nzoe,9\n")
    reply = say(bob, run("print(open('/mnt/data/scores.csv').read())", "read it"), files=[upload])
    assert any("zoe,9" in r for r in tool_results(bob, reply)), tool_results(bob, reply)


def test_another_user_cannot_open_the_links(server: OpenWebUI, first: Reply):
    bob = server.accounts["bob"]
    [link] = set(first.links())
    assert bob.download(link).status_code == 404
    assert httpx.get(server.url + link, timeout=30).status_code in (401, 403)


def test_a_chat_without_the_tool_is_left_alone(server: OpenWebUI):
    # The user switched the Tool off in this chat: the Filter, still on the model, does nothing.
    reply = say(server.admin, "hello", tool_ids=())
    request = server.model_requests()[-1]
    offered = {t["function"]["name"] for t in request.get("tools") or []}  # Open WebUI's builtins
    assert "run_code" not in offered, sorted(offered)
    assert [m["role"] for m in request["messages"]] == ["user"], request["messages"]
    folder = server.sessions_root / "sessions" / id_key(server.admin.user_id) / id_key(reply.chat_id)
    assert not folder.exists()


def test_a_user_the_tool_is_not_shared_with_gets_nothing_from_the_filter(server: OpenWebUI):
    # tool_ids are the caller's to send: carol names the Tool although it is not shared with her.
    carol = server.account(f"carol-{uuid.uuid4().hex[:6]}@example.com", "Carol-Passw0rd", admin=False)
    bob = server.accounts["bob"].user_id
    only_bob = [{"principal_type": "user", "principal_id": bob, "permission": "read"}]
    update = f"/api/v1/tools/id/{TOOL_ID}/access/update"
    server.admin.post(update, {"access_grants": only_bob}).raise_for_status()
    try:
        upload = carol.upload("big.csv", b"x" * 1000)
        reply = say(carol, run("print('never run')", "ok"), files=[upload])
        request = server.model_requests()[-1]
        offered = {t["function"]["name"] for t in request.get("tools") or []}
        assert "run_code" not in offered, sorted(offered)  # Open WebUI did not offer her the Tool
        system = [m for m in request["messages"] if m["role"] == "system"]
        assert not any("/mnt/data" in str(m.get("content")) for m in system), system
        assert not (server.sessions_root / "sessions" / id_key(carol.user_id)).exists()  # nothing copied
        assert not LINK.search(reply.content)
    finally:
        server.admin.post(update, {"access_grants": EVERYONE}).raise_for_status()


def test_the_same_chat_continued_through_the_pipe_sees_the_files_and_the_state(
    server: OpenWebUI, first: Reply
):
    # The last test here: the Pipe's first message in this Open WebUI.
    through_pipe = server.admin.say(
        run("print('total', total, open('/mnt/data/report.csv').read().splitlines()[1])\nfrom_pipe = 5"),
        previous=first,
        model=MODEL,
    )
    assert "total 8 ada,3" in through_pipe.content, through_pipe.content
    # And back to the Tool: what the Pipe's run defined is there.
    back = say(server.admin, run("print('back', total + from_pipe)", "ok"), previous=through_pipe)
    assert any("back 13" in r for r in tool_results(server.admin, back)), tool_results(server.admin, back)


def test_an_api_callers_chat_keeps_its_files_and_variables_through_the_tool(server: OpenWebUI):
    """A script calling the completions API for a model with the Tool (streamed with a session_id, as
    native tool calls need; no parent_id or user_message): Open WebUI files each answer with no parent,
    and each turn goes on from the chat's files and kernel."""
    admin = server.admin
    chat_id = admin.post("/api/v1/chats/new", {"chat": {}}).json()["id"]
    history: list[dict] = []
    results = []
    write = run("open('/mnt/data/a.txt', 'w').write('kept')\nx = 41", "ok")
    turns = (write, run("print(open('a.txt').read(), x + 1)"))
    for text in turns:
        answer_id = str(uuid.uuid4())
        payload = {
            "model": TOOLS_MODEL,
            "messages": [*history, {"role": "user", "content": text}],
            "chat_id": chat_id,
            "id": answer_id,
            "stream": True,
            "session_id": f"test-{uuid.uuid4().hex[:8]}",
            "tool_ids": [TOOL_ID],
        }
        response = admin.post("/api/chat/completions", payload)
        assert response.status_code == 200, response.text
        content = saved_answer(admin, chat_id, answer_id)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": content}]
        results.append(tool_results(admin, Reply(chat_id, answer_id, content, history)))
    assert "kept 42" in results[1][0] and "Started again" not in results[1][0], results


def test_a_clone_of_a_tool_chat_starts_from_its_files_and_variables(server: OpenWebUI) -> None:
    # Issue 35, the Tool and the Filter's form: the Filter's inlet starts the clone before the model runs.
    admin = server.admin
    first = say(admin, run("open('/mnt/data/report.csv', 'w').write('r')\ntotal = 8"))
    fork = admin.post(f"/api/v1/chats/{first.chat_id}/fork", {"message_id": first.message_id})
    assert fork.status_code == 200, fork.text
    at_first = Reply(fork.json()["id"], first.message_id, "", first.history)
    seen = say(admin, run("import os\nprint('total', total, sorted(os.listdir('/mnt/data')))"), at_first)
    [result] = tool_results(admin, seen)
    assert "total 8 ['report.csv']" in result, result
    assert result.count("Python state of the chat it was cloned from") == 1, result


def test_a_deleted_chats_files_go(server: OpenWebUI, deleted: Deleted):
    # Last in the module: the chat was deleted before the first test (the `deleted` fixture).
    folder, file_id, started = deleted
    while time.monotonic() - started < 200:
        if not folder.exists() and server.admin.get(f"/api/v1/files/{file_id}").status_code == 404:
            break
        time.sleep(5)
    assert not folder.exists(), f"still there after {time.monotonic() - started:.0f} s"
    assert server.admin.get(f"/api/v1/files/{file_id}").status_code == 404
