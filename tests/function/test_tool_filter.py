"""The installed Tool and Filter, driven in-process with real storage and real gVisor (see tool_harness):
a plain model with both enabled gets what the Pipe gives, on the same store and kernels as the Pipe."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.support.pipe_harness import PipeHarness, code
from tests.support.tool_harness import ToolHarness

pytestmark = pytest.mark.runsc

LINK = re.compile(r"\((/api/v1/files/code-sessions-[0-9a-f-]{36}/content)\)")
WRITE_REPORT = code(
    "import csv\n"
    "with open('/mnt/data/report.csv', 'w', newline='') as f:\n"
    "    csv.writer(f).writerows([('name', 'score'), ('ada', 3)])\n"
    "rows = 1",
    "Here is your report: /mnt/data/report.csv",
)


@pytest.fixture
async def tool(tmp_path) -> ToolHarness:
    harness = ToolHarness(tmp_path / "data", valves={"timeout_seconds": 15})
    yield harness
    await harness.aclose()


def published(harness, url: str, viewer: str = "u1") -> bytes:
    served = harness.files.fetch(url, viewer)  # as Open WebUI's Files API serves it to the owner
    assert served is not None, url
    return served.body


async def test_a_plain_model_runs_code_in_mnt_data_and_the_answer_links_the_file(tool: ToolHarness):
    turn = await tool.say("u1", "chat-1", WRITE_REPORT)
    [result] = turn.tool_results
    assert result.startswith("Python finished"), result
    assert "/mnt/data/report.csv" in result  # the model is told what its run saved
    # Linked while streaming (the path arrives in 7-character pieces) and in the saved message.
    for text in (turn.streamed, turn.saved):
        assert "Here is your report: [report.csv](/api/v1/files/code-sessions-" in text, text
        assert "/mnt/data/report.csv" not in text
    url = LINK.findall(turn.saved)[-1]
    assert published(tool, url) == b"name,score\r\nada,3\r\n"
    # The Filter told the model about the folder and that the tool runs its code.
    system = tool.requests[0]["messages"][0]
    assert system["role"] == "system" and "`run_code` tool" in system["content"]
    assert "Write a figure's path in your answer to show it" in system["content"]  # none shows by itself
    # The linked file is attached to the message.
    files = [e for e in turn.events if e["type"] == "chat:message:files"]
    assert files and files[-1]["data"]["files"][0]["name"] == "report.csv"


async def test_the_filter_leaves_a_chat_without_the_tool_alone(tool: ToolHarness):
    turn = await tool.say("u1", "chat-1", "hello /mnt/data/x.csv", tool_enabled=False)
    [request] = tool.requests
    assert [m["role"] for m in request["messages"]] == ["user"]  # no system prompt about a sandbox
    assert not tool.sessions_root.exists()  # and no session made for it
    assert turn.saved == turn.streamed


async def test_the_filter_does_nothing_for_a_user_the_tool_is_not_shared_with(tool: ToolHarness):
    # tool_ids come from the caller: a user without a grant on the Tool can name it anyway.
    tool.no_tool_access.add("mallory")
    upload = tool.upload("mallory", "big.csv", b"x" * 1000)
    turn = await tool.say("mallory", "chat-1", "hello /mnt/data/big.csv", files=[upload])
    assert [m["role"] for m in tool.requests[0]["messages"]] == ["user"]  # no prompt about a sandbox
    assert not tool.sessions_root.exists()  # nothing copied in, no session made
    assert turn.saved == turn.streamed


async def test_kernel_state_and_files_persist_across_turns(tool: ToolHarness):
    first = await tool.say("u1", "chat-1", WRITE_REPORT)
    second = await tool.say(
        "u1",
        "chat-1",
        code("print('rows', rows + 1, open('/mnt/data/report.csv').read().splitlines()[1])"),
        history=[{"role": "user", "content": WRITE_REPORT}, {"role": "assistant", "content": first.saved}],
    )
    assert "rows 2 ada,3" in second.tool_results[0], second.tool_results
    # The earlier answer reaches the model with its link turned back into the path it named.
    earlier = next(m for m in tool.requests[-1]["messages"] if m["role"] == "assistant")
    assert "/mnt/data/report.csv" in earlier["content"] and "/api/v1/files/" not in earlier["content"]
    # And the folder's files are listed for it.
    assert "/mnt/data/report.csv" in tool.requests[-1]["messages"][0]["content"]


async def test_another_chat_sees_neither_the_files_nor_the_variables(tool: ToolHarness):
    await tool.say("u1", "chat-1", WRITE_REPORT)
    other = await tool.say(
        "u1", "chat-2", code("import os\nprint(sorted(os.listdir('/mnt/data')), 'rows' in globals())")
    )
    assert "[] False" in other.tool_results[0], other.tool_results


async def test_the_filter_copies_an_upload_in_and_tells_the_model(tool: ToolHarness):
    upload = tool.upload("u1", "scores.csv", b"a,b\n1,2\n")
    turn = await tool.say("u1", "chat-1", code("print(open('/mnt/data/scores.csv').read())"), files=[upload])
    assert "a,b\n1,2" in turn.tool_results[0], turn.tool_results
    assert "/mnt/data/scores.csv" in tool.requests[0]["messages"][0]["content"]
    # Someone else's file id in a request copies nothing.
    theirs = tool.upload("u2", "secret.csv", b"secret")
    listing = code("import os\nprint(sorted(os.listdir('/mnt/data')))")
    again = await tool.say("u1", "chat-1", listing, files=[theirs])
    assert "['scores.csv']" in again.tool_results[0], again.tool_results


async def test_a_run_over_the_limit_says_why_to_the_model(tool: ToolHarness):
    tool.set_valves(timeout_seconds=2)
    turn = await tool.say("u1", "chat-1", code("import time\ntime.sleep(30)"))
    assert "time limit" in turn.tool_results[0], turn.tool_results


async def test_clear_files_through_the_filter_empties_the_folder(tool: ToolHarness):
    await tool.say("u1", "chat-1", WRITE_REPORT)
    await tool.say("u1", "chat-1", "!clear-files")
    asked = next(
        r["messages"][-1]["content"] for r in tool.requests if "!clear-files" in r["messages"][-1]["content"]
    )
    assert "Deleted every file in this chat's /mnt/data (1 files" in asked, asked
    listing = await tool.say("u1", "chat-1", code("import os\nprint(sorted(os.listdir('/mnt/data')))"))
    assert "[]" in listing.tool_results[0]


async def test_a_chat_used_through_the_pipe_then_the_tool_shares_folder_and_state(tmp_path):
    pipe = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 15})
    tool = ToolHarness.beside(pipe)
    try:
        await pipe.say("u1", "chat-1", code("open('/mnt/data/a.txt','w').write('from the pipe')\nx = 41"))
        turn = await tool.say("u1", "chat-1", code("print(x + 1, open('/mnt/data/a.txt').read())"))
        assert "42 from the pipe" in turn.tool_results[0], turn.tool_results
        # One store and one kernel pool for the process, whichever file asked first.
        assert tool.tools._adapter._services is pipe.pipe._services
        assert tool.filter._adapter._services is pipe.pipe._services
        kernels = pipe.pipe._services.kernels.kernels()
        assert len(kernels) == 1, kernels
        # And back: the Pipe sees what the Tool did.
        await tool.say("u1", "chat-1", code("open('/mnt/data/b.txt','w').write('from the tool')\ny = 7"))
        answer = await pipe.say("u1", "chat-1", code("print(x + y, open('/mnt/data/b.txt').read())"))
        assert "48 from the tool" in answer, answer
    finally:
        await tool.aclose()
        await pipe.aclose()


THREE_FILES = code("for name in 'abc':\n    open(f'/mnt/data/{name}.txt', 'w').write(name)")


async def test_the_pipe_and_the_tool_each_enforce_their_own_quotas_also_at_once(tmp_path):
    """One store serves both files (the same storage valves), and each message brings its own quotas:
    the Pipe's one new file per run and the Tool's five, one after the other and at once."""
    pipe = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 15, "max_new_files_per_run": 1})
    tool = ToolHarness.beside(pipe, max_new_files_per_run=5)
    try:
        kept = "import os\nprint(sorted(os.listdir('/mnt/data')))"
        for chats in (("p1", "t1"), ("p2", "t2")):
            if chats[0] == "p1":  # one after the other
                await pipe.say("u1", "p1", THREE_FILES)
                await tool.say("u2", "t1", THREE_FILES)
            else:  # at once
                await asyncio.gather(pipe.say("u1", "p2", THREE_FILES), tool.say("u2", "t2", THREE_FILES))
            assert tool.tools._adapter._services is pipe.pipe._services
            through_pipe = await pipe.say("u1", chats[0], code(kept))
            assert "['a.txt']" in through_pipe, through_pipe  # the oldest one new file is kept
            through_tool = await tool.say("u2", chats[1], code(kept))
            assert "['a.txt', 'b.txt', 'c.txt']" in through_tool.tool_results[0], through_tool.tool_results
    finally:
        await tool.aclose()
        await pipe.aclose()


async def test_the_pipe_and_the_tool_each_keep_their_own_kernel_settings_also_at_once(tmp_path):
    """One kernel pool serves both files, and each message brings its own kernel settings: the Pipe's
    chats' kernels are saved and stopped after its idle time of about a second, while the Tool's
    (an hour) run on, whichever file spoke last, one after the other and at once."""
    pipe = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 15, "kernel_idle_minutes": 0.02})
    tool = ToolHarness.beside(pipe, kernel_idle_minutes=60)
    try:
        for chats in (("p1", "t1"), ("p2", "t2")):
            if chats[0] == "p1":  # one after the other, the Tool last
                await pipe.say("u1", "p1", code("x = 1"))
                await tool.say("u2", "t1", code("x = 2"))
            else:  # at once
                await asyncio.gather(pipe.say("u1", "p2", code("x = 1")), tool.say("u2", "t2", code("x = 2")))
            engine = pipe.pipe._services
            assert tool.tools._adapter._services is engine
            pool = engine.kernels
            piped = (await engine.chat("u1", chats[0])).kernel_key
            tooled = (await engine.chat("u2", chats[1])).kernel_key
            assert {piped, tooled} <= set(pool.kernels())
            kept = pool.kernels()[tooled]
            deadline = asyncio.get_running_loop().time() + 30
            while piped in pool.kernels():  # the reaper's doing, every quarter of the idle time
                assert asyncio.get_running_loop().time() < deadline, "the Pipe's kernel was not stopped"
                await asyncio.sleep(0.1)
            assert pool.kernels().get(tooled) is kept and kept.alive  # the Tool's runs on
            through_tool = await tool.say("u2", chats[1], code("print(x)"))
            assert "2" in through_tool.tool_results[0], through_tool.tool_results
            assert pool.kernels()[tooled] is kept
    finally:
        await tool.aclose()
        await pipe.aclose()


async def test_a_valve_change_in_one_file_does_not_close_the_services_another_uses(tmp_path):
    pipe = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 15})
    tool = ToolHarness.beside(pipe)
    try:
        await pipe.say("u1", "chat-1", code("x = 1"))
        await tool.say("u1", "chat-1", code("print(x)"))
        shared = pipe.pipe._services
        tool.set_valves(kernel="fresh")  # the Tool's admin switches kernels off; the Pipe keeps its own
        turn = await tool.say("u1", "chat-1", code("print('x' in globals())"))
        assert "False" in turn.tool_results[0], turn.tool_results
        assert tool.tools._adapter._services is not shared
        answer = await pipe.say("u1", "chat-1", code("print('x is', x)"))
        assert "x is 1" in answer, answer  # the Pipe's kernel was not stopped under it
    finally:
        await tool.aclose()
        await pipe.aclose()


async def test_maintenance_looks_at_open_webuis_chats_once_per_minute_whichever_files_run(tmp_path):
    pipe = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 15})
    tool = ToolHarness.beside(pipe)
    adapters = [pipe.pipe, tool.tools._adapter, tool.filter._adapter]
    for adapter in adapters:
        adapter.maintenance.minute_s = 0.3
    try:
        await pipe.say("u1", "chat-1", code("print(1)"))  # the Pipe's loop starts
        await asyncio.sleep(0.1)  # the loops tick at different moments, as files first used apart do
        await tool.say("u1", "chat-1", code("print(2)"))  # the Filter's, then the Tool's loops start
        hosts = [adapter._host for adapter in adapters]
        for host in hosts:
            host.lookups = 0
        await asyncio.sleep(3.0)  # ten "minutes", three loops ticking in each
        lookups = sum(getattr(host, "lookups", 0) for host in hosts)
        assert 3 <= lookups <= 13, lookups  # about one per minute, not three
    finally:
        await tool.aclose()
        await pipe.aclose()


async def test_a_chat_deleted_in_open_webui_loses_its_files_with_only_the_tool_and_filter(tool: ToolHarness):
    for adapter in (tool.tools._adapter, tool.filter._adapter):
        adapter.maintenance.minute_s = 0.05  # set before the loops start, at the first message
        adapter.maintenance.deleted_after_s = 0.2
    await tool.say("u1", "chat-1", WRITE_REPORT)
    [folder] = [p for p in (tool.sessions_root / "sessions").glob("*/*") if p.is_dir()]
    tool.deleted_chats.add(("u1", "chat-1"))
    for _ in range(100):
        await asyncio.sleep(0.05)
        if not folder.exists():
            break
    assert not folder.exists()


async def test_a_purge_typed_into_the_tools_valves_runs_and_is_cleared(tool: ToolHarness):
    for adapter in (tool.tools._adapter, tool.filter._adapter):
        adapter.maintenance.minute_s = 0.05
    await tool.say("u1", "chat-1", WRITE_REPORT)
    [folder] = [p for p in (tool.sessions_root / "sessions").glob("*/*") if p.is_dir()]
    tool.set_valves(purge="user:u1")
    for _ in range(100):
        await asyncio.sleep(0.05)
        if not folder.exists() and tool.stored_tool_valves["purge"] == "":
            break
    assert not folder.exists()
    assert tool.stored_tool_valves["purge"] == ""


SAVE_TWO = code(
    "open('/mnt/data/named.csv', 'w').write('a\\n1\\n')\nopen('/mnt/data/extra.txt', 'w').write('x')",
    "Here it is: /mnt/data/named.csv",
)


async def test_a_file_the_tools_run_saved_but_the_answer_did_not_name_is_attached_once(tool: ToolHarness):
    """As with the Pipe (issue 23): each file once in the text, every one among the attachments."""
    turn = await tool.say("u1", "chat-1", SAVE_TWO)
    assert turn.saved.count("named.csv") == 1 and "extra.txt" not in turn.saved, turn.saved
    files = [e for e in turn.events if e["type"] == "chat:message:files"]
    assert files, turn.events
    assert sorted(f["name"] for f in files[-1]["data"]["files"]) == ["extra.txt", "named.csv"]
    # The next answer hands over nothing of this one's.
    later = await tool.say("u1", "chat-1", code("print(1)", "Nothing new."))
    assert not [e for e in later.events if e["type"] == "chat:message:files"], later.events


async def test_without_attachments_the_unnamed_file_is_named_in_one_line(tool: ToolHarness):
    tool.set_valves(attach_files=False)
    turn = await tool.say("u1", "chat-1", SAVE_TWO)
    [line] = [line for line in turn.saved.splitlines() if "extra.txt" in line]
    assert line.startswith("Saved: [extra.txt](/api/v1/files/code-sessions-"), turn.saved
    assert line in turn.shown.splitlines(), turn.shown  # and on the page, which shows the output
    assert not [e for e in turn.events if e["type"] == "chat:message:files"]
