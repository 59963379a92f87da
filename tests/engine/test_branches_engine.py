"""Following the conversation's branches in the engine, with real storage and real gVisor: two branches
of one chat used at once (two tabs) each get their own state back at each of their steps."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from engine import Engine, Inbound, NewLink, Place, Settings
from runner import KernelPool, Limits, Runner
from storage import Expiry, Policy, Store, UploadLinks

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


def place(message_id: str, tree: dict[str, str | None]) -> Place:
    """The answer's place as the web UI's request gives it (it names its user message, so a first
    message says it opens the conversation)."""

    async def lineage() -> tuple[Sequence[str], bool]:
        chain, current = [message_id], tree.get(message_id)
        while current is not None:
            chain.append(current)
            current = tree.get(current)
        return chain, True

    return Place(message_id, lineage, opens=True)


async def answer(service: Engine, message_id: str, tree: dict[str, str | None], *codes: str) -> list:
    chat = await service.chat("u", "c", SETTINGS)
    await chat.follow(place(message_id, tree))
    steps = [await chat.run(code, "python") for code in codes]
    chat.save_state_soon()
    await service.branches.settle()
    return steps


async def test_two_tabs_on_two_branches_each_get_their_own_state_at_each_step(services: Engine):
    tree: dict[str, str | None] = {"u1": None, "a1": "u1", "u2": "a1", "a2": "u2", "u3": "a1", "a3": "u3"}
    [step] = await answer(services, "a1", tree, "x = 1\nopen('/mnt/data/f.txt', 'w').write('1')")
    assert step.ok
    # Tab A writes branch a2 under a1; tab B, branch a3 under a1: their steps interleave.
    tab_a = await services.chat("u", "c", SETTINGS)
    tab_b = await services.chat("u", "c", SETTINGS)
    await tab_a.follow(place("a2", tree))
    await tab_b.follow(place("a3", tree))
    a1 = await tab_a.run("x += 10\nopen('/mnt/data/f.txt', 'a').write('A')\nprint(x)", "python")
    assert a1.run is not None and a1.run.stdout.strip() == "11"
    b1 = await tab_b.run("x += 100\nopen('/mnt/data/f.txt', 'a').write('B')\nprint(x)", "python")
    assert b1.run is not None and b1.run.stdout.strip() == "101", b1  # from a1's state, not tab A's
    assert RESTORED in b1.notes
    a2 = await tab_a.run("print(x, open('/mnt/data/f.txt').read())", "python")
    assert a2.run is not None and a2.run.stdout.strip() == "11 1A", a2  # its own half-done state back
    b2 = await tab_b.run("print(x, open('/mnt/data/f.txt').read())", "python")
    assert b2.run is not None and b2.run.stdout.strip() == "101 1B", b2
    tab_a.save_state_soon()
    tab_b.save_state_soon()
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


# ---- a file through an upload link belongs to the answer that offered the link ------------------------

TREE: dict[str, str | None] = {
    "u1": None,
    "a1": "u1",
    "u2": "a1",
    "a2": "u2",  # offers the upload link
    "a1b": "u1",  # answer 1 regenerated
    "u3": "a2",
    "a3": "u3",  # the conversation continued under answer 2
}
LIST = "import os\nprint(sorted(os.listdir('/mnt/data')))"


def inbound_for(services: Engine, tmp_path: Path) -> Inbound:
    async def stores(where: dict) -> tuple[Store, Policy]:
        return services.store, Policy(services.store.policy.quotas, Expiry())

    return Inbound(UploadLinks(tmp_path / "links"), stores)


async def offer_link(services: Engine, inbound: Inbound) -> str:
    chat = await services.chat("u", "c", SETTINGS)
    await chat.follow(place("a2", TREE))
    made = await inbound.make_link(chat, "/mnt/data/up.bin", ttl_s=600, where={})
    assert isinstance(made, NewLink), made
    chat.save_state_soon()
    await services.branches.settle()
    return made.token


async def upload(inbound: Inbound, token: str, data: bytes) -> str:
    grant = await inbound.claim(token)
    incoming = await inbound.begin(grant)
    await incoming.write(data)
    return await inbound.finish(grant, incoming)


def listed(step) -> str:
    assert step.run is not None, step
    return step.run.stdout.strip()


@pytest.mark.parametrize("when", ["before the regenerate", "after the regenerate", "after continuing"])
async def test_a_file_uploaded_through_a_link_stays_on_the_branch_of_the_answer_that_offered_it(
    services: Engine, tmp_path: Path, when: str
) -> None:
    inbound = inbound_for(services, tmp_path)
    await answer(services, "a1", TREE, "open('/mnt/data/a.txt', 'w').write('1')")
    token = await offer_link(services, inbound)
    if when == "before the regenerate":
        said = await upload(inbound, token, b"uploaded")
        assert "in the chat" in said, said
    if when == "after continuing":  # answer 3, under answer 2, is written before the file arrives
        [step] = await answer(services, "a3", TREE, "open('/mnt/data/b.txt', 'w').write('3')")
        said = await upload(inbound, token, b"uploaded")
        assert "in the chat" in said, said
        [step] = await answer(services, "a3", TREE, LIST)
        assert listed(step) == "['a.txt', 'b.txt', 'up.bin']", step  # it continues answer 2: it has it
    # The user regenerates answer 1: that branch never had the upload.
    [step] = await answer(services, "a1b", TREE, LIST)
    assert listed(step) == "[]", step
    if when == "after the regenerate":
        said = await upload(inbound, token, b"uploaded")
        assert "with the answer that offered this link" in said and "another branch" in said, said
        [step] = await answer(services, "a1b", TREE, LIST)
        assert listed(step) == "[]", step  # the branch the chat shows now is left as it is
    # Back under answer 2: its files, with the upload.
    [step] = await answer(services, "a3", TREE, LIST + "\nprint(open('/mnt/data/up.bin').read())")
    expected = "['a.txt', 'b.txt', 'up.bin']" if when == "after continuing" else "['a.txt', 'up.bin']"
    assert listed(step) == f"{expected}\nuploaded", step
