"""A clone starts where its source was, through the installed function (in-process, real storage, real
gVisor): the clone's first answer has the files and Python state of the message it was cloned at (its
owner's clone), or the files only (a chat shared with them); later changes on either side stay on that
side; a claim the host does not prove brings nothing and says nothing; what does not fit or is no longer
kept is said in one sentence.

What Open WebUI proves of a clone's claim (webui/clones.py) is stood in for by `harness.clones`; the
proof itself, and the whole path, run through a real Open WebUI in tests/e2e/test_branches.py."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from tests.support.branch_cells import HALVE, LOAD, ONE
from tests.support.branch_cells import OWN_CLONE as MINE
from tests.support.branch_cells import SHARED_CLONE as SHARED
from tests.support.pipe_harness import PipeHarness, code
from tests.support.tool_harness import ToolHarness

pytestmark = pytest.mark.runsc

LOOK = (
    "import os, pandas as pd\n"
    "print('df', len(df) if 'df' in globals() else None, 'file', len(pd.read_csv('/mnt/data/data.csv')),"
    " sorted(os.listdir('/mnt/data')))"
)


def source(chat: str, owner: str, lineage: tuple[str, ...], *, python: bool) -> types.SimpleNamespace:
    """What webui.OpenWebUI.clone_origin answers once Open WebUI's rules grant the claim."""
    return types.SimpleNamespace(chat_id=chat, owner_id=owner, lineage=lineage, python=python, deleted=False)


@pytest.fixture
async def harness(tmp_path) -> PipeHarness:
    harness = PipeHarness(tmp_path / "data", valves={"timeout_seconds": 20})
    yield harness
    await harness.aclose()


async def send(harness: PipeHarness, user: str, chat: str, text: str, answer: str, parent: str | None) -> str:
    return await harness.say(
        user, chat, text, message_id=answer, user_message={"id": f"u-{answer}", "parentId": parent}
    )


def clone_tree(harness: PipeHarness, source_chat: str, clone: str) -> None:
    """Open WebUI's clone keeps the messages and their ids (routers/chats.py `import_chats`)."""
    harness.trees[clone] = dict(harness.trees[source_chat])


async def three_answers(harness: PipeHarness) -> None:
    assert "rows 10" in await send(harness, "alice", "chat-1", code(LOAD), "a1", None)
    assert "rows 5" in await send(harness, "alice", "chat-1", code(HALVE), "a2", "a1")
    assert "rows 1" in await send(harness, "alice", "chat-1", code(ONE), "a3", "a2")


def inodes(*folders: Path) -> set[int]:
    return {os.lstat(Path(d) / n).st_ino for folder in folders for d, _, ns in os.walk(folder) for n in ns}


async def test_a_clone_of_ones_own_chat_continues_from_that_answers_files_and_variables(
    harness: PipeHarness,
) -> None:
    await three_answers(harness)
    clone_tree(harness, "chat-1", "clone-1")
    harness.clones[("clone-1", "alice")] = source(
        "chat-1", "alice", ("a2", "u-a2", "a1", "u-a1"), python=True
    )
    said = await send(harness, "alice", "clone-1", code(LOOK), "c1", "a2")
    assert "df 5 file 5 ['data.csv']" in said, said
    assert said.count(MINE) == 1, said  # said once, under the run
    # The clone goes on; the source's answer 3 still sees its own file and frame, and the clone's
    # later runs do not reach it (nor the source's the clone).
    changed = (
        "df = df.iloc[:2]\ndf.to_csv('/mnt/data/data.csv', index=False)\n"
        "open('/mnt/data/mine.txt', 'w').write('c')"
    )
    await send(harness, "alice", "clone-1", code(changed), "c2", "c1")
    said = await send(harness, "alice", "chat-1", code(LOOK), "a4", "a3")
    assert "df 1 file 1 ['data.csv']" in said, said
    said = await send(harness, "alice", "clone-1", code(LOOK), "c3", "c2")
    assert "df 2 file 2 ['data.csv', 'mine.txt']" in said, said
    assert MINE not in said  # once, at the start only
    # Copies, never the source's own files: no inode of the clone's folder or states is the source's.
    root = harness.sessions_root
    clone_dirs = [p for p in root.rglob("*clone-1*") if p.is_dir()]
    source_dirs = [p for p in root.rglob("*chat-1*") if p.is_dir()]
    assert clone_dirs and source_dirs
    assert not inodes(*clone_dirs) & inodes(*source_dirs)


async def test_a_clone_of_a_shared_chat_gets_its_files_but_never_its_variables(harness: PipeHarness) -> None:
    await three_answers(harness)
    clone_tree(harness, "chat-1", "clone-2")
    harness.clones[("clone-2", "bob")] = source("chat-1", "alice", ("a2", "u-a2", "a1", "u-a1"), python=False)
    said = await send(harness, "bob", "clone-2", code(LOOK), "b1", "a2")
    assert "df None file 5 ['data.csv']" in said, said
    assert said.count(SHARED) == 1 and "not its Python state" in said, said
    # bob's runs are bob's: the source is untouched.
    await send(
        harness, "bob", "clone-2", code("open('/mnt/data/data.csv', 'w').write('n\\n0\\n')"), "b2", "b1"
    )
    said = await send(harness, "alice", "chat-1", code(LOOK), "a4", "a3")
    assert "df 1 file 1 ['data.csv']" in said, said


async def test_a_claim_the_host_does_not_prove_brings_and_says_nothing(harness: PipeHarness) -> None:
    await three_answers(harness)
    clone_tree(harness, "chat-1", "forged")  # the JSON says "clone of chat-1": Open WebUI says no
    said = await send(harness, "bob", "forged", code("import os\nprint(sorted(os.listdir('.')))"), "f1", "a2")
    assert "[]" in said, said
    assert "clone" not in said.lower() and "cloned" not in str(harness.events).lower()


async def test_what_does_not_fit_and_what_is_no_longer_kept_is_said_once(harness: PipeHarness) -> None:
    make = "for n in 'abc':\n    open(f'/mnt/data/{n}.txt', 'w').write(n * 1000)\nx = 1"
    await send(harness, "alice", "chat-q", code(make), "q1", None)
    harness.set_valves(max_files_per_user=4)  # alice has 3: one more fits
    clone_tree(harness, "chat-q", "clone-q")
    harness.clones[("clone-q", "alice")] = source("chat-q", "alice", ("q1", "u-q1"), python=True)
    said = await send(
        harness, "alice", "clone-q", code("import os\nprint(sorted(os.listdir('.')), x)"), "k1", "q1"
    )
    assert "['a.txt'] 1" in said, said
    assert "1 file of 3 (the other 2, 2.0 KiB, do not fit in your storage)" in said, said
    # A clone of messages whose states are not kept: said, and it starts empty.
    harness.set_valves(max_files_per_user=0)
    harness.trees["clone-gone"] = {"u-g1": "gone-answer", "gone-answer": None}
    harness.clones[("clone-gone", "alice")] = source("chat-q", "alice", ("gone-answer",), python=True)
    said = await send(
        harness, "alice", "clone-gone", code("import os\nprint(sorted(os.listdir('.')))"), "g1", "gone-answer"
    )
    assert "[]" in said and "are no longer kept" in said, said


async def test_an_api_callers_first_message_to_a_clone_starts_from_the_source_too(
    harness: PipeHarness,
) -> None:
    # An API caller names the chat and its answer's id, not where it is in the tree.
    await three_answers(harness)
    harness.clones[("clone-api", "alice")] = source(
        "chat-1", "alice", ("a2", "u-a2", "a1", "u-a1"), python=True
    )
    said = await harness.say("alice", "clone-api", code(LOOK), message_id="api-1")
    assert "df 5 file 5 ['data.csv']" in said, said


async def test_the_tool_and_filter_start_a_clone_the_same_way(harness: PipeHarness) -> None:
    tool = ToolHarness.beside(harness)
    try:
        await three_answers(harness)
        clone_tree(harness, "chat-1", "clone-t")
        harness.clones[("clone-t", "bob")] = source(
            "chat-1", "alice", ("a2", "u-a2", "a1", "u-a1"), python=False
        )
        turn = await tool.say(
            "bob", "clone-t", code(LOOK), message_id="t1", user_message={"id": "u-t1", "parentId": "a2"}
        )
        assert any("df None file 5 ['data.csv']" in r for r in turn.tool_results), turn.tool_results
        assert sum(SHARED in r for r in turn.tool_results) == 1, turn.tool_results  # the model hears it once
        statuses = [e["data"]["description"] for e in turn.events if e.get("type") == "status"]
        assert statuses and SHARED in statuses[0], statuses  # the user sees it before the model answers
    finally:
        await tool.aclose()


async def test_a_clone_of_a_deleted_chat_says_so_only_to_the_owner_of_what_was_deleted(
    harness: PipeHarness,
) -> None:
    await three_answers(harness)
    gone = types.SimpleNamespace(
        chat_id="chat-1", owner_id="alice", lineage=("a2",), python=True, deleted=True
    )
    harness.clones[("clone-d", "alice")] = gone  # alice's own chat-1, deleted in Open WebUI meanwhile
    said = await send(
        harness, "alice", "clone-d", code("import os\nprint(sorted(os.listdir('.')))"), "d1", "a2"
    )
    assert "[]" in said and "cloned from a chat that has since been deleted" in said, said
    # bob's clone claims a deleted chat too: not his (our store has no chat-1 of his), so not a word.
    harness.clones[("clone-e", "bob")] = types.SimpleNamespace(**{**vars(gone), "owner_id": "bob"})
    said = await send(
        harness, "bob", "clone-e", code("import os\nprint(sorted(os.listdir('.')))"), "e1", "a2"
    )
    assert "[]" in said and "deleted" not in said, said
