"""Workspaces that follow the conversation, through the installed function (in-process, real storage,
real gVisor): a regenerated or edited message continues from the files and Python state of the
message it continues from; going back to a branch continues that branch's; another chat is untouched.

The chat's tree is recorded as Open WebUI records it before it calls the function (the harness's
`user_message`: a regenerate sends the same user message again, an edit a new one under the same
parent, a continuation of another branch a new one under that branch's answer)."""

from __future__ import annotations

import pytest

from tests.support.branch_cells import HALVE, LOAD, LOOK, RESTORED
from tests.support.pipe_harness import PipeHarness, code
from tests.support.tool_harness import ToolHarness

pytestmark = pytest.mark.runsc


@pytest.fixture
async def harness(tmp_path) -> PipeHarness:
    harness = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 20})
    yield harness
    await harness.aclose()


class Chat:
    """One chat of the harness, its messages named as Open WebUI names them."""

    def __init__(self, harness: PipeHarness, user: str, chat_id: str) -> None:
        self.harness, self.user, self.chat_id = harness, user, chat_id
        self.count = 0

    async def send(
        self, text: str, *, parent: str | None, user_message: str | None = None
    ) -> tuple[str, str]:
        """A user message under `parent` (an answer's id; None: the first message), or the same user
        message again (`user_message`: a regenerate). Returns (answer id, visible answer)."""
        self.count += 1
        answer_id = f"a{self.count}"
        user_id = user_message or f"u{self.count}"
        said = await self.harness.say(
            self.user,
            self.chat_id,
            text,
            message_id=answer_id,
            user_message={"id": user_id, "parentId": parent},
        )
        return answer_id, said


async def test_a_regenerated_message_continues_from_the_files_and_state_of_the_one_before(
    harness: PipeHarness,
) -> None:
    chat = Chat(harness, "alice", "chat-1")
    first, said = await chat.send(code(LOAD), parent=None)
    assert "rows 10" in said
    second, said = await chat.send(code(HALVE), parent=first)
    assert "rows 5" in said
    # Regenerate turn 2 (the same user message, a new answer): it sees turn 1's file and frame.
    _, said = await chat.send(code(LOOK), parent=first, user_message="u2")
    assert "df 10 file 10" in said, said
    assert RESTORED in said  # said under the run's block, for the user
    tool_result = harness.requests[-1]["messages"][-1]["content"]
    assert RESTORED in tool_result  # and to the model
    statuses = [e["data"]["description"] for e in harness.events if e.get("type") == "status"]
    assert RESTORED in statuses
    # Back on the first branch of turn 2: its halved file and frame.
    _, said = await chat.send(code(LOOK), parent=second)
    assert "df 5 file 5" in said, said
    assert RESTORED in said
    # And continuing the newest answer says nothing and restores nothing.
    newest, said = await chat.send(code("df = df.iloc[:2]\n" + LOOK), parent=f"a{chat.count}")
    assert "df 2 file 5" in said and RESTORED not in said
    _, said = await chat.send(code(LOOK), parent=newest)
    assert "df 2 file 5" in said and RESTORED not in said


async def test_a_python_state_no_longer_kept_is_said_once(harness: PipeHarness) -> None:
    harness.set_valves(branch_python_states=1)  # the files of three answers, the Python state of one
    chat = Chat(harness, "alice", "chat-1")
    first, _ = await chat.send(code(LOAD), parent=None)
    second, _ = await chat.send(code(HALVE), parent=first)
    await chat.send(code(LOOK), parent=second)
    check = "import pandas as pd\nprint('df' in globals(), len(pd.read_csv('/mnt/data/data.csv')))"
    _, said = await chat.send(code(check), parent=first, user_message="u2")  # turn 2 regenerated
    assert "False 10" in said, said  # turn 1's file, a new Python state
    lost = (
        "Restored the files of the message you are continuing from, but not its Python state, which is "
        "no longer kept (a chat keeps the Python states of its newest 1 answers, as far as your storage "
        "allows): Python starts afresh."
    )
    # One sentence: under the run's block; the kernel adds no "reset" of its own; the status said it as
    # the answer started, and the run's status (hidden: the block is its record) does not say it again.
    assert said.count(lost) == 1 and "Python state" not in said.replace(lost, ""), said
    statuses = [e["data"] for e in harness.events if e.get("type") == "status"]  # this answer's
    assert [s["description"] for s in statuses].count(lost) == 1, statuses
    assert statuses[-1].get("hidden") is True, statuses
    assert lost in harness.requests[-1]["messages"][-1]["content"]  # and the model is told


async def test_an_edited_first_message_starts_from_an_empty_folder_and_a_new_state(harness: PipeHarness):
    chat = Chat(harness, "alice", "chat-1")
    await chat.send(code(LOAD), parent=None)
    # An edit of the first message: a new user message with no parent.
    _, said = await chat.send(
        code("import os\nprint(sorted(os.listdir('/mnt/data')), 'df' in globals())"), parent=None
    )
    assert "[] False" in said, said
    assert "Started again from an empty /mnt/data and a new Python state" in said


async def test_a_temporary_chat_follows_its_branches_from_the_request_alone(harness: PipeHarness) -> None:
    """Open WebUI keeps no record of a temporary chat: the request's user message (its parent) is all
    there is, and that is enough."""
    chat = Chat(harness, "alice", "local:tab-1")
    first, _ = await chat.send(code(LOAD), parent=None)
    await chat.send(code(HALVE), parent=first)
    _, said = await chat.send(code(LOOK), parent=first, user_message="u2")
    assert "df 10 file 10" in said and RESTORED in said, said


async def test_another_chat_and_another_user_are_untouched(harness: PipeHarness) -> None:
    chat = Chat(harness, "alice", "chat-1")
    other = Chat(harness, "alice", "chat-2")
    first, _ = await chat.send(code(LOAD), parent=None)
    mine = "open('/mnt/data/mine.txt', 'w').write('x')\nkeep = 7"
    other_first, _ = await other.send(code(mine), parent=None)
    await chat.send(code(HALVE), parent=first)
    await chat.send(code(LOOK), parent=first, user_message="u2")  # a restore in chat-1
    _, said = await other.send(code("import os\nprint(os.listdir('/mnt/data'), keep)"), parent=other_first)
    assert "['mine.txt'] 7" in said and RESTORED not in said


async def test_an_uploaded_file_of_the_regenerated_message_is_copied_in_again(harness: PipeHarness) -> None:
    chat = Chat(harness, "alice", "chat-1")
    first, _ = await chat.send(code("print('hi')"), parent=None)
    upload = harness.upload("alice", "sales.csv", b"a,b\n1,2\n")
    chat.count += 1
    said = await harness.say(
        "alice",
        "chat-1",
        code("print(open('/mnt/data/sales.csv').read())"),
        files=[upload],
        message_id="a2",
        user_message={"id": "u2", "parentId": first},
    )
    assert "a,b" in said
    # Regenerated: turn 1's folder had no sales.csv; the attachment of the user message comes again.
    said = await harness.say(
        "alice",
        "chat-1",
        code("print(open('/mnt/data/sales.csv').read())"),
        files=[upload],
        message_id="a3",
        user_message={"id": "u2", "parentId": first},
    )
    assert "a,b" in said and "FileNotFoundError" not in said, said


async def test_a_state_no_longer_kept_is_said_and_the_answer_goes_on_from_the_latest(
    harness: PipeHarness,
) -> None:
    harness.set_valves(branch_states=2)
    chat = Chat(harness, "alice", "chat-1")
    parent = None
    answers = []
    for i in range(4):
        write = f"open('/mnt/data/f.txt', 'w').write('{i}')\nx = {i}"
        parent, _ = await chat.send(code(write), parent=parent)
        answers.append(parent)
    # Continue from the first answer: only the newest two states are kept.
    _, said = await chat.send(code("print(open('/mnt/data/f.txt').read(), x)"), parent=answers[0])
    assert "no longer kept" in said, said
    assert "3 3" in said


async def test_branch_states_zero_keeps_the_chat_whole(harness: PipeHarness) -> None:
    harness.set_valves(branch_states=0)
    chat = Chat(harness, "alice", "chat-1")
    first, _ = await chat.send(code(LOAD), parent=None)
    await chat.send(code(HALVE), parent=first)
    _, said = await chat.send(code(LOOK), parent=first, user_message="u2")
    assert "df 5 file 5" in said and RESTORED not in said
    root = harness.sessions_root / "state"
    assert not any(p.name == "history" for p in root.rglob("history"))


async def test_through_the_tool_and_the_filter_a_regenerate_gets_the_state_back(tmp_path) -> None:
    """The Tool and the Filter (any model with tool calling): the Filter's inlet restores before the
    model is asked, its outlet saves the answer's state."""
    tools = ToolHarness(tmp_path / "data", valves={"timeout_seconds": 20})
    try:
        first = await tools.say(
            "alice", "chat-1", code(LOAD), message_id="a1", user_message={"id": "u1", "parentId": None}
        )
        assert "rows 10" in first.tool_results[0]
        second = await tools.say(
            "alice", "chat-1", code(HALVE), message_id="a2", user_message={"id": "u2", "parentId": "a1"}
        )
        assert "rows 5" in second.tool_results[0]
        again = await tools.say(
            "alice", "chat-1", code(LOOK), message_id="a3", user_message={"id": "u2", "parentId": "a1"}
        )
        assert "df 10 file 10" in again.tool_results[0], again.tool_results
        assert RESTORED in again.tool_results[0]  # the model reads it in the tool's result
        statuses = [e["data"]["description"] for e in again.events if e.get("type") == "status"]
        assert RESTORED in statuses
        back = await tools.say(
            "alice", "chat-1", code(LOOK), message_id="a4", user_message={"id": "u4", "parentId": "a2"}
        )
        assert "df 5 file 5" in back.tool_results[0], back.tool_results
    finally:
        await tools.aclose()


# ---- requests with half the tree: API callers ------------------------------------------------------------

STARTED_AGAIN = "Started again from an empty /mnt/data"
WRITE = "open('/mnt/data/a.txt', 'w').write('kept')\nx = 41"
READ = "print(open('/mnt/data/a.txt').read(), x + 1)"


async def test_an_api_callers_chat_keeps_its_files_and_variables_at_every_turn(harness: PipeHarness) -> None:
    """POST /api/chat/completions with chat_id and the answer's id only: Open WebUI files each answer
    with no parent, and the request's messages carry the history."""
    first = await harness.say("alice", "chat-api", code(WRITE, "ok"), message_id="a1")
    history = [{"role": "user", "content": code(WRITE, "ok")}, {"role": "assistant", "content": first}]
    second = await harness.say("alice", "chat-api", code(READ), message_id="a2", history=history)
    assert "kept 42" in second and STARTED_AGAIN not in second, second
    # A regenerate through the API (a new answer id, the same history): nothing in the tree says which
    # answer it replaces, so it continues from the newest state; nothing is removed.
    again = await harness.say("alice", "chat-api", code(READ), message_id="a3", history=history)
    assert "kept 42" in again and STARTED_AGAIN not in again, again


@pytest.mark.parametrize("shape", ["user message without parentId", "parentId null with earlier turns"])
async def test_a_request_with_half_its_fields_keeps_the_files(harness: PipeHarness, shape: str) -> None:
    """A user message that Open WebUI files at the root of the tree, while the request's own messages
    carry earlier turns (or say nothing of a parent): the tree and the request disagree, so the answer
    continues from the newest state."""
    await Chat(harness, "alice", "chat-half").send(code(WRITE, "ok"), parent=None)
    user_message: dict = {"id": "u-late"}
    if shape.startswith("parentId null"):
        user_message["parentId"] = None
    history = [{"role": "user", "content": code(WRITE, "ok")}, {"role": "assistant", "content": "ok"}]
    said = await harness.say(
        "alice", "chat-half", code(READ), message_id="a-late", user_message=user_message, history=history
    )
    assert "kept 42" in said and STARTED_AGAIN not in said, said


async def test_through_the_tool_and_the_filter_an_api_callers_chat_keeps_its_files(tmp_path) -> None:
    tools = ToolHarness(tmp_path / "data", valves={"timeout_seconds": 20})
    try:
        first = await tools.say("alice", "chat-api", code(WRITE, "ok"), message_id="a1")
        history = [
            {"role": "user", "content": code(WRITE, "ok")},
            {"role": "assistant", "content": first.saved},
        ]
        second = await tools.say("alice", "chat-api", code(READ), message_id="a2", history=history)
        assert "kept 42" in second.tool_results[0], second.tool_results
        assert STARTED_AGAIN not in second.tool_results[0]
    finally:
        await tools.aclose()
