"""The installed function file, driven in-process with real storage and real gVisor (see pipe_harness)."""

from __future__ import annotations

import asyncio
import re

import pytest

from tests.support.files_api import URL_PATTERN as FILE_URL
from tests.support.pipe_harness import PipeHarness, code

pytestmark = pytest.mark.runsc

LINK = re.compile(r"\((" + FILE_URL + r")\)")


@pytest.fixture
async def harness(tmp_path) -> PipeHarness:
    harness = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 15})
    yield harness
    await harness.aclose()


async def test_files_persist_between_messages_and_links_point_at_copies(harness: PipeHarness):
    first = await harness.say(
        "u1", "chat-1", code("open('/mnt/data/a.txt','w').write('hello')", "See /mnt/data/a.txt")
    )
    url = LINK.findall(first)[-1]
    assert harness.files.fetch(url, "u1").body == b"hello"
    assert harness.files.fetch(url, "u2") is None  # another user: Open WebUI's 404
    second = await harness.say("u1", "chat-1", code("print(open('/mnt/data/a.txt').read().upper())"))
    assert "HELLO" in second
    system = harness.requests[-1]["messages"][0]
    assert system["role"] == "system" and "/mnt/data/a.txt" in system["content"]


async def test_background_tasks_never_run_code(harness: PipeHarness):
    answer = await harness.say(
        "u1", "chat-1", code("open('/mnt/data/x','w').write('1')"), task="title_generation"
    )
    assert '"object": "chat.completion"' in answer  # the base model's own reply, passed through
    assert "<details>" not in answer
    assert not list(harness.data_dir.rglob("x"))
    assert "tools" not in harness.requests[-1]


async def test_fenced_mode_runs_the_blocks_of_a_model_without_tools(harness: PipeHarness):
    harness.set_valves(execution_mode="fenced")
    answer = await harness.say("u1", "chat-1", code("print(6 * 7)"))
    assert "42" in answer
    assert all(not request.get("tools") for request in harness.requests)


async def test_attachment_is_copied_once_and_only_for_its_owner(harness: PipeHarness):
    mine = harness.upload("u1", "data.csv", b"a,b\n1,2\n")
    theirs = harness.upload("u2", "secret.csv", b"top secret\n")
    listing = code("import os\nprint(sorted(os.listdir('/mnt/data')))")
    first = await harness.say("u1", "chat-1", listing, files=[mine, theirs])
    assert "['data.csv']" in first
    again = await harness.say("u1", "chat-1", listing, files=[mine])
    assert "['data.csv']" in again


async def test_missing_runsc_is_a_clear_answer_and_the_chat_keeps_working(harness: PipeHarness):
    harness.set_valves(runsc_path="/nonexistent/runsc")
    answer = await harness.say("u1", "chat-1", code("print(1)"))
    assert "sandbox is not available" in answer and "runsc" in answer
    harness.set_valves(runsc_path="runsc")
    assert "ok-again" in await harness.say("u1", "chat-1", code("print('ok-again')"))


async def test_two_messages_in_one_chat_at_once_both_finish_and_keep_their_files(harness: PipeHarness):
    slow = code("import time\nopen('/mnt/data/one.txt','w').write('1')\ntime.sleep(1)\nprint('one done')")
    fast = code("open('/mnt/data/two.txt','w').write('2')\nprint('two done')")
    one, two = await asyncio.gather(harness.say("u1", "chat-1", slow), harness.say("u1", "chat-1", fast))
    assert "one done" in one and "two done" in two
    listing = await harness.say("u1", "chat-1", code("import os\nprint(sorted(os.listdir('/mnt/data')))"))
    assert "['one.txt', 'two.txt']" in listing


async def test_unconfigured_function_explains_itself(tmp_path):
    harness = PipeHarness(tmp_path / "data")
    harness.set_valves(base_models="")
    answer = await harness.say("u1", "chat-1", "hello")
    assert "base_models" in answer


async def test_a_run_is_announced_while_it_goes_and_its_files_shown_once(harness: PipeHarness):
    harness.set_valves(attach_files=True)
    write = "open('/mnt/data/r.csv','w').write('1')\nopen('/mnt/data/extra.txt','w').write('2')"
    answer = await harness.say("u1", "chat-1", code(write, "See /mnt/data/r.csv"), message_id="m1")
    statuses = [e["data"] for e in harness.events if e["type"] == "status"]
    assert statuses[0] == {"description": "Running Python\u2026", "done": False}
    # Then cleared: Open WebUI 0.12 shows a message's last status unless it is hidden.
    assert statuses[-1]["done"] and statuses[-1]["hidden"] is True, statuses
    assert answer.count("<details>") == 1
    shown = re.sub(r"<details>.*?</details>", "", answer, flags=re.S)
    assert shown.count("[r.csv](") == 1 and "extra.txt" not in shown and "Saved" not in shown
    # Both files are the message's attachments: the named one, and the one the answer left unnamed.
    [files_event] = [e for e in harness.events if e["type"] == "chat:message:files"]
    items = files_event["data"]["files"]
    assert [(i["type"], i["name"]) for i in items] == [("file", "r.csv"), ("file", "extra.txt")]
    assert items[0]["url"] in answer and items[1]["url"] not in answer
    assert "Saved: /mnt/data/extra.txt, /mnt/data/r.csv" in harness.requests[-1]["messages"][-1]["content"]


@pytest.mark.parametrize("why", ["attach_files off", "temporary chat"])
async def test_without_attachments_a_file_the_answer_left_unnamed_is_named_in_one_line(
    harness: PipeHarness, why: str
):
    harness.set_valves(attach_files=why != "attach_files off")
    chat = "temporary:abc" if why == "temporary chat" else "chat-1"
    answer = await harness.say(
        "u1", chat, code("open('/mnt/data/extra.txt','w').write('2')", "Done."), message_id="m1"
    )
    shown = re.sub(r"<details>.*?</details>", "", answer, flags=re.S)
    [line] = [line for line in shown.splitlines() if "extra.txt" in line]
    assert line.startswith("Saved: [extra.txt](/api/v1/files/code-sessions-")
    assert shown.count("extra.txt") == 1
    assert not [e for e in harness.events if e["type"] == "chat:message:files"]


async def test_background_cleanup_runs_a_purge_typed_into_the_valves_without_any_message(
    harness: PipeHarness,
):
    harness.pipe.maintenance.minute_s = 0.05  # a "minute" of the background loop lasts 50 ms here
    await harness.say("u1", "chat-1", code("open('/mnt/data/a.txt','w').write('1')"))
    [session_dir] = [p for p in (harness.sessions_root / "sessions").glob("*/*") if p.is_dir()]
    harness.stored_valves["purge"] = "user:u1"  # the admin saves the valve; no message follows
    for _ in range(100):
        await asyncio.sleep(0.05)
        if not session_dir.exists() and harness.stored_valves["purge"] == "":
            break
    assert not session_dir.exists()
    assert harness.stored_valves["purge"] == ""  # one-shot: cleared once done
    store = harness.pipe._services.store
    events = [entry.event for entry in await store.activity()]
    assert events.count("cleanup") >= 2  # the purge, and the periodic expiry


async def test_a_purge_that_meets_a_chat_mid_step_waits_for_it_instead_of_giving_up(
    harness: PipeHarness,
):
    harness.pipe.maintenance.minute_s = 0.05
    await harness.say("u1", "chat-1", code("open('/mnt/data/a.txt','w').write('1')"))
    [session_dir] = [p for p in (harness.sessions_root / "sessions").glob("*/*") if p.is_dir()]
    store = harness.pipe._services.store
    session = await store.session("u1", "chat-1")
    async with session.lock():  # a step of this chat is running
        harness.stored_valves["purge"] = "chat:chat-1"
        await wait_until(lambda: retried(harness, "chat:chat-1"))  # a second tick met it in use too
        assert session_dir.exists()
        assert harness.stored_valves["purge"] == "chat:chat-1"  # kept for the next tick
    await wait_until(lambda: not session_dir.exists() and harness.stored_valves["purge"] == "")


async def test_a_purge_gives_up_on_a_chat_that_stays_busy_and_says_so_by_clearing(harness: PipeHarness):
    harness.pipe.maintenance.minute_s = 0.05  # so the ten minutes of retries last half a second
    await harness.say("u1", "chat-1", code("open('/mnt/data/a.txt','w').write('1')"))
    [session_dir] = [p for p in (harness.sessions_root / "sessions").glob("*/*") if p.is_dir()]
    session = await harness.pipe._services.store.session("u1", "chat-1")
    async with session.lock():
        harness.stored_valves["purge"] = "chat:chat-1"
        await wait_until(lambda: retried(harness, "chat:chat-1"))
        await wait_until(lambda: harness.stored_valves["purge"] == "")
        assert session_dir.exists()  # never deleted under a running step
    assert harness.pipe.maintenance.purge_pending is None


def retried(harness: PipeHarness, request: str) -> bool:
    pending = harness.pipe.maintenance.purge_pending
    return pending is not None and pending[0] == request and pending[2] > pending[1]


async def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_the_model_reads_earlier_answers_with_mnt_data_paths_not_links(harness: PipeHarness):
    first = await harness.say(
        "u1", "chat-1", code("open('/mnt/data/a.txt','w').write('1')", "See /mnt/data/a.txt")
    )
    url = LINK.findall(first)[-1]
    history = [{"role": "user", "content": "make a"}, {"role": "assistant", "content": first}]
    await harness.say("u1", "chat-1", "thanks", history=history)
    seen = harness.requests[-1]["messages"]
    assert [m["role"] for m in seen] == ["system", "user", "assistant", "user"]
    assert url not in seen[2]["content"] and "See [a.txt](/mnt/data/a.txt)" in seen[2]["content"]


async def test_the_model_reads_an_earlier_runs_block_as_the_user_sees_it(harness: PipeHarness):
    # The block's body is written with `&amp;` for each `&` (Open WebUI decodes entities there): the
    # user sees `a && b &lt;`, and so does the model, not the encoding.
    first = await harness.say("u1", "chat-1", code("print('a && b &lt;')", "Done."))
    assert "print('a &amp;&amp; b &amp;lt;')" in first and "a &amp;&amp; b &amp;lt;\n" in first
    history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": first}]
    await harness.say("u1", "chat-1", "thanks", history=history)
    earlier = harness.requests[-1]["messages"][2]["content"]
    assert "print('a && b &lt;')" in earlier and "a && b &lt;\n" in earlier and "&amp;" not in earlier


async def test_a_failing_base_model_is_an_answer_not_a_crash(harness: PipeHarness):
    async def broken(*args, **kwargs):
        raise RuntimeError("connection refused")

    harness.pipe._host.call_model = broken
    answer = await harness.say("u1", "chat-1", "hello")
    assert "The model returned an error" in answer and "connection refused" in answer

    class ErrorResponse:  # what Open WebUI returns for an upstream HTTP error
        status_code = 502
        body = b'{"error": {"message": "upstream is down"}}'

    async def error_response(*args, **kwargs):
        return ErrorResponse()

    harness.pipe._host.call_model = error_response
    assert "upstream is down" in await harness.say("u1", "chat-1", "hello")


async def test_the_folder_of_a_chat_deleted_in_open_webui_goes_at_the_next_cleanup(harness: PipeHarness):
    harness.pipe.maintenance.minute_s = 0.05
    harness.pipe.maintenance.deleted_after_s = 0.2  # two looks this far apart must both miss it
    for chat in ("kept", "deleted"):
        await harness.say("u1", chat, code(f"open('/mnt/data/{chat}.txt','w').write('1')"))
    harness.deleted_chats.add(("u1", "deleted"))
    sessions = harness.sessions_root / "sessions"
    for _ in range(100):
        await asyncio.sleep(0.05)
        if not list(sessions.rglob("deleted.txt")):
            break
    assert not list(sessions.rglob("deleted.txt"))
    assert list(sessions.rglob("kept.txt"))


async def test_a_chat_being_created_during_a_cleanup_tick_keeps_its_folder(harness: PipeHarness):
    """The race an hour of grace used to cover: a session whose chat Open WebUI does not have yet
    (its row is being written) is seen missing by one look; the next look finds it, so it stays."""
    harness.pipe.maintenance.minute_s = 0.05
    harness.pipe.maintenance.deleted_after_s = 0.5
    await harness.say("u1", "older", code("open('/mnt/data/older.txt','w').write('1')"))
    harness.unsaved_chats.add("new")
    await harness.say("u1", "new", code("open('/mnt/data/new.txt','w').write('1')"))
    store = harness.pipe._services.store
    await wait_until(lambda: harness.pipe._host.lookups >= 2)  # a tick saw it missing
    missing = [s for s in await store.sessions() if s.chat_id == "new"]
    assert missing, "the new chat's session is gone after one miss"
    harness.unsaved_chats.discard("new")  # Open WebUI has written the chat's row
    looks = harness.pipe._host.lookups
    await wait_until(lambda: harness.pipe._host.lookups >= looks + 20)  # 20 more ticks, > 0.5 s
    sessions = harness.sessions_root / "sessions"
    assert list(sessions.rglob("new.txt")) and list(sessions.rglob("older.txt"))


async def test_a_chat_id_the_index_refuses_is_a_sentence_and_other_chats_go_on(harness: PipeHarness):
    """Open WebUI passes on whatever chat id a client sends through its API."""
    answer = await harness.say("u1", "x" * 6000, code("print('never')"))
    assert "This chat's files are not available right now" in answer and "512 characters" in answer
    assert "never" not in answer and not harness.requests  # no model call, no run
    fine = await harness.say("u1", "chat-1", code("print('fine')"))
    assert "fine" in fine
