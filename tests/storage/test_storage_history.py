"""A chat folder's history by message (session.history): states saved at the end of answers and put
back when the conversation branches, on both index backends, with hostile things in the folder."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
import sys
from pathlib import Path

import pytest

from storage import FileExists, HistoryError, StorageError, Store

KEEP = {"keep_states": 20, "keep_kernels": 3, "room_bytes": None}


def contents(folder: Path) -> dict[str, bytes]:
    found = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = Path(dirpath) / name
            found[str(path.relative_to(folder))] = path.read_bytes()
    return found


async def test_a_branch_gets_back_the_files_of_the_message_it_continues_from(store: Store) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / "data.csv").write_text("a\n1\n2\n3\n4\n")
        (session.path / "sub").mkdir()
        (session.path / "sub" / "keep.txt").write_text("kept")
        first = await session.history.save("m1", **KEEP)
        assert (first.files, first.copied_files) == (2, 2)
        # Turn 2 halves the file in place, adds one, deletes one, and leaves an empty folder.
        with open(session.path / "data.csv", "r+") as fh:
            fh.truncate(4)
        (session.path / "new.txt").write_text("new")
        os.unlink(session.path / "sub" / "keep.txt")
        (session.path / "empty").mkdir()
        second = await session.history.save("m2", **KEEP)
        assert second.copied_files == 2  # what changed, and nothing else
        restored = await session.history.restore("m1")
        assert contents(session.path) == {"data.csv": b"a\n1\n2\n3\n4\n", "sub/keep.txt": b"kept"}
        assert not (session.path / "empty").exists()
        assert restored.files == 2
        head = await session.history.head()
        assert (head.message_id, head.dirty, head.restoring) == ("m1", False, False)
        # And back to the other branch.
        await session.history.restore("m2")
        assert contents(session.path) == {"data.csv": b"a\n1\n", "new.txt": b"new"}
        assert (session.path / "empty").is_dir()


async def test_a_file_written_in_place_never_changes_an_older_state(store: Store) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / "f.bin").write_bytes(b"0" * 8192)
        await session.history.save("m1", **KEEP)
        # The same inode, rewritten through a mapping.
        with open(session.path / "f.bin", "r+b") as fh, mmap.mmap(fh.fileno(), 0) as mapped:
            mapped[:4] = b"XXXX"
        with open(session.path / "f.bin", "r+") as fh:
            fh.seek(100)
            fh.write("Y")
        await session.history.save("m2", **KEEP)
        await session.history.restore("m1")
        assert (session.path / "f.bin").read_bytes() == b"0" * 8192
        await session.history.restore("m2")
        data = (session.path / "f.bin").read_bytes()
        assert data[:4] == b"XXXX" and data[100:101] == b"Y"


async def test_unchanged_files_are_not_copied_again_and_a_restore_keeps_what_is_already_right(
    store: Store,
) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        for i in range(50):
            (session.path / f"f{i}.txt").write_text(str(i))
        assert (await session.history.save("m1", **KEEP)).copied_files == 50
        (session.path / "f7.txt").write_text("changed")
        saved = await session.history.save("m2", **KEEP)
        assert (saved.copied_files, saved.copied_bytes) == (1, len("changed"))
        inode = (session.path / "f8.txt").stat().st_ino
        restored = await session.history.restore("m1")
        assert restored.copied_files == 1  # only f7.txt
        assert (session.path / "f8.txt").stat().st_ino == inode
        assert (session.path / "f7.txt").read_text() == "7"


async def test_links_fifos_and_odd_names_in_the_folder_go_on_restore_and_are_never_followed(
    store: Store, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("host file")
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / "a.txt").write_text("a")
        os.symlink(outside, session.path / "link-at-save")
        saved = await session.history.save("m1", **KEEP)
        assert saved.files == 1  # the link is not a file of the state
        os.unlink(session.path / "a.txt")
        os.symlink(outside, session.path / "a.txt")  # where a.txt was: restoring must not write through it
        os.mkfifo(session.path / "pipe")
        os.mkdir(session.path / "dir")
        os.symlink("/", session.path / "dir" / "root")
        with open(os.path.join(os.fsencode(session.path), b"caf\xe9"), "wb") as fh:
            fh.write(b"x")
        await session.history.restore("m1")
        assert sorted(os.listdir(session.path)) == ["a.txt"]
        assert not (session.path / "a.txt").is_symlink()
        assert (session.path / "a.txt").read_text() == "a"
        assert outside.read_text() == "host file"


async def test_a_state_no_longer_kept_or_damaged_is_refused_and_the_folder_stays(store: Store) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / "a.txt").write_text("a")
        await session.history.save("m1", **KEEP)
        (session.path / "a.txt").write_text("b")
        await session.history.save("m2", **KEEP)
        with pytest.raises(HistoryError, match="no longer kept"):
            await session.history.restore("never")
        objects = session.history.folder / "objects"
        for obj in os.listdir(objects):
            os.chmod(objects / obj, 0o600)
            with open(objects / obj, "ab") as fh:
                fh.write(b"!")  # every version is now of another size
        with pytest.raises(HistoryError, match="damaged"):
            await session.history.restore("m1")
        assert (session.path / "a.txt").read_text() == "b"
        # A forged state that names a place outside the folder is no state at all.
        state = next((session.history.folder / "states").iterdir())
        data = json.loads(state.read_text())
        data["files"] = {"../../escape": next(iter(data["files"].values()))}
        state.write_text(json.dumps(data))
        with pytest.raises(HistoryError):
            await session.history.restore(data["message_id"])


async def test_old_states_go_beyond_the_count_and_when_the_history_is_over_its_room(store: Store) -> None:
    session = await store.session("u", "c")
    objects = session.history.folder / "objects"
    async with session.lock():
        for i in range(5):
            (session.path / "f.txt").write_text(str(i) * 1000)
            saved = await session.history.save(f"m{i}", keep_states=3, keep_kernels=3, room_bytes=None)
        assert [await session.history.has(f"m{i}") for i in range(5)] == [False, False, True, True, True]
        # The versions of the dropped states wait for a collection (one for several drops): counted.
        assert saved.history_bytes == 4000 and len(os.listdir(objects)) == 5
        (session.path / "f.txt").write_text("5" * 1000)
        saved = await session.history.save("m5", keep_states=3, keep_kernels=3, room_bytes=1500)
        # Over its room: collected, and the oldest kept state dropped too; the new one stays.
        assert saved.history_bytes == 1000 and saved.dropped == 2
        assert [await session.history.has(f"m{i}") for i in range(6)] == [False] * 4 + [True, True]
        assert len(os.listdir(objects)) == 2  # m4's version and the folder's own
        await session.history.restore("m4")
        assert (session.path / "f.txt").read_text() == "4" * 1000


async def test_the_imports_of_a_state_come_back_with_it(store: Store) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        await session.history.save("m1", **KEEP)
        path = await session.files.write_new("upload.csv", b"x,y\n", source="open-webui:f1")
        await session.history.save("m2", **KEEP)
        await session.history.restore("m1")
        await session.reconcile(enforce_quotas=False)
        assert await session.files.imported("open-webui:f1") is None  # taken again at the next message
        await session.history.restore("m2")
        assert await session.files.imported("open-webui:f1") == path


async def test_the_history_goes_with_the_session(store: Store) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / "a.txt").write_text("a")
        await session.history.save("m1", **KEEP)
    folder = session.history.folder
    assert folder.is_dir()
    assert (folder.stat().st_mode & 0o777) == 0o700
    from storage import Purge

    await store.cleanup(Purge(user_id="u"))
    assert not folder.exists()


async def test_a_restore_does_not_make_a_state_younger_than_the_ones_saved_after_it(store: Store) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        for i in range(3):
            (session.path / "f.txt").write_text(str(i))
            await session.history.save(f"m{i}", keep_states=3, keep_kernels=3, room_bytes=None)
        await session.history.restore("m0")
        (session.path / "f.txt").write_text("3")
        await session.history.save("m3", keep_states=3, keep_kernels=3, room_bytes=None)
        # m0 is still the oldest, however recently it was restored: it is the one that goes.
        assert [await session.history.has(f"m{i}") for i in range(4)] == [False, True, True, True]


HOSTILE_NAMES = ['"files":{}', 'q"uote', "back\\slash", "é ünï", "tab\tname", "\u202eevil", "emoji 🧪"]


async def test_a_state_written_from_what_the_process_remembers_is_as_written_whole(store: Store) -> None:
    """The next save reuses the JSON of the records it wrote last: the file must be what json.dumps writes
    (names with quotes, backslashes, non-ASCII and the very key it splices at included)."""
    session = await store.session("u", "c")
    async with session.lock():
        for i, name in enumerate(HOSTILE_NAMES):
            (session.path / name).write_text(str(i))
        await session.history.save("m1", **KEEP)
        (session.path / HOSTILE_NAMES[1]).write_text("changed")
        saved = await session.history.save('m2 "files":{}', **KEEP)
        assert saved.copied_files == 1
    for path in (session.history.folder / "states").glob("*.json"):
        text = path.read_text(encoding="ascii")
        assert text == json.dumps(json.loads(text), separators=(",", ":"))
    async with session.lock():
        await session.history.restore("m1")
        assert contents(session.path) == {name: str(i).encode() for i, name in enumerate(HOSTILE_NAMES)}
        await session.history.restore('m2 "files":{}')
        assert (session.path / HOSTILE_NAMES[1]).read_text() == "changed"


async def test_a_state_another_process_rewrote_is_read_again_not_remembered(store: Store) -> None:
    """Another worker saved the same message's state again (a file changed meanwhile): what this process
    remembers of that state is stale, and the next save compares with the file on disk."""
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / "f.txt").write_text("one")
        (session.path / "g.txt").write_text("g")
        await session.history.save("m1", **KEEP)
        (session.path / "f.txt").write_text("two!")
        other = (
            "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1])\n"
            "from storage._history import History\n"
            "h = History(Path(sys.argv[2]), Path(sys.argv[3]), None)\n"
            "print(h.save('m1', [], keep_states=20, keep_kernels=3).copied_files)\n"
        )
        root = str(Path(__file__).resolve().parents[2])
        folder, live = str(session.history.folder), str(session.path)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", other, root, folder, live, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        assert (proc.returncode, out.strip()) == (0, b"1")
        # Stale, "f.txt" would look changed against the remembered "one" and be copied again.
        saved = await session.history.save("m2", **KEEP)
        assert (saved.files, saved.copied_files) == (2, 0)
        await session.history.restore("m1")
        assert (session.path / "f.txt").read_text() == "two!"


async def test_a_users_file_named_like_a_restores_scratch_is_kept_by_every_restore(store: Store) -> None:
    """A restore's temporary copies never take a name the user's code can write: a file that starts
    with `.cs-restore-` is a file like any other, saved with its state and put back with it."""
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / ".cs-restore-mine").write_text("user's")
        (session.path / "sub").mkdir()
        (session.path / "sub" / ".cs-restore-deep").write_text("deep")
        (session.path / "data.txt").write_text("1")
        await session.history.save("m1", **KEEP)
        (session.path / "data.txt").write_text("22")
        await session.history.save("m2", **KEEP)
        await session.history.restore("m1")
        assert contents(session.path) == {
            ".cs-restore-mine": b"user's",
            "sub/.cs-restore-deep": b"deep",
            "data.txt": b"1",
        }
        os.unlink(session.path / ".cs-restore-mine")
        await session.history.restore("m2")
        assert contents(session.path)[".cs-restore-mine"] == b"user's"
        assert sorted(os.listdir(session.path)) == [".cs-restore-mine", "data.txt", "sub"]


async def test_a_file_received_for_a_saved_state_comes_back_with_it_and_never_replaces_one(
    store: Store,
) -> None:
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / "a.txt").write_text("1")
        await session.history.save("m1", **KEEP)
        await session.history.claim("m2")
        (session.path / "b.txt").write_text("2")
        await session.history.save("m2", **KEEP)
        await session.history.restore("m1")
        await session.history.claim("m3")  # another branch, under m1
        assert await session.history.descends("m2", "m1") and await session.history.descends("m3", "m1")
        assert not await session.history.descends("m3", "m2")
        incoming = await session.files.incoming("in/up.bin")
        await incoming.write(b"uploaded")
        assert await session.history.receive("m2", incoming) == "in/up.bin"
        assert contents(session.path) == {"a.txt": b"1"}  # the branch the folder holds is left alone
        assert "in/up.bin" not in [e.path for e in await session.files.list()]  # nor its index
        again = await session.files.incoming("b.txt")
        await again.write(b"other")
        with pytest.raises(FileExists, match="never replaces"):
            await session.history.receive("m2", again)
        await session.history.save("m3", **KEEP)
        await session.history.restore("m2")
        assert contents(session.path) == {"a.txt": b"1", "b.txt": b"2", "in/up.bin": b"uploaded"}
    assert os.listdir(store.root / "incoming") == []


async def charges(store: Store, user: str) -> dict[str, int]:
    """What each chat's states take beyond its folder's files: the versions kept on disk that the
    folder does not hold (measured on disk, not as the history counts it)."""
    found = {}
    for info in await store.sessions(user):
        session = await store.session(user, info.chat_id)
        objects = sum(p.stat().st_size for p in (session.history.folder / "objects").glob("*"))
        live = sum(p.stat().st_size for p in session.path.rglob("*") if p.is_file())
        found[session.chat_key] = max(0, objects - live)
    return found


async def test_the_states_of_all_of_a_users_chats_fit_in_one_room_oldest_first(store: Store) -> None:
    """The room is what the user's storage limit leaves after their files, for all their chats at
    once: a chat's save sheds the oldest states of the user's other chats before its own newer ones.
    Another user's states, and a chat busy with a step, are left alone."""
    room = 5000
    stranger = await store.session("v", "c")
    async with stranger.lock():
        for i in range(4):
            (stranger.path / "f.txt").write_text(str(i) * 1000)
            await stranger.history.save(f"s{i}", keep_states=20, keep_kernels=3, room_bytes=room)
    sessions = [await store.session("u", f"c{n}") for n in range(3)]
    for n, session in enumerate(sessions):
        async with session.lock():
            for i in range(4):
                (session.path / "f.txt").write_text(str(i) * 1000)
                await session.history.save(f"c{n}m{i}", keep_states=20, keep_kernels=3, room_bytes=room)
    mine = await charges(store, "u")
    assert sum(mine.values()) <= room, mine
    # The oldest went first: the first chat's states, before any of the last chat's.
    async with sessions[0].lock():
        assert not await sessions[0].history.has("c0m0")
    async with sessions[2].lock():
        assert [await sessions[2].history.has(f"c2m{i}") for i in range(4)] == [True] * 4
    assert sum((await charges(store, "v")).values()) == 3000  # its own three old versions, kept
    # A chat busy with a step keeps its states until its own next save.
    busy = store._core.backend.chat_lock(sessions[1].user_key, sessions[1].chat_key)
    assert await busy.try_acquire()
    try:
        before = (await charges(store, "u"))[sessions[1].chat_key]
        async with sessions[2].lock():
            for i in range(4, 8):
                (sessions[2].path / "f.txt").write_text(str(i) * 1000)
                await sessions[2].history.save(f"c2m{i}", keep_states=20, keep_kernels=3, room_bytes=room)
        assert (await charges(store, "u"))[sessions[1].chat_key] == before
    finally:
        await busy.release()


async def test_what_goes_wrong_with_the_history_is_a_storage_error(store: Store) -> None:
    """One exception tree: a state that cannot be kept is a HistoryError, which is a StorageError, and
    the disk's own errors under the history (here its folder replaced by a file) are StorageErrors too,
    never a raw OSError."""
    assert issubclass(HistoryError, StorageError)
    session = await store.session("u", "c")
    async with session.lock():
        (session.path / "a.txt").write_text("a")
        await session.history.save("m1", **KEEP)
        folder = session.history.folder
        shutil.rmtree(folder)
        folder.write_text("not a folder")
        for attempt in (
            session.history.claim("m2"),
            session.history.save("m2", **KEEP),
            session.history.kernel_dir("m2"),
        ):
            with pytest.raises(StorageError) as caught:
                await attempt
            assert not isinstance(caught.value, OSError)
