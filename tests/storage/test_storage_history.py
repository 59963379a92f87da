"""A chat folder's history by message (session.history): states saved at the end of answers and put
back when the conversation branches, on both index backends, with hostile things in the folder."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import sys
from pathlib import Path

import pytest

from storage import HistoryError, Store

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
            "print(h.save('m1', [], keep_states=20, keep_kernels=3, room_bytes=None).copied_files)\n"
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
