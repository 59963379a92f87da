"""Second attack round: hostile answers and bad days (the fixes of "Hostile answers and bad days").

Every test drives the installed bundle (dist/code_sessions.py) through the PipeHarness with real storage
and real runsc, and looks at what the user reads and what the host holds (the folders, the published
copies, the index file). The valves are the defaults unless a test says otherwise; `kernel` (a live
Python kernel per chat, the default, or a fresh sandbox per run) is set where the two differ.

1. The per-user quota when chats run at once (the user's total is files + published copies, on disk):
   * `test_chats_of_one_user_growing_indexed_files_at_once_stay_within_the_quota`: 3 chats grow files
     already indexed (and linked) at the same instant; naive: each run weighs its growth against the
     totals from before the others, the user ends far over the quota.
   * `test_chats_of_one_user_writing_at_once_stay_within_the_quota[new|mixed]`: 4 chats write new files
     at once (or 2 grow and 2 write new); naive: the new files slip past together.
   * `test_chats_of_one_user_at_once_stay_within_the_file_count`: the same with a quota in files.
   * `test_two_users_at_once_are_charged_for_their_own_files_only`: naive: one user's runs remove the
     other's files, or count them.
   * `test_runs_uploads_and_links_of_one_user_at_once_stay_within_the_quota`: a run, an attachment and a
     new link of one user at once; naive: each path checks the quota on its own.
   * `test_published_copies_count_toward_the_quota`: naive: copies are free, or counted twice.
   * `test_stopped_runs_of_one_user_at_once_stay_within_the_quota[fresh|persistent]`: both answers
     stopped (the task cancelled: Open WebUI's stop button) mid-write; naive: the stopped run is never
     weighed, or its code writes on after the quota was decided.
   * `test_code_that_writes_after_its_run_ended_stays_within_the_quota[fresh|persistent]`: a thread the
     code started writes after the run returned; naive: nothing ever weighs those bytes.
   * `test_runs_killed_by_a_crash_are_indexed_and_the_quota_holds_after_the_restart[fresh|persistent]`:
     Open WebUI SIGKILLed while two chats of one user write; naive: their files stay out of the quota.
2. Over the quota a run still starts; `!clear-files`:
   * `test_over_the_quota_a_run_starts_and_can_read_and_delete_but_adds_nothing[bytes|files]`.
   * `test_over_the_quota_shrinking_a_file_keeps_it_and_frees_room`: naive: a shrunk file is "changed",
     weighed like a new one and removed; shrinking one file and growing another in one run.
   * `test_over_the_quota_moving_a_file_does_not_lose_it`: a rename adds no byte; naive: the moved file
     is a new path over the quota and is deleted, its content lost.
   * `test_clear_files_empties_this_chat_and_its_copies_without_the_model`: only this chat, its copies,
     no model call; a message that merely contains the command is not the command.
   * `test_clear_files_with_another_users_chat_id_touches_only_the_senders_session`.
   * `test_clear_files_while_a_step_of_the_same_chat_runs[waits|busy]`: naive: it deletes under the run,
     or (a step longer than the lock wait) raises out of the pipe.
   * `test_quota_sentences_show_hostile_names_as_text`.
3. A full disk under the storage root (a real 16 MiB tmpfs, filled from inside the sandbox):
   * `test_full_disk_gives_a_sentence_every_chat_answers_and_the_next_step_recovers[fresh|persistent]`:
     one sentence for user and model, other users' chats answer, a run frees space, the next steps index
     what the full disk left, nothing lost, the index sound.
   * `test_full_disk_while_linking_a_file_gives_a_sentence`: a file without a copy yet, linked.
   * `test_full_disk_with_an_attachment_gives_a_sentence`.
   * `test_clear_files_on_a_full_disk[the chat that filled it|a chat with little]`.
   * `test_open_webui_restarted_while_the_disk_is_full_answers_with_a_sentence`.
   * `test_a_chat_started_on_a_full_disk_is_indexed_once_the_disk_is_freed[a step|the tick]`: an admin
     frees the disk, then another chat's step (or only the background tick) runs; naive: the new
     chat's folder stays without its index row ("session not indexed"): the catch-up after a full disk
     ran only from a step that wrote, and a warm chat's step writes nothing.
4. Attachments:
   * `test_an_attachment_too_large_is_said_once_and_the_chat_goes_on[file limit|quota]` (a hostile name).
   * `test_an_unreadable_attachment_is_said_once_and_the_chat_goes_on[os error|storage provider error]`.
5. The index damaged while Open WebUI runs (after a checkpoint, so the damage is to what SQLite reads):
   * `test_damaged_index_is_rebuilt_at_the_next_step_and_nothing_is_lost[truncated|garbage|pages]`: in
     a conversation (history with earlier links).
   * `test_index_damage_is_logged_once[truncated|garbage|pages]`.
   * `test_index_damaged_in_the_middle_of_a_step_loses_nothing[its own step|another chat]`.
   * `test_index_deleted_while_open_loses_nothing_here_and_after_a_restart`: with its -wal and -shm.
   * `test_index_deleted_while_open_is_noticed_before_another_worker_splits_the_quota`.
6. `test_a_file_rewritten_with_its_size_and_mtime_restored_gets_a_new_copy[in place|replaced|truncated]`.
7. `test_a_message_waiting_for_a_busy_chat_says_it_waits[run|attachment|clear]`,
   `test_a_huge_purge_valve_is_logged_bounded`.

"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import pytest

from tests.adversarial import bad_days_support as bd
from tests.adversarial.attack import (
    SMALL,
    assert_index_matches_disk,
    copy_of,
    interpreted,
    links,
    outside_code,
    prose,
    published,
)
from tests.support.pipe_harness import PipeHarness, code

pytestmark = [pytest.mark.runsc, pytest.mark.timeout(150)]

MB, KB = bd.MB, bd.KB


def over(limit: str) -> str:
    return f": over the {limit} storage limit across all your chats"


# ====================================================================== 1. the quota, chats at once


async def test_chats_of_one_user_growing_indexed_files_at_once_stay_within_the_quota(harness: PipeHarness):
    """Naive: each run weighs its growth against the totals from before the others (10.5 MiB of 4)."""
    harness.set_valves(max_mb_per_user=4, timeout_seconds=20)
    chats = ["grow-1", "grow-2", "grow-3"]
    for chat in chats:  # indexed, and linked by the answer (a copy each)
        await bd.say(harness, "alice", chat, code(bd.write("/mnt/data/g.bin", 256 * KB)))
    deadline = time.time() + 4
    grow = bd.at(deadline, bd.write("/mnt/data/g.bin", MB + 512 * KB, "ab"))
    answers = await asyncio.gather(*(bd.say(harness, "alice", chat, code(grow)) for chat in chats))
    assert bd.host_total(harness, "alice") <= 4 * MB
    removed = 0
    for chat, answer in zip(chats, answers, strict=True):
        kept = (bd.chat_folder(harness.sessions_root, "alice", chat) / "g.bin").exists()
        said = "Removed /mnt/data/g.bin" + over("4 MiB") in answer
        assert kept != said, (chat, answer)  # what goes is said, what is said went
        removed += said
    assert removed >= 1
    assert await bd.indexed_usage(harness, "alice") == (
        bd.user_files(harness.sessions_root, "alice")[0],
        bd.host_total(harness, "alice"),
    )
    await assert_index_matches_disk(harness)


@pytest.mark.parametrize("mix", ["new", "mixed"])
async def test_chats_of_one_user_writing_at_once_stay_within_the_quota(harness: PipeHarness, mix: str):
    """Naive: four runs each see room for their 1.25 MiB and all keep it (5 MiB of 4)."""
    harness.set_valves(max_mb_per_user=4, timeout_seconds=20)
    chats = [f"{mix}-{i}" for i in range(4)]
    growers = chats[:2] if mix == "mixed" else []
    for chat in chats:
        warm = bd.write("/mnt/data/n.bin", 64 * KB) if chat in growers else "print('warm')"
        await bd.say(harness, "alice", chat, code(warm, "warm"))  # no link: the reply names no file
    deadline = time.time() + 4
    new = bd.at(deadline, bd.write("/mnt/data/n.bin", MB + 256 * KB))
    grow = bd.at(deadline, bd.write("/mnt/data/n.bin", MB + 192 * KB, "ab"))
    answers = await asyncio.gather(
        *(bd.say(harness, "alice", chat, code(grow if chat in growers else new, "done")) for chat in chats)
    )
    assert bd.host_total(harness, "alice") <= 4 * MB
    assert sum("Removed /mnt/data/n.bin" + over("4 MiB") in a for a in answers) >= 1
    await assert_index_matches_disk(harness)
    files, _ = bd.user_files(harness.sessions_root, "alice")
    assert await bd.indexed_usage(harness, "alice") == (files, bd.host_total(harness, "alice"))


async def test_chats_of_one_user_at_once_stay_within_the_file_count(harness: PipeHarness):
    """Naive: four runs of 3 new files each all fit a 6-file quota on their own, so 12 are kept."""
    harness.set_valves(max_files_per_user=6, timeout_seconds=20)
    chats = [f"count-{i}" for i in range(4)]
    for chat in chats:
        await bd.say(harness, "alice", chat, code("print('warm')", "warm"))
    deadline = time.time() + 4
    make = bd.at(deadline, "for i in range(3):\n    open(f'/mnt/data/t{i}.txt', 'w').write('t')")
    answers = await asyncio.gather(*(bd.say(harness, "alice", chat, code(make, "done")) for chat in chats))
    files, _ = bd.user_files(harness.sessions_root, "alice")
    assert files == 6
    said = sum(a.count(": over the limit of 6 files across all your chats") for a in answers)
    assert said == 6
    await assert_index_matches_disk(harness)


async def test_two_users_at_once_are_charged_for_their_own_files_only(harness: PipeHarness):
    """Naive: the quota sums every user's files (bob loses files for alice's), or alice's runs at once
    slip past hers."""
    harness.set_valves(max_mb_per_user=4, timeout_seconds=20)
    alice = [f"a-{i}" for i in range(3)]
    bob = [f"b-{i}" for i in range(2)]
    for user, chats in (("alice", alice), ("bob", bob)):
        for chat in chats:
            await bd.say(harness, user, chat, code("print('warm')", "warm"))
    deadline = time.time() + 4
    big = bd.at(deadline, bd.write("/mnt/data/x.bin", MB + 512 * KB))
    small = bd.at(deadline, bd.write("/mnt/data/x.bin", 768 * KB))
    answers = await asyncio.gather(
        *(bd.say(harness, "alice", chat, code(big)) for chat in alice),
        *(bd.say(harness, "bob", chat, code(small)) for chat in bob),
    )
    alice_answers, bob_answers = answers[:3], answers[3:]
    assert bd.host_total(harness, "alice", answers=alice_answers) <= 4 * MB
    assert sum("Removed /mnt/data/x.bin" + over("4 MiB") in a for a in alice_answers) >= 1
    for answer in bob_answers:
        assert "Removed" not in answer and "Not linked" not in answer, answer
    assert bd.user_files(harness.sessions_root, "bob") == (2, 2 * 768 * KB)
    assert bd.host_total(harness, "bob", answers=bob_answers) == 4 * 768 * KB  # files and their copies
    # Every copy on disk belongs to one of them (none unaccounted for).
    assert bd.copies(harness) == bd.copies(harness, bd.answer_links(answers))
    await assert_index_matches_disk(harness)


async def test_runs_uploads_and_links_of_one_user_at_once_stay_within_the_quota(harness: PipeHarness):
    """Naive: a run, an attachment and a published copy each check the quota alone, all three fit."""
    harness.set_valves(max_mb_per_user=4, timeout_seconds=20)
    for chat in ("run", "upload", "link"):
        await bd.say(harness, "alice", chat, code("print('warm')", "warm"))
    await bd.say(harness, "alice", "link", code(bd.write("/mnt/data/big data.bin", MB + 512 * KB), "made"))
    await bd.say(harness, "alice", "run", code(bd.write("/mnt/data/g.bin", 128 * KB)))
    deadline = time.time() + 3
    upload = harness.upload("alice", "upload.bin", b"u" * (MB + 256 * KB))
    answers = await asyncio.gather(
        bd.say(harness, "alice", "run", code(bd.at(deadline, bd.write("/mnt/data/g.bin", MB, "ab")))),
        bd.say(harness, "alice", "upload", code(bd.at(deadline, "print(1)"), "ok"), files=[upload]),
        bd.say(
            harness,
            "alice",
            "link",
            code(bd.at(deadline, "import os\nos.rename('big data.bin', 'big.bin')"), "/mnt/data/big.bin"),
        ),
    )
    assert bd.host_total(harness, "alice") <= 4 * MB, answers
    await assert_index_matches_disk(harness)
    files, _ = bd.user_files(harness.sessions_root, "alice")
    assert await bd.indexed_usage(harness, "alice") == (files, bd.host_total(harness, "alice"))


async def test_published_copies_count_toward_the_quota(harness: PipeHarness):
    """Naive: copies are outside the quota (files up to the whole quota, plus as much again in copies),
    or counted twice (room refused that is there)."""
    harness.set_valves(max_mb_per_user=4)
    one = await bd.say(harness, "alice", "c", code(bd.write("/mnt/data/a.bin", MB + 512 * KB)))
    assert "ready: [a.bin](" in one  # linked: 1.5 MiB of file and 1.5 MiB of copy
    two = await bd.say(harness, "alice", "c", code(bd.write("/mnt/data/b.bin", 768 * KB)))
    # 3.75 MiB with b.bin: its copy would not fit, the file does.
    assert "Not linked: /mnt/data/b.bin: b.bin was not linked: a copy for download would take 768 KiB" in two
    assert (bd.chat_folder(harness.sessions_root, "alice", "c") / "b.bin").exists()
    three = await bd.say(harness, "alice", "c", code(bd.write("/mnt/data/c.bin", 384 * KB)))
    assert "Removed /mnt/data/c.bin" + over("4 MiB") in three
    four = await bd.say(harness, "alice", "c", code(bd.write("/mnt/data/d.txt", 200 * KB), "ok"))
    assert "Removed" not in four  # 3.95 MiB: the room that is left is usable
    assert bd.host_total(harness, "alice") <= 4 * MB
    assert await bd.indexed_usage(harness, "alice") == (3, bd.host_total(harness, "alice"))


@pytest.mark.parametrize("kernel", ["fresh", "persistent"])
async def test_stopped_runs_of_one_user_at_once_stay_within_the_quota(harness: PipeHarness, kernel: str):
    """Naive: a run whose answer is stopped (the task cancelled: Open WebUI's stop button, a client gone)
    is never reconciled, or its code keeps writing after the quota was decided."""
    harness.set_valves(max_mb_per_user=4, timeout_seconds=30, kernel=kernel)
    chats = ["stop-1", "stop-2"]
    for chat in chats:
        await bd.say(harness, "alice", chat, code("print('warm')", "warm"))
    forever = (
        "import time\nwith open('/mnt/data/w.bin', 'wb') as f:\n    while True:\n"
        "        f.write(b'w' * 262144)\n        f.flush()\n        time.sleep(0.1)"
    )
    tasks = [asyncio.create_task(bd.say(harness, "alice", chat, code(forever))) for chat in chats]
    folders: list[Path] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        folders = [f for f in bd.user_folders(harness.sessions_root, "alice") if (f / "w.bin").exists()]
        if len(folders) == 2 and all((f / "w.bin").stat().st_size >= 2 * MB + 512 * KB for f in folders):
            break
    else:
        raise AssertionError("the runs did not write")
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await asyncio.sleep(1.5)  # a sandbox still alive would go on writing
    assert bd.host_total(harness, "alice") <= 4 * MB
    await assert_index_matches_disk(harness)
    again = await bd.say(harness, "alice", "stop-1", code("print('after', 'stop')"))
    assert "after stop" in again


@pytest.mark.parametrize("kernel", ["fresh", "persistent"])
async def test_code_that_writes_after_its_run_ended_stays_within_the_quota(harness: PipeHarness, kernel: str):
    """Naive: a thread started by the code keeps writing after the run was reconciled, unseen by the
    index and the quota."""
    harness.set_valves(max_mb_per_user=4, timeout_seconds=10, kernel=kernel)
    later = (
        "import threading, time\ndef later():\n    time.sleep(0.8)\n"
        "    with open('/mnt/data/later.bin', 'wb') as f:\n        for _ in range(24):\n"
        "            f.write(b'l' * 262144)\n            f.flush()\n            time.sleep(0.02)\n"
        "threading.Thread(target=later, daemon=True).start()\nprint('returned')"
    )
    answer = await bd.say(harness, "alice", "chat-1", code(later, "ok"))
    assert "returned" in answer
    await asyncio.sleep(3.0)  # long enough for the thread, if it outlived its run, to write 6 MiB
    await bd.say(harness, "alice", "chat-1", code("print('next')", "ok"))
    folder = bd.chat_folder(harness.sessions_root, "alice", "chat-1")
    drift = await harness.pipe._services.store.check()
    assert bd.host_total(harness, "alice") <= 4 * MB, (bd.files_in(folder), drift)
    assert drift == [], drift


@pytest.mark.parametrize("kernel", ["fresh", "persistent"])
async def test_runs_killed_by_a_crash_are_indexed_and_the_quota_holds_after_the_restart(
    tmp_path: Path, caplog, kernel: str
):
    """Naive: files of runs whose process died stay out of the index, so the user's next runs have the
    whole quota again; or the recovery deletes files that were there."""
    valves = dict(SMALL, max_mb_per_user=4, timeout_seconds=30, kernel=kernel)
    data = tmp_path / "data"
    root = data / "code_sessions"
    source = (
        "import time\nwith open('/mnt/data/w.bin', 'wb') as f:\n    for _ in range(14):\n"
        "        f.write(b'w' * 262144)\n        f.flush()\n        time.sleep(0.02)\ntime.sleep(60)"
    )

    def both_written() -> bool:
        found = [f / "w.bin" for f in bd.user_folders(root, "alice")]
        return len(found) == 2 and all(p.exists() and p.stat().st_size >= 14 * 262144 for p in found)

    await asyncio.to_thread(bd.crash_mid_run, data, valves, "alice", ["k-1", "k-2"], source, both_written)
    caplog.set_level(logging.WARNING, logger="code_sessions.storage")
    restarted = PipeHarness(data, valves=valves)
    try:
        answer = await bd.say(restarted, "alice", "k-1", code(bd.write("/mnt/data/extra.bin", 100 * KB)))
        recovered = [r for r in caplog.records if "ended with its process before its files" in r.getMessage()]
        assert len(recovered) == 2, caplog.text
        assert bd.user_files(root, "alice") == (2, 7 * MB)  # nothing the runs wrote was deleted
        assert await bd.indexed_usage(restarted, "alice") == (2, 7 * MB)
        # Over the quota now: the next run starts, is told, and keeps nothing it adds.
        assert bd.AT_LIMIT in answer
        assert "Removed /mnt/data/extra.bin" + over("4 MiB") in answer
        freed = await bd.say(restarted, "alice", "k-2", code("import os\nos.remove('/mnt/data/w.bin')"))
        assert "Deleted: /mnt/data/w.bin" in freed
        more = await bd.say(restarted, "alice", "k-2", code(bd.write("/mnt/data/small.txt", 100 * KB), "ok"))
        assert "Removed" not in more and bd.AT_LIMIT not in more
        await assert_index_matches_disk(restarted)
    finally:
        await restarted.aclose()


# ====================================================================== 2. over the quota; !clear-files

OVER_QUOTA = {
    "bytes": {
        "valves": {"max_mb_per_user": 2},
        "make": bd.write("/mnt/data/a data.bin", MB + 512 * KB)
        + "\n"
        + bd.write("/mnt/data/b data.bin", 512 * KB),
        "read": "print('read', len(open('/mnt/data/a data.bin', 'rb').read()))",
        "expect_read": f"read {MB + 512 * KB}",
        "delete": "/mnt/data/b data.bin",
        "removed": over("2 MiB"),
    },
    "files": {
        "valves": {"max_files_per_user": 2},
        "make": "open('/mnt/data/a.txt', 'w').write('aaa')\nopen('/mnt/data/b.txt', 'w').write('b')",
        "read": "print('read', open('/mnt/data/a.txt').read())",
        "expect_read": "read aaa",
        "delete": "/mnt/data/b.txt",
        "removed": ": over the limit of 2 files across all your chats",
    },
}


@pytest.mark.parametrize("limit", sorted(OVER_QUOTA))
async def test_over_the_quota_a_run_starts_and_can_read_and_delete_but_adds_nothing(
    harness: PipeHarness, limit: str
):
    """Naive: at the quota every run is refused, so the user told to delete files cannot; or the run
    starts but keeps what it adds."""
    case = OVER_QUOTA[limit]
    harness.set_valves(**case["valves"])
    await bd.say(harness, "alice", "chat-1", code(case["make"], "made"))
    at_limit = await bd.say(
        harness, "alice", "chat-1", code(case["read"] + "\nopen('/mnt/data/new.txt', 'w').write('new')", "ok")
    )
    assert case["expect_read"] in at_limit  # it ran, and could read
    assert bd.AT_LIMIT in at_limit and "!clear-files" in at_limit
    assert "Removed /mnt/data/new.txt" + case["removed"] in at_limit
    assert bd.AT_LIMIT in harness.requests[-1]["messages"][-1]["content"]  # the model is told too
    assert not (bd.chat_folder(harness.sessions_root, "alice", "chat-1") / "new.txt").exists()
    deleted = await bd.say(
        harness, "alice", "chat-1", code(f"import os\nos.remove({case['delete']!r})", "ok")
    )
    assert "Deleted: " in deleted and case["delete"] in deleted
    room = await bd.say(harness, "alice", "chat-2", code("open('/mnt/data/c.txt', 'w').write('c')", "ok"))
    assert bd.AT_LIMIT not in room and "Removed" not in room
    assert (bd.chat_folder(harness.sessions_root, "alice", "chat-2") / "c.txt").exists()
    await assert_index_matches_disk(harness)


async def test_over_the_quota_shrinking_a_file_keeps_it_and_frees_room(harness: PipeHarness):
    """Naive: a file that shrank is "changed" and weighed like a new one: removed while over the quota
    (the user loses the file they were making smaller)."""
    await bd.say(harness, "alice", "chat-1", code(bd.write("/mnt/data/big data.bin", 3 * MB), "made"))
    harness.set_valves(max_mb_per_user=2)  # the admin lowers the quota: 3 MiB of 2
    shrunk = await bd.say(
        harness, "alice", "chat-1", code(f"import os\nos.truncate('/mnt/data/big data.bin', {MB})")
    )
    folder = bd.chat_folder(harness.sessions_root, "alice", "chat-1")
    assert bd.AT_LIMIT in shrunk and "Removed" not in shrunk
    assert (folder / "big data.bin").stat().st_size == MB
    added = await bd.say(
        harness, "alice", "chat-1", code(bd.write("/mnt/data/more data.bin", 512 * KB), "ok")
    )
    assert "Removed" not in added and bd.AT_LIMIT not in added
    harness.set_valves(max_mb_per_user=1)  # 1.5 MiB of 1 now
    both = code(
        f"import os\nos.truncate('/mnt/data/big data.bin', {256 * KB})\n"
        + bd.write("/mnt/data/more data.bin", 128 * KB, "ab"),
        "ok",
    )
    answer = await bd.say(harness, "alice", "chat-1", both)  # 0.875 MiB after the run: within the quota
    assert "Removed" not in answer
    assert bd.files_in(folder) == {"big data.bin": 256 * KB, "more data.bin": 640 * KB}
    await assert_index_matches_disk(harness)


async def test_over_the_quota_moving_a_file_does_not_lose_it(harness: PipeHarness):
    """Naive: a rename is a removed path and a new one; over the quota the new one is removed like any
    new file, and the content the user already had is gone."""
    await bd.say(harness, "alice", "chat-1", code(bd.write("/mnt/data/report data.bin", 1536 * KB), "made"))
    harness.set_valves(max_mb_per_user=1)  # the admin lowers the quota
    move = (
        "import os\nos.makedirs('/mnt/data/archive')\n"
        "os.rename('/mnt/data/report data.bin', '/mnt/data/archive/r.bin')"
    )
    answer = await bd.say(harness, "alice", "chat-1", code(move, "ok"))
    assert bd.AT_LIMIT in answer
    folder = bd.chat_folder(harness.sessions_root, "alice", "chat-1")
    assert bd.files_in(folder) == {"archive/r.bin": 1536 * KB}, answer


async def test_clear_files_empties_this_chat_and_its_copies_without_the_model(harness: PipeHarness):
    """Naive: the command goes to the model (which cannot delete a copy), or clears every chat, or leaves
    the published copies counting toward the quota; or a message merely mentioning it clears."""
    make = (
        "import os\nos.makedirs('/mnt/data/sub')\nopen('/mnt/data/a.txt', 'w').write('A')\n"
        "open('/mnt/data/sub/b.txt', 'w').write('B')"
    )
    one = await bd.say(harness, "alice", "chat-1", code(make, "See /mnt/data/a.txt and /mnt/data/sub/b.txt"))
    two = await bd.say(
        harness, "alice", "chat-2", code("open('/mnt/data/keep.txt', 'w').write('K')", "/mnt/data/keep.txt")
    )
    folder = bd.chat_folder(harness.sessions_root, "alice", "chat-1")
    for not_the_command in ("please !clear-files", "!clear-files now", "`!clear-files`"):
        asked = len(harness.requests)
        await bd.say(harness, "alice", "chat-1", not_the_command)
        assert len(harness.requests) > asked and bd.files_in(folder) == {"a.txt": 1, "sub/b.txt": 1}
    asked = len(harness.requests)
    cleared = await bd.say(harness, "alice", "chat-1", "!clear-files")
    assert len(harness.requests) == asked  # answered without the model
    assert "Deleted every file in this chat's /mnt/data (2 files" in cleared
    assert list(folder.iterdir()) == []
    for url in links(one):
        assert not (harness.cache_dir / url.removeprefix("/cache/")).exists(), url
    for url in links(two):
        assert published(harness, url) == b"K"
    assert await bd.indexed_usage(harness, "alice") == (1, bd.host_total(harness, "alice"))
    again = await bd.say(
        harness, "alice", "chat-1", code("import os\nprint('left:', os.listdir('/mnt/data'))")
    )
    assert "left: []" in again
    await assert_index_matches_disk(harness)


async def test_clear_files_with_another_users_chat_id_touches_only_the_senders_session(harness: PipeHarness):
    """Naive: the command clears the folder of the chat id it names, whoever sends it."""
    mine = await bd.say(
        harness, "alice", "chat-1", code("open('/mnt/data/a.txt', 'w').write('A')", "/mnt/data/a.txt")
    )
    await bd.say(harness, "bob", "bob-chat", code("open('/mnt/data/b.txt', 'w').write('B')"))
    before = await bd.indexed_usage(harness, "alice")
    for chat_id in ("chat-1", "", "../chat-1"):
        answer = await bd.say(harness, "bob", chat_id, "!clear-files")
        assert "Deleted every file in this chat's /mnt/data (0 files, 0 B)" in answer
    assert bd.files_in(bd.chat_folder(harness.sessions_root, "alice", "chat-1")) == {"a.txt": 1}
    assert bd.files_in(bd.chat_folder(harness.sessions_root, "bob", "bob-chat")) == {"b.txt": 1}
    for url in links(mine):
        assert published(harness, url) == b"A"
    assert await bd.indexed_usage(harness, "alice") == before
    await assert_index_matches_disk(harness)


@pytest.mark.parametrize("wait", ["waits", "busy"])
async def test_clear_files_while_a_step_of_the_same_chat_runs(harness: PipeHarness, wait: str):
    """Naive: the folder is emptied under the running code (its files half gone, the index wrong), or
    (a step longer than the lock wait, which `timeout_seconds` up to an hour allows) the wait ends in an
    exception out of the pipe instead of a sentence."""
    harness.set_valves(timeout_seconds=20)
    old = await bd.say(
        harness, "alice", "chat-1", code("open('/mnt/data/old.txt', 'w').write('old')", "/mnt/data/old.txt")
    )
    if wait == "busy":
        # Stands in for a run longer than the 300 s the engine waits for a chat's lock.
        harness.pipe._services.lock_timeout_s = 0.5
    slow = code(
        "import time\ntime.sleep(2.5)\nopen('/mnt/data/new.txt', 'w').write('new')\nprint('slow', 'done')",
        "New: /mnt/data/new.txt",
    )
    running, _ = await bd.start_running(harness, "alice", "chat-1", slow)
    cleared = await bd.say(harness, "alice", "chat-1", "!clear-files")
    answer = await running
    assert "slow done" in answer
    folder = bd.chat_folder(harness.sessions_root, "alice", "chat-1")
    if wait == "waits":
        assert "Deleted every file in this chat's /mnt/data" in cleared
        assert list(folder.iterdir()) == []  # it waited for the run: the run's file went too
        assert not (harness.cache_dir / links(old)[0].removeprefix("/cache/")).exists()
        assert await bd.indexed_usage(harness, "alice") == (0, bd.host_total(harness, "alice"))
    else:
        assert "busy" in cleared.lower() and "Deleted every file" not in cleared
        assert sorted(bd.files_in(folder)) == ["new.txt", "old.txt"]
    await assert_index_matches_disk(harness)


async def test_quota_sentences_show_hostile_names_as_text(harness: PipeHarness):
    """Naive: the name of a file removed by the quota goes into the sentence raw (HTML, a link, a heading,
    a bidi override)."""
    harness.set_valves(max_files_per_user=2)
    await bd.say(
        harness,
        "alice",
        "chat-1",
        code("open('/mnt/data/a', 'w').write('a')\nopen('/mnt/data/b', 'w').write('b')"),
    )
    names = [
        "x\n# pwned",
        "<img src=x onerror=alert(1)>",
        "[x](javascript:alert(1))",
        "a`b``c",
        "\u202etxt.exe",
    ]
    answer = await bd.say(
        harness, "alice", "chat-1", code(f"for n in {names!r}:\n    open(n, 'w').write('h')", "ok")
    )
    assert answer.count(": over the limit of 2 files across all your chats") == len(names)
    visible = outside_code(prose(answer))
    for bad in ("<img", "](javascript:", "# pwned"):
        assert not interpreted(bad, visible), bad
    assert "\u202e" not in visible  # no escape neutralizes a bidi override
    assert bd.user_files(harness.sessions_root, "alice") == (2, 2)


# ====================================================================== 3. a full disk


@contextlib.asynccontextmanager
async def on_small_disk(tmp_path: Path, kernel: str = "fresh"):
    """The function with its storage root on a real 16 MiB disk (a tmpfs), unmounted afterwards."""
    with bd.small_disk(tmp_path / "disk") as disk:
        root = disk / "root"
        # Open WebUI's uploads (where the published copies go) on the same disk, as with the default
        # DATA_DIR holding both: a full disk is full for the copies too.
        harness = PipeHarness(
            tmp_path / "data",
            valves=dict(SMALL, storage_root=str(root), kernel=kernel),
            uploads_dir=disk / "uploads",
        )
        try:
            yield harness, root
        finally:
            with contextlib.suppress(Exception):
                await harness.aclose()


@pytest.fixture
async def small_disk(tmp_path: Path):
    async with on_small_disk(tmp_path) as found:
        yield found


async def fill_the_disk(harness: PipeHarness, root: Path, user: str = "alice", chat: str = "chat-1") -> str:
    filled = await bd.say(harness, user, chat, code(bd.fill(), "filled"))
    assert "disk refused after" in filled and "No space left on device" in filled
    assert bd.free_bytes(root) < 64 * KB
    return filled


@pytest.mark.parametrize("kernel", ["fresh", "persistent"])
async def test_full_disk_gives_a_sentence_every_chat_answers_and_the_next_step_recovers(
    tmp_path: Path, kernel: str
):
    """Naive: "database or disk is full" / OSError 28 out of the pipe for every chat of every user, the
    file that filled the disk never indexed, the index damaged, no way to free the space."""
    async with on_small_disk(tmp_path, kernel) as (harness, root):
        await _full_disk_story(harness, root)


async def _full_disk_story(harness: PipeHarness, root: Path) -> None:
    keep = await bd.say(
        harness,
        "alice",
        "chat-1",
        code("open('/mnt/data/keep.txt', 'w').write('keep')", "See /mnt/data/keep.txt"),
    )
    [keep_url] = links(keep.splitlines()[-1])
    await bd.say(harness, "bob", "chat-b", code(bd.write("/mnt/data/bob.bin", 4 * MB), "made"))
    filled = await fill_the_disk(harness, root)
    assert filled.count(bd.DISK_FULL) == 1
    assert bd.DISK_FULL in harness.requests[-1]["messages"][-1]["content"]  # the model reads it too
    for user, chat in (("bob", "chat-b"), ("carol", "chat-c"), ("alice", "chat-2"), ("alice", "chat-1")):
        # A step with nothing to save answers; one with something to save also says it could not.
        answer = await bd.say(harness, user, chat, code(f"print({user!r}, 'answers')", "ok"))
        assert f"{user} answers" in answer and answer.count(bd.DISK_FULL) <= 1, answer
        note = f"open('/mnt/data/{user}-note.txt', 'w').close()\nprint({user!r}, 'saves')"
        answer = await bd.say(harness, user, chat, code(note, "ok"))
        assert f"{user} saves" in answer and answer.count(bd.DISK_FULL) == 1, answer
    # A run can free space while the disk is full; its own bookkeeping then has room.
    freed = await bd.say(harness, "bob", "chat-b", code("import os\nos.remove('/mnt/data/bob.bin')", "ok"))
    assert "Deleted: /mnt/data/bob.bin" in freed and bd.DISK_FULL not in freed
    assert bd.free_bytes(root) > 3 * MB
    for user, chat in (("alice", "chat-1"), ("alice", "chat-2"), ("carol", "chat-c"), ("bob", "chat-b")):
        answer = await bd.say(
            harness, user, chat, code("import os\nprint(sorted(os.listdir('/mnt/data')))", "ok")
        )
        assert bd.DISK_FULL not in answer, answer
    assert "keep" in (bd.chat_folder(root, "alice", "chat-1") / "keep.txt").read_text()
    assert published(harness, keep_url) == b"keep"
    # What the full disk left behind (fill.bin, never indexed by its own step) is indexed now.
    entries = {
        e.path for e in await (await harness.pipe._services.chat("alice", "chat-1")).session.files.list()
    }
    assert entries == {"keep.txt", "fill.bin", "alice-note.txt"}
    drift = await harness.pipe._services.store.check()
    assert drift == [], drift
    bd.index_is_sound(root)


async def test_full_disk_while_linking_a_file_gives_a_sentence(small_disk):
    """Naive: linking a file that has no copy yet, on a full disk, raises out of the pipe."""
    harness, root = small_disk
    upload = harness.upload("alice", "att.txt", b"attached")
    attached = await bd.say(harness, "alice", "chat-1", "here", files=[upload])
    assert "Attached file available as `/mnt/data/att.txt`" in attached  # copied, not linked yet
    await fill_the_disk(harness, root)
    answer = await bd.say(harness, "alice", "chat-1", code("print('still', 'here')", "See /mnt/data/att.txt"))
    assert "still here" in answer
    [reply] = [line for line in answer.splitlines() if line.startswith("See")]
    assert links(reply) == [] and harness.files.stored() == []  # no link to a copy that is not there
    [said] = [line for line in answer.splitlines() if line.startswith("- Not linked: /mnt/data/att.txt:")]
    assert "Not enough disk space to publish att.txt; nothing was published." in said, said
    assert (bd.chat_folder(root, "alice", "chat-1") / "att.txt").read_bytes() == b"attached"  # kept


async def test_full_disk_with_an_attachment_gives_a_sentence(small_disk):
    """Naive: an attachment on a full disk raises out of the pipe, and so does every later message that
    carries it."""
    harness, root = small_disk
    await fill_the_disk(harness, root)
    upload = harness.upload("alice", "att.txt", b"attached")
    first = await bd.say(harness, "alice", "chat-1", code("print('still', 'here')", "ok"), files=[upload])
    assert "still here" in first and first.count("The attachment att.txt was not copied into /mnt/data") == 1
    second = await bd.say(harness, "alice", "chat-1", code("print('again')", "ok"), files=[upload])
    assert "again" in second and "att.txt" not in second


@pytest.mark.parametrize("chat", ["the chat that filled it", "a chat with little"])
async def test_clear_files_on_a_full_disk(small_disk, chat: str):
    """Naive: on a full disk the command that frees space needs space for its bookkeeping first, and
    fails with an exception."""
    harness, root = small_disk
    linked = {}
    for user, chat_id in (("bob", "chat-b"), ("alice", "chat-1")):
        made = await bd.say(
            harness, user, chat_id, code("open('/mnt/data/b.txt', 'w').write('b')", "/mnt/data/b.txt")
        )
        [linked[user]] = links(made.splitlines()[-1])
    await fill_the_disk(harness, root)
    user, chat_id = ("alice", "chat-1") if chat == "the chat that filled it" else ("bob", "chat-b")
    cleared = await bd.say(harness, user, chat_id, "!clear-files")
    # What the README promises: the folder emptied and the copies its answers linked deleted.
    assert "Deleted every file in this chat's /mnt/data" in cleared, cleared
    assert "and the download copies linked in its earlier answers" in cleared, cleared
    assert list(bd.chat_folder(root, user, chat_id).iterdir()) == []
    assert harness.files.fetch(linked[user], user) is None  # its copy is gone
    other = "alice" if user == "bob" else "bob"
    assert published(harness, linked[other]) == b"b"  # the other chat's is not
    answer = await bd.say(harness, user, chat_id, code("print('after', 'clearing')", "ok"))
    assert "after clearing" in answer


async def test_open_webui_restarted_while_the_disk_is_full_answers_with_a_sentence(tmp_path: Path):
    """Naive: a restart while the disk is full cannot open the store: every chat of every user fails
    until an admin frees space."""
    with bd.small_disk(tmp_path / "disk") as disk:
        root = disk / "root"
        first = PipeHarness(tmp_path / "data", valves=dict(SMALL, storage_root=str(root), kernel="fresh"))
        try:
            keep = await bd.say(
                first,
                "alice",
                "chat-1",
                code("open('/mnt/data/keep.txt', 'w').write('keep')", "/mnt/data/keep.txt"),
            )
            await fill_the_disk(first, root)
        finally:
            await first.aclose()
        restarted = bd.reopen(first)
        try:
            for user, chat in (("alice", "chat-1"), ("bob", "chat-b")):
                answer = await bd.say(restarted, user, chat, code(f"print({user!r}, 'answers')", "ok"))
                assert f"{user} answers" in answer and bd.DISK_FULL in answer
            (bd.chat_folder(root, "alice", "chat-1") / "fill.bin").unlink()  # an admin frees space
            after = await bd.say(
                restarted, "alice", "chat-1", code("print(open('/mnt/data/keep.txt').read())")
            )
            assert "keep" in after and bd.DISK_FULL not in after
            assert published(restarted, links(keep)[-1]) == b"keep"
            await assert_index_matches_disk(restarted)
            bd.index_is_sound(root)
        finally:
            await restarted.aclose()


@pytest.mark.parametrize("then", ["a step", "the tick"])
async def test_a_chat_started_on_a_full_disk_is_indexed_once_the_disk_is_freed(small_disk, then: str):
    harness, root = small_disk
    await bd.say(harness, "alice", "chat-1", code("open('/mnt/data/keep.txt', 'w').write('keep')", "ok"))
    await fill_the_disk(harness, root)
    started = await bd.say(harness, "carol", "chat-c", code("print('carol', 'answers')", "ok"))
    assert "carol answers" in started, started
    (bd.chat_folder(root, "alice", "chat-1") / "fill.bin").unlink()  # an admin frees space
    if then == "a step":  # another chat's, warm: nothing of its own to write
        answer = await bd.say(harness, "alice", "chat-1", code("print('after')", "ok"))
        assert "after" in answer and bd.DISK_FULL not in answer, answer
    else:
        await harness.pipe._tick()
    drift = await harness.pipe._services.store.check()
    assert drift == [], drift
    assert {info.chat_id for info in await harness.pipe._services.store.sessions()} == {"chat-1", "chat-c"}
    bd.index_is_sound(root)


# ====================================================================== 4. attachments

TOO_LARGE = {
    "file limit": ({"max_file_mb": 1}, "per-file limit"),
    "quota": ({"max_mb_per_user": 1}, "storage limit"),
}
HOSTILE_UPLOAD = "<img src=x onerror=alert(1)>[x](javascript:alert(1))\n# big.csv"


@pytest.mark.parametrize("limit", sorted(TOO_LARGE))
async def test_an_attachment_too_large_is_said_once_and_the_chat_goes_on(harness: PipeHarness, limit: str):
    """Naive: QuotaExceeded out of the pipe, at this message and at every later one that carries the same
    attachment; or the refusal repeated at every message; or the hostile name rendered."""
    valves, why = TOO_LARGE[limit]
    harness.set_valves(**valves)
    big = harness.upload("alice", HOSTILE_UPLOAD, b"x" * (MB + 256 * KB))
    first = await bd.say(harness, "alice", "chat-1", code("print('first', 'run')", "ok"), files=[big])
    assert "first run" in first
    assert first.count("was not copied into /mnt/data") == 1 and why in first
    visible = outside_code(prose(first))
    for bad in ("<img", "](javascript:", "\n# big"):
        assert not interpreted(bad, visible), bad
    assert (
        "was not copied into /mnt/data" in harness.requests[-1]["messages"][0]["content"]
    )  # the model knows
    small = harness.upload("alice", "small.csv", b"a,b\n")
    for _ in range(2):
        later = await bd.say(
            harness,
            "alice",
            "chat-1",
            code("import os\nprint('files:', sorted(os.listdir('/mnt/data')))", "ok"),
            files=[big, small],
        )
        assert "files: ['small.csv']" in later
        assert "not copied" not in later and "onerror" not in later
        assert "not copied" not in harness.requests[-1]["messages"][0]["content"]
    await assert_index_matches_disk(harness)


UNREADABLE = {
    "os error": PermissionError(13, "Permission denied", "/app/backend/data/uploads/gone.pdf"),
    # What Open WebUI's S3, GCS and Azure storage providers raise when a download fails
    # (open_webui/storage/provider.py, get_file).
    "storage provider error": RuntimeError("Error downloading file from S3: An error occurred (NoSuchKey)"),
}


@pytest.mark.parametrize("error", ["os error", "storage provider error"])
async def test_an_unreadable_attachment_is_said_once_and_the_chat_goes_on(harness: PipeHarness, error: str):
    """Naive: the file store's error goes out of the pipe, at every message that carries the attachment."""
    gone = harness.upload("alice", "gone.pdf", b"")
    host = harness.pipe._host
    read_upload = host.read_upload

    async def failing_store(file_id: str, user_id: str):  # Open WebUI's file store, failing for one file
        if file_id == gone["id"]:
            raise UNREADABLE[error]
        return await read_upload(file_id, user_id)

    host.read_upload = failing_store
    first = await bd.say(harness, "alice", "chat-1", code("print('goes', 'on')", "ok"), files=[gone])
    assert "goes on" in first and first.count("The attachment gone.pdf was not copied into /mnt/data") == 1
    second = await bd.say(harness, "alice", "chat-1", code("print('and', 'on')", "ok"), files=[gone])
    assert "and on" in second and "gone.pdf" not in second


# ====================================================================== 5. the index damaged while running


async def two_chats_with_links(harness: PipeHarness) -> tuple[str, str]:
    a = await bd.say(
        harness, "alice", "chat-1", code("open('/mnt/data/a.txt', 'w').write('AAA')", "See /mnt/data/a.txt")
    )
    b = await bd.say(
        harness, "alice", "chat-2", code("open('/mnt/data/b.txt', 'w').write('BBB')", "See /mnt/data/b.txt")
    )
    return a, b


def damage_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "code_sessions.storage" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("how", ["truncated", "garbage", "pages"])
async def test_damaged_index_is_rebuilt_at_the_next_step_and_nothing_is_lost(
    harness: PipeHarness, caplog, how: str
):
    """Naive: "disk I/O error" / "file is not a database" at every message until a restart; or a new
    empty index that forgets the files (off the quota, out of the prompt) and the earlier links."""
    a, b = await two_chats_with_links(harness)
    [url_a], [url_b] = links(a.splitlines()[-1]), links(b.splitlines()[-1])
    caplog.set_level(logging.WARNING, logger="code_sessions.storage")
    bd.damage_index(harness.sessions_root / "index.sqlite3", how)
    history = [{"role": "user", "content": "make a"}, {"role": "assistant", "content": a}]
    answer = await bd.say(
        harness, "alice", "chat-1", code("print(open('/mnt/data/a.txt').read())", "ok"), history=history
    )
    assert "AAA" in answer
    assert damage_warnings(caplog), "the damage was not even noticed"
    messages = harness.requests[-1]["messages"]
    assert "/mnt/data/a.txt" in messages[0]["content"]  # the model is told the chat's files
    assert url_a not in messages[1]["content"]  # the earlier answer reads as paths again: its link known
    await bd.say(harness, "alice", "chat-2", code("print(2)", "ok"))
    assert "/mnt/data/b.txt" in harness.requests[-1]["messages"][0]["content"]
    assert published(harness, url_a) == b"AAA" and published(harness, url_b) == b"BBB"
    assert {link.url for link in await harness.pipe._services.store.links()} >= {url_a, url_b}
    assert await bd.indexed_usage(harness, "alice") == (2, bd.host_total(harness, "alice"))
    await assert_index_matches_disk(harness)


@pytest.mark.parametrize(
    "how",
    ["truncated", "garbage", "pages"],
)
async def test_index_damage_is_logged_once(harness: PipeHarness, caplog, how: str):
    """Naive: every message logs the damage again (or nothing says it happened)."""
    await two_chats_with_links(harness)
    caplog.set_level(logging.WARNING, logger="code_sessions.storage")
    bd.damage_index(harness.sessions_root / "index.sqlite3", how)
    for chat in ("chat-1", "chat-2", "chat-1"):
        await bd.say(harness, "alice", chat, code("print(1)", "ok"))
    warnings = damage_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage()[:200] for r in warnings]


@pytest.mark.parametrize("noticed_by", ["its own step", "another chat"])
async def test_index_damaged_in_the_middle_of_a_step_loses_nothing(harness: PipeHarness, noticed_by: str):
    """Naive: the rebuild at the damage skips the chat whose step is running, and nothing indexes its
    folder again: its files are forgotten (quota, prompt, expiry) and its links are strays."""
    a, _ = await two_chats_with_links(harness)
    [url_a] = links(a.splitlines()[-1])
    running, _ = await bd.start_running(
        harness, "alice", "chat-1", code("import time\ntime.sleep(2.5)\nprint('slept')", "ok")
    )
    bd.damage_index(harness.sessions_root / "index.sqlite3", "truncated")
    if noticed_by == "another chat":
        await bd.say(harness, "alice", "chat-2", code("print(2)", "ok"))
    assert "slept" in await running
    await bd.say(harness, "alice", "chat-1", code("print(open('/mnt/data/a.txt').read())", "ok"))
    assert "/mnt/data/a.txt" in harness.requests[-1]["messages"][0]["content"]
    await assert_index_matches_disk(harness)
    assert url_a in {link.url for link in await harness.pipe._services.store.links()}
    assert await bd.indexed_usage(harness, "alice") == (2, bd.host_total(harness, "alice"))
    # Eleven minutes later the cleanup runs: the earlier link must still download.
    copy_of(harness, url_a).created_at = time.time() - 660  # old enough to be taken for a stray
    await harness.pipe._services.store.cleanup()
    assert published(harness, url_a) == b"AAA"


async def test_index_deleted_while_open_loses_nothing_here_and_after_a_restart(harness: PipeHarness):
    """Naive: the process goes on with an index nobody else sees, and a restart starts from an empty one
    (files off the quota, earlier links forgotten)."""
    a, _ = await two_chats_with_links(harness)
    [url_a] = links(a.splitlines()[-1])
    bd.damage_index(harness.sessions_root / "index.sqlite3", "deleted")
    answer = await bd.say(
        harness,
        "alice",
        "chat-1",
        code("open('/mnt/data/c.txt', 'w').write('C')\nprint(open('/mnt/data/a.txt').read())"),
    )
    assert "AAA" in answer and "/mnt/data/a.txt" in harness.requests[-1]["messages"][0]["content"]
    await harness.aclose()
    restarted = bd.reopen(harness)
    try:
        await bd.say(restarted, "alice", "chat-1", code("print(1)", "ok"))
        prompt = restarted.requests[-1]["messages"][0]["content"]
        assert "/mnt/data/a.txt" in prompt and "/mnt/data/c.txt" in prompt
        assert published(restarted, url_a) == b"AAA"
        assert url_a in {link.url for link in await restarted.pipe._services.store.links()}
        assert await bd.indexed_usage(restarted, "alice") == (3, bd.host_total(restarted, "alice"))
        await assert_index_matches_disk(restarted)
    finally:
        await restarted.aclose()


async def test_index_deleted_while_open_is_noticed_before_another_worker_splits_the_quota(
    harness: PipeHarness, caplog
):
    """Naive: two Open WebUI workers (or a worker and the CLI) end up with two indexes after the file is
    deleted: the user gets the quota once in each."""
    harness.set_valves(max_mb_per_user=4)
    await bd.say(harness, "alice", "chat-1", code("print('warm')", "warm"))
    caplog.set_level(logging.WARNING, logger="code_sessions.storage")
    bd.damage_index(harness.sessions_root / "index.sqlite3", "deleted")
    second = PipeHarness(harness.data_dir, valves=dict(SMALL, max_mb_per_user=4))  # a worker starting now
    try:
        await bd.say(second, "alice", "chat-2", code("print('warm')", "warm"))
        one = await bd.say(harness, "alice", "chat-1", code(bd.write("/mnt/data/one data.bin", 3 * MB), "ok"))
        two = await bd.say(second, "alice", "chat-2", code(bd.write("/mnt/data/two data.bin", 3 * MB), "ok"))
        assert bd.user_files(harness.sessions_root, "alice")[1] <= 4 * MB
        assert damage_warnings(caplog), "the deleted index went unnoticed"
        assert over("4 MiB") in one + two, (one, two)
    finally:
        await second.aclose()


# ====================================================================== 6. a rewrite that hides itself

REWRITES = {
    "in place": "with open('/mnt/data/data.csv', 'r+b') as f:\n    f.write(NEW)",
    "truncated": "with open('/mnt/data/data.csv', 'wb') as f:\n    f.write(NEW)",
    "replaced": "open('/mnt/data/.tmp', 'wb').write(NEW)\nos.replace('/mnt/data/.tmp', '/mnt/data/data.csv')",
}


def hidden_rewrite(how: str, new: bytes) -> str:
    """Rewrite data.csv with bytes of the same length, then put its size and mtime_ns back."""
    return (
        "import os\nst = os.stat('/mnt/data/data.csv')\n"
        + REWRITES[how].replace("NEW", repr(new))
        + "\nos.utime('/mnt/data/data.csv', ns=(st.st_atime_ns, st.st_mtime_ns))\n"
        "after = os.stat('/mnt/data/data.csv')\n"
        "print('restored', (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns))"
    )


@pytest.mark.parametrize("how", sorted(REWRITES))
async def test_a_file_rewritten_with_its_size_and_mtime_restored_gets_a_new_copy(
    harness: PipeHarness, how: str
):
    """Naive: size and mtime_ns unchanged means unchanged, so the new answer links the old copy (the old
    bytes); or the new copy replaces the old one under the earlier answer's link."""
    old, new = b"A" * 4096, b"B" * 4096
    first = await bd.say(
        harness,
        "alice",
        "chat-1",
        code(f"open('/mnt/data/data.csv', 'wb').write({old!r})", "See /mnt/data/data.csv"),
    )
    [url_old] = links(_see_line(first))
    path = bd.chat_folder(harness.sessions_root, "alice", "chat-1") / "data.csv"
    before = path.stat()
    second = await bd.say(
        harness, "alice", "chat-1", code(hidden_rewrite(how, new), "See /mnt/data/data.csv")
    )
    assert "restored True" in second
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)  # the host sees it too
    assert path.read_bytes() == new
    [url_new] = links(_see_line(second))
    assert published(harness, url_new) == new
    assert published(harness, url_old) == old
    back = await bd.say(harness, "alice", "chat-1", code(hidden_rewrite(how, old), "See /mnt/data/data.csv"))
    [url_back] = links(_see_line(back))
    assert published(harness, url_back) == old and published(harness, url_new) == new


def _see_line(answer: str) -> str:
    """The answer's own line that links the file (a table preview follows it)."""
    [line] = [line for line in answer.splitlines() if line.startswith("See ")]
    return line


# ====================================================================== 7. waiting; the purge valve


WAIT_KINDS = {
    "run": lambda harness: {"text": code("print('second')", "ok")},
    "attachment": lambda harness: {"text": "hello", "files": [harness.upload("alice", "w.csv", b"w")]},
    "clear": lambda harness: {"text": "!clear-files"},
}


@pytest.mark.parametrize("kind", ["run", "attachment", "clear"])
async def test_a_message_waiting_for_a_busy_chat_says_it_waits(harness: PipeHarness, kind: str):
    """Naive: the second message shows "Running Python…" (or nothing) for the whole time it waits, or
    still shows that it waits once it is over."""
    harness.set_valves(timeout_seconds=15)
    await bd.say(harness, "alice", "chat-1", code("print('warm')", "warm"))
    first, first_events = await bd.start_running(
        harness, "alice", "chat-1", code("import time\ntime.sleep(2.5)")
    )
    message = WAIT_KINDS[kind](harness)
    _, events = await bd.say_with_events(harness, "alice", "chat-1", message.pop("text"), **message)
    said = bd.statuses(events)
    assert any(bd.WAITING in s for s in said), said
    # Then it goes: once the message is over, no status in progress (nor a copy of its text) stays.
    last = [e["data"] for e in events if e.get("type") == "status"][-1]
    assert last["done"] and last.get("hidden") is True, last
    await first
    assert not any(bd.WAITING in s for s in bd.statuses(first_events))  # only when it really waits


PURGE_VALUES = [
    "x" * 100_000,
    "user:" + "u" * 100_000,
    "chat:" + "c" * 100_000,
    "idle:" + "9" * 100_000 + "d",
    "idle:" + "d" * 100_000,
]


async def test_a_huge_purge_valve_is_logged_bounded(harness: PipeHarness, caplog):
    """Naive: the admin's 100 KB purge text goes whole into the log line (or its error message), every
    minute; or a huge duration breaks every chat."""
    caplog.set_level(logging.DEBUG, logger="code_sessions")
    await bd.say(harness, "alice", "chat-1", code("open('/mnt/data/kept.txt', 'w').write('k')"))
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    for value in PURGE_VALUES:
        caplog.clear()
        harness.set_valves(purge=value)
        answer = await bd.say(harness, "alice", "chat-1", code("print('still', 'works')"))
        assert "still works" in answer
        lines = [formatter.format(r) for r in caplog.records if r.name.startswith("code_sessions")]
        assert any("purge" in line for line in lines), value[:20]
        assert max(map(len, lines)) < 2000, value[:20]
        assert harness.stored_valves["purge"] == ""  # one-shot: cleared
    assert (bd.chat_folder(harness.sessions_root, "alice", "chat-1") / "kept.txt").exists()
