"""What a chat keeps beside its folder for the buttons under an answer and for its clones, on both index
backends: the records of its runs (bounded, counted with its states), its exports (a notebook, the
folder as a zip: published like a file, counted, one per slot, kept by cleanups while the chat lives,
gone with it), and a state copied into another chat's history (a clone: private copies, what fits)."""

from __future__ import annotations

import base64
import io
import os
import time
import zipfile
from pathlib import Path

import pytest

from storage import HistoryError, Policy, QuotaExceeded, Quotas, Room, StorageError, Store
from storage import _history_runs as runs

KEEP = {"keep_states": 20, "keep_kernels": 3, "room_bytes": None}
PNG = b"\x89PNG\r\n\x1a\n" + b"p" * 100


async def record(session, message: str, code: str, **extra) -> None:
    kwargs = {"language": "python", "code": code, "outcome": "ok", "stdout": "", "stderr": "", "figures": []}
    await session.history.add_run(message, **{**kwargs, **extra})


# ---- the runs' records ----------------------------------------------------------------------------------


async def test_a_runs_record_keeps_code_output_and_the_figures_as_they_were(store: Store) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / "figure-1.png").write_bytes(PNG)
        os.symlink("/etc/passwd", session.path / "evil.png")
        await record(
            session, "a1", "print(1)", stdout="1\n", figures=["figure-1.png", "evil.png", "gone.png"]
        )
        await record(session, "a1", "ls", language="bash", stdout="figure-1.png\n")
        (session.path / "figure-1.png").write_bytes(b"changed later")
        found = await session.history.runs(["a1", "a2"])
    assert list(found) == ["a1"]
    first, second = found["a1"].runs
    assert (first.code, first.stdout, second.language) == ("print(1)", "1\n", "bash")
    # The figure as it was when the run ended; a link or a missing file is no figure (and said so).
    assert [f.path for f in first.figures] == ["figure-1.png"]
    assert base64.b64decode(first.figures[0].data) == PNG
    assert first.clipped == ("figures",)


async def test_records_are_bounded_and_count_with_the_chats_states(store: Store, monkeypatch) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        await record(session, "a0", "x" * (runs.MAX_CODE_CHARS + 10))
        [clipped] = (await session.history.runs(["a0"]))["a0"].runs
        assert len(clipped.code) == runs.MAX_CODE_CHARS and "code" in clipped.clipped
        monkeypatch.setattr(runs, "MAX_CHAT_BYTES", 20_000)
        for n in range(1, 8):
            await record(session, f"a{n}", "y" * 5000)
            os.utime(session.history.folder / "runs", None)
            time.sleep(0.01)  # records age by their files' times
        kept = await session.history.runs([f"a{n}" for n in range(8)])
        (session.path / "f.txt").write_text("f")
        saved = await session.history.save("a7", **KEEP)
    # The oldest answers' records went to keep the chat within its bound; the newest are there.
    assert "a0" not in kept and "a7" in kept and len(kept) <= 4
    on_disk = sum(p.stat().st_size for p in (session.history.folder / "runs").iterdir())
    assert on_disk <= 20_000
    assert saved.history_bytes >= on_disk  # counted toward the user's storage with the states


async def test_a_damaged_line_is_no_run_and_a_forged_header_no_record(store: Store) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        await record(session, "a1", "print(1)")
        await record(session, "a1", "print(2)")
        [path] = (session.history.folder / "runs").iterdir()
        header, first, second, _ = path.read_bytes().split(b"\n")
        path.write_bytes(b"\n".join([header, b'{"code": 5, "language": "python"}', second, b'{"lang']))
        [kept] = (await session.history.runs(["a1"]))["a1"].runs
        assert kept.code == "print(2)"
        path.write_bytes(b'{"format": 1, "message_id": "another"}\n' + first + b"\n")
        assert await session.history.runs(["a1"]) == {}


async def test_runs_past_an_answers_bound_are_counted_not_kept(store: Store, monkeypatch) -> None:
    monkeypatch.setattr(runs, "MAX_RUNS_PER_ANSWER", 2)
    session = await store.session("u", "c")
    async with session.lock():
        for n in range(4):
            await record(session, "a1", f"print({n})")
        found = (await session.history.runs(["a1"]))["a1"]
    assert [r.code for r in found.runs] == ["print(0)", "print(1)"] and found.more_runs == 2


# ---- exports ------------------------------------------------------------------------------------------


async def test_an_export_is_counted_replaces_the_one_before_and_goes_with_its_chat(store: Store) -> None:
    session = await store.session("u", "c")
    first, replaced = await session.export_bytes("notebook-x", "My chat.ipynb", b"{}" * 100)
    assert replaced == [] and first.path == "/exports/notebook-x/My_chat.ipynb"
    assert (await session.user_usage()).bytes == 200
    again, replaced = await session.export_bytes("notebook-x", "My chat.ipynb", b"{}" * 100)
    assert (again.ref, replaced) == (first.ref, [])  # the same bytes: the same copy
    newer, replaced = await session.export_bytes("notebook-x", "My chat.ipynb", b"[]" * 300)
    assert replaced == [first.ref] and newer.ref != first.ref
    assert (await session.user_usage()).bytes == 600
    assert [link.path for link in await session.links()] == [newer.path]
    # A cleanup keeps it (it has no file to be missing), however old.
    report = await store.cleanup()
    assert report.links_removed == 0
    await store.delete_chats([("u", "c")], "deleted in Open WebUI")
    assert await store.links() == []


async def test_an_export_over_the_quota_is_refused_with_the_sentence(store: Store) -> None:
    session = await store.session("u", "c", policy=Policy(Quotas(max_bytes_per_user=1000)))
    with pytest.raises(QuotaExceeded, match="was not linked: a copy for download would take"):
        await session.export_bytes("zip", "all.zip", b"z" * 2000)
    assert await session.links() == []


async def test_the_folder_as_a_zip_holds_its_files_and_nothing_a_link_points_at(
    store: Store, tmp_path: Path
) -> None:
    session = await store.session("u", "c")
    (session.path / "sub").mkdir()
    (session.path / "sub" / "a.csv").write_text("a\n1\n")
    (session.path / "b.txt").write_text("b")
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    os.symlink(outside, session.path / "link.txt")
    async with session.lock():
        link, files, size = await session.export_zip("chat-files.zip", max_bytes=None)
    assert (files, size) == (2, 5)
    data = Path(store.publisher.directory, link.ref, link.name).read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert sorted(archive.namelist()) == ["b.txt", "sub/a.csv"]
    async with session.lock():
        with pytest.raises(StorageError, match=r"Not zipped: this chat's files take 5 B, more than the 4 B"):
            await session.export_zip("chat-files.zip", max_bytes=4)


# ---- a state copied into a clone's history ---------------------------------------------------------------


async def test_a_clone_gets_private_copies_of_what_fits(store: Store) -> None:
    source = await store.session("alice", "src")
    async with source.lock():
        for name in ("a.txt", "b.txt", "c.txt"):
            (source.path / name).write_text(name * 100)
        await source.history.save("m1", **KEEP)
        kernel = await source.history.kernel_dir("m1") / "kernel"
        kernel.mkdir()
        (kernel / "image.bin").write_bytes(b"k" * 1000)
        await record(source, "m1", "print(1)")
    clone = await store.session("alice", "clone")
    async with clone.lock():
        imported = await clone.history.import_from(
            source.history,
            ["m2", "m1"],
            Room(files=2, bytes=None, python_bytes=10_000),
            python=True,
            records=True,
        )
        assert (imported.message_id, imported.files, imported.skipped, imported.python) == ("m1", 2, 1, True)
        await clone.history.restore("m1")
        assert sorted(os.listdir(clone.path)) == ["a.txt", "b.txt"]
        assert (await clone.history.kernel_of("m1")) is not None
        assert list(await clone.history.runs(["m1"])) == ["m1"]
    # Nothing shared with the source: a change on one side is never seen on the other.
    ours = {os.lstat(p).st_ino for p in clone.state_path.rglob("*")} | {
        os.lstat(p).st_ino for p in clone.path.rglob("*")
    }
    theirs = {os.lstat(p).st_ino for p in source.state_path.rglob("*")} | {
        os.lstat(p).st_ino for p in source.path.rglob("*")
    }
    assert not ours & theirs
    # A Python state larger than the room stays behind; so does every file when none fits.
    other = await store.session("alice", "clone-2")
    async with other.lock():
        small = await other.history.import_from(
            source.history, ["m1"], Room(bytes=600, python_bytes=600), python=True, records=False
        )
    assert (small.files, small.python, small.python_why) == (1, False, "too large")


async def test_a_damaged_source_state_copies_nothing(store: Store) -> None:
    source = await store.session("alice", "src")
    async with source.lock():
        (source.path / "a.txt").write_text("a")
        await source.history.save("m1", **KEEP)
    for obj in (source.history.folder / "objects").iterdir():
        obj.chmod(0o600)
        obj.write_bytes(b"other size")
    clone = await store.session("alice", "clone")
    async with clone.lock():
        with pytest.raises(HistoryError, match="damaged"):
            await clone.history.import_from(source.history, ["m1"], Room(), python=False, records=False)
