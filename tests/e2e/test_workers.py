"""Open WebUI with several workers (UVICORN_WORKERS=4), as real deployments run it.

A chat's runs reach the same live kernel whichever worker answers the message (the kernel lives in
the worker that started it; the others reach it over a unix socket), several users' chats run at
once, and the background maintenance runs in one worker at a time (shown with a purge: the deleted
chats' tick shares its `maintenance` lock, and expiry also needs Store.claim, tested across processes
in tests/storage).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from demo import launcher
from storage import Store
from storage._keys import id_key
from tests.support.open_webui import OpenWebUI, Reply, running_open_webui

# Starting four workers on two cores takes a few minutes: more than the default hang guard.
pytestmark = [pytest.mark.e2e, pytest.mark.runsc, pytest.mark.timeout(900)]

WORKERS = 4


def run(code: str, reply: str = "") -> str:
    return f"```python\n{code}\n```\n" + (f"reply: {reply}" if reply else "")


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, model_server: str) -> Iterator[OpenWebUI]:
    home = tmp_path_factory.mktemp("open-webui-workers")
    # Open WebUI 0.12.4's workers race to write their config rows into a new database: one can fail
    # with "UNIQUE constraint failed: config.key", and uvicorn then stops them all. One worker creates
    # the database first, as an admin's first start would.
    # (Its first start also persists the model connection: the same as the real start's.)
    connection = {
        "ENABLE_OLLAMA_API": "false",
        "OPENAI_API_BASE_URL": model_server + "/v1",
        "OPENAI_API_KEY": "scripted",
    }
    data_dir, log = home / "data", home / "open-webui.log"
    first = launcher.start_open_webui(data_dir, launcher.free_port(), log, connection, timeout=600)
    launcher.stop(first)
    env = {"UVICORN_WORKERS": str(WORKERS)}
    with running_open_webui(home, model_server, ("ann", "ben", "cid"), env=env, timeout=600) as server:
        yield server


def test_a_variable_lives_through_the_turns_of_one_chat_whichever_worker_answers(workers: OpenWebUI):
    ann = workers.accounts["ann"]
    turn: Reply = ann.say(run("secret = 'ann-' + str(6 * 7)\nprint('set', secret)"))
    assert "set ann-42" in turn.content
    for i in range(8):
        turn = ann.say(run(f"print('turn {i}', secret)"), previous=turn)
        assert f"turn {i} ann-42" in turn.content, turn.content
        assert "The Python state was reset" not in turn.content
    # Another chat of the same user, and another user, have kernels of their own.
    assert "NameError" in ann.say(run("print(secret)")).content
    assert "NameError" in workers.accounts["ben"].say(run("print(secret)")).content
    relays = workers.log.read_text(errors="replace").count("run by the worker that holds it")
    assert relays >= 1, "every turn landed on the worker holding the kernel: the relay was not exercised"


def test_several_users_chats_at_once_across_workers(workers: OpenWebUI):
    people = [workers.accounts[name] for name in ("ann", "ben", "cid")]

    def conversation(index: int) -> str:
        account = people[index % len(people)]
        first = account.say(
            run(f"n = {index}\nopen('/mnt/data/n.txt', 'w').write(str(n))", "/mnt/data/n.txt")
        )
        second = account.say(run("print('n is', n, open('/mnt/data/n.txt').read())"), previous=first)
        return second.content

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(conversation, range(6)))
    for index, answer in enumerate(answers):
        assert f"n is {index} {index}" in answer, answer


async def test_the_index_matches_the_disk_after_it_all(workers: OpenWebUI):
    async with Store(workers.sessions_root) as store:
        assert await store.check() == []


def test_a_purge_runs_once_across_the_workers(workers: OpenWebUI):
    ann = workers.accounts["ann"]
    reply = ann.say(run("open('/mnt/data/p.txt', 'w').write('p')", "/mnt/data/p.txt"))
    [link] = reply.links()  # once: where the answer names it
    assert ann.download(link).content == b"p"
    workers.set_valves(purge=f"chat:{reply.chat_id}")
    # Every worker reads the valves each minute, and the next message runs it too; only one may.
    ann.say(run("print('after')"), previous=reply)
    ann.say(run("print('again')"))
    assert workers.valves()["purge"] == ""
    text = workers.log.read_text(errors="replace")
    assert text.count(f"code-sessions purge 'chat:{reply.chat_id}'") == 1, text[-3000:]
    # And it did its work: the file and its link are gone (the chat goes on in a fresh folder).
    assert ann.download(link).status_code == 404
    folder = workers.sessions_root / "sessions" / id_key(ann.user_id) / id_key(reply.chat_id)
    assert not (folder / "p.txt").exists()
