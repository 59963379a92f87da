"""Following the conversation's branches in the engine, with real storage and real gVisor: two branches
of one chat used at once (two tabs) each get their own state back at each of their steps."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from engine import Engine, Settings, Turn
from runner import KernelPool, Limits, Runner
from storage import Store

pytestmark = pytest.mark.runsc

SETTINGS = Settings(limits=Limits(timeout_s=20, memory_mb=512))
RESTORED = "Restored the files and Python state of the message you are continuing from."


@pytest.fixture
async def services(tmp_path: Path) -> AsyncIterator[Engine]:
    runner = Runner()
    store = Store(tmp_path / "root", owner=(runner.sandbox_uid, runner.sandbox_gid))
    await store.open()
    kernels = KernelPool(runner, tmp_path / "root" / "kernels")
    service = Engine(store, runner, SETTINGS, kernels=kernels)
    yield service
    await service.close()


def turn(message_id: str, tree: dict[str, str | None]) -> Turn:
    async def lineage() -> tuple[Sequence[str], bool]:
        chain, current = [message_id], tree.get(message_id)
        while current is not None:
            chain.append(current)
            current = tree.get(current)
        return chain, True

    return Turn(message_id, lineage)


async def answer(service: Engine, message_id: str, tree: dict[str, str | None], *codes: str) -> list:
    chat = await service.chat("u", "c", SETTINGS)
    await chat.begin_turn(turn(message_id, tree))
    steps = [await chat.run(code, "python") for code in codes]
    chat.end_turn()
    await service.branches.settle()
    return steps


async def test_two_tabs_on_two_branches_each_get_their_own_state_at_each_step(services: Engine):
    tree: dict[str, str | None] = {"u1": None, "a1": "u1", "u2": "a1", "a2": "u2", "u3": "a1", "a3": "u3"}
    [step] = await answer(services, "a1", tree, "x = 1\nopen('/mnt/data/f.txt', 'w').write('1')")
    assert step.ok
    # Tab A writes branch a2 under a1; tab B, branch a3 under a1: their steps interleave.
    tab_a = await services.chat("u", "c", SETTINGS)
    tab_b = await services.chat("u", "c", SETTINGS)
    await tab_a.begin_turn(turn("a2", tree))
    await tab_b.begin_turn(turn("a3", tree))
    a1 = await tab_a.run("x += 10\nopen('/mnt/data/f.txt', 'a').write('A')\nprint(x)", "python")
    assert a1.run is not None and a1.run.stdout.strip() == "11"
    b1 = await tab_b.run("x += 100\nopen('/mnt/data/f.txt', 'a').write('B')\nprint(x)", "python")
    assert b1.run is not None and b1.run.stdout.strip() == "101", b1  # from a1's state, not tab A's
    assert RESTORED in b1.notes
    a2 = await tab_a.run("print(x, open('/mnt/data/f.txt').read())", "python")
    assert a2.run is not None and a2.run.stdout.strip() == "11 1A", a2  # its own half-done state back
    b2 = await tab_b.run("print(x, open('/mnt/data/f.txt').read())", "python")
    assert b2.run is not None and b2.run.stdout.strip() == "101 1B", b2
    tab_a.end_turn()
    tab_b.end_turn()
    await services.branches.settle()


async def test_a_crash_mid_restore_is_finished_by_the_next_step(services: Engine):
    tree: dict[str, str | None] = {"u1": None, "a1": "u1", "u2": "a1", "a2": "u2", "u3": "a1", "a3": "u3"}
    await answer(services, "a1", tree, "open('/mnt/data/f.txt', 'w').write('1')")
    swap = "import os\nos.remove('/mnt/data/f.txt')\nopen('/mnt/data/g.txt', 'w').write('2')"
    await answer(services, "a2", tree, swap)
    chat = await services.chat("u", "c", SETTINGS)
    # A process died half-way through restoring a1: its head says so; the folder is still a2's.
    head = {"head": "a1", "dirty": True, "restoring": True}
    (chat.session.history.folder / "head.json").write_text(json.dumps(head))
    [step] = await answer(services, "a3", tree, "import os\nprint(sorted(os.listdir('/mnt/data')))")
    assert step.run is not None and step.run.stdout.strip() == "['f.txt']", step
