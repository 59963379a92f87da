"""Kernels saved to disk instead of stopped, and resumed by the next run, in real gVisor.

Each test drives a KernelPool as the engine does (one key per chat, a state folder per chat outside
its /mnt/data) against real runsc, and checks what a user would see: the state back with no sentence,
or the one sentence that says it was lost and why; and the host (no sandbox left of a saved kernel).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner import KernelPool, KernelSettings, Limits, Outcome, Runner, _hibernate
from tests.support.figure_cells import SURFACE
from tests.support.sandbox import leftovers

pytestmark = pytest.mark.runsc

REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits(timeout_s=20, memory_mb=512, max_output_bytes=64 * 1024)


@pytest.fixture
def chat(tmp_path: Path) -> tuple[Path, Path]:
    """(the chat's folder, its state folder): siblings, as the store lays them out."""
    folder, state = tmp_path / "sessions" / "chat", tmp_path / "state" / "chat.kernel"
    folder.mkdir(parents=True)
    return folder, state


def pool_of(runner: Runner, tmp_path: Path, *, warm_start: bool = False, **settings) -> KernelPool:
    kept = KernelSettings(**settings)
    return KernelPool(runner, tmp_path / "registry", settings=kept, warm_start=warm_start)


def gone(runner: Runner, cid: str) -> list[str]:
    return leftovers(cid, runner.state_dir, runner.bundle_dir, runner.config.cgroup_parent)


def ended(pool: KernelPool, key: str = "u/c") -> bool:
    """The key's kernel has ended (saved or not) and its registry entry says so."""
    entry = pool._registry.get(key)
    return key not in pool.kernels() and entry is not None and not entry.running


async def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def reset_said(pool: KernelPool, folder: Path, state: Path | None, why: str) -> None:
    """The chat's next run has a new kernel (no `kept`) and says why, in the one sentence."""
    result = await pool.run("u/c", folder, "print(globals().get('kept'))", "python", LIMITS, state_dir=state)
    assert result.stdout == "None\n"
    assert result.notes == (f"The Python state was reset ({why}); files in /mnt/data are kept.",)


async def template_built(pool: KernelPool, tmp_path: Path) -> None:
    """A first chat's cold kernel builds the kernel template (in the background): wait until it is."""
    first = tmp_path / "sessions" / "first"
    first.mkdir(parents=True)
    await pool.run("u/first", first, "print(1)", "python", LIMITS, state_dir=tmp_path / "state" / "first")
    await pool._warm.wait_built()


async def test_an_idle_kernel_is_saved_and_the_next_run_resumes_it(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, state = chat
    pool = pool_of(runner, tmp_path, idle_s=1.0)
    try:
        first = await pool.run(
            "u/c",
            folder,
            "import random\nkept = {'n': 41}\nfh = open('log.txt', 'w')\nfh.write('a'); fh.flush()",
            "python",
            LIMITS,
            state_dir=state,
        )
        assert first.ok, first
        cid = first.container_id
        await wait_until(lambda: ended(pool))
        assert gone(runner, cid) == []  # nothing of the sandbox is left: the state is on disk only
        assert (state / "kernel" / "meta.json").is_file()
        second = await pool.run(
            "u/c",
            folder,
            "kept['n'] += 1\nfh.write('b'); fh.flush()\nprint(kept)",
            "python",
            LIMITS,
            state_dir=state,
        )
        assert second.ok and second.stdout == "{'n': 42}\n" and second.notes == ()
        assert second.container_id != cid
        # The file the saved kernel had open still writes into the chat's folder.
        assert (folder / "log.txt").read_text() == "ab"
        assert not (state / "kernel").exists()  # resumed: the image is behind the live state, so it went
        # What the resumed kernel's first run changed is not known from its watch alone: all is listed.
        assert second.changed is None
        third = await pool.run("u/c", folder, "open('x.txt', 'w').close()", "python", LIMITS, state_dir=state)
        assert third.changed == ("x.txt",)
    finally:
        await pool.close()


async def test_a_resumed_kernel_starts_each_cell_with_no_figure_as_a_live_one_does(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    """Figures are closed at the end of each cell, before the kernel can be saved: after a resume the
    next plot is a new figure, and a Figure kept in a variable still saves."""
    folder, state = chat
    pool = pool_of(runner, tmp_path, idle_s=1.0)
    try:
        first = await pool.run("u/c", folder, SURFACE, "python", LIMITS, state_dir=state)
        assert first.ok and first.figures == ("figure-1.png",), first
        await wait_until(lambda: ended(pool))
        assert (state / "kernel" / "meta.json").is_file()
        bars = (
            "plt.bar(['a', 'b'], [3, 5])\nfig.savefig('surface.png')\nprint(plt.gca().name, plt.gcf() is fig)"
        )
        second = await pool.run("u/c", folder, bars, "python", LIMITS, state_dir=state)
        assert second.ok and second.notes == () and second.container_id != first.container_id, second
        assert second.stdout == "rectilinear False\n" and second.figures == ("figure-2.png",), second
        assert (folder / "surface.png").read_bytes()[:4] == b"\x89PNG"
    finally:
        await pool.close()


async def test_the_least_recently_used_kernel_is_saved_not_killed(runner: Runner, tmp_path: Path) -> None:
    pool = pool_of(runner, tmp_path, max_kernels=1)
    chats = {}
    for name in ("a", "b"):
        folder = tmp_path / "sessions" / name
        folder.mkdir(parents=True)
        chats[name] = (folder, tmp_path / "state" / f"{name}.kernel")
    try:
        for turn in range(2):
            for name, (folder, state) in chats.items():
                code = f"v = '{name}'" if turn == 0 else "print(v)"
                result = await pool.run(name, folder, code, "python", LIMITS, state_dir=state)
                assert result.ok and result.notes == (), result
                if turn == 1:
                    assert result.stdout == f"{name}\n"
                assert len(pool.kernels()) == 1
    finally:
        await pool.close()


async def test_closing_the_pool_saves_its_kernels_for_the_next_process(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, state = chat
    pool = pool_of(runner, tmp_path)
    await pool.run(
        "u/c", folder, "import numpy as np\narr = np.arange(10)", "python", LIMITS, state_dir=state
    )
    await pool.close()
    later = pool_of(runner, tmp_path)  # the next Open WebUI process
    try:
        result = await later.run("u/c", folder, "print(int(arr.sum()))", "python", LIMITS, state_dir=state)
        assert result.ok and result.stdout == "45\n" and result.notes == ()
    finally:
        await later.close()


async def test_without_a_state_folder_the_state_is_lost_and_said(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, _ = chat
    pool = pool_of(runner, tmp_path, idle_s=1.0)
    try:
        await pool.run("u/c", folder, "kept = 1", "python", LIMITS)
        await wait_until(lambda: ended(pool))
        await reset_said(pool, folder, None, "it was idle for more than 0.0166667 minutes")
    finally:
        await pool.close()


async def _saved(pool: KernelPool, folder: Path, state: Path) -> None:
    first = await pool.run("u/c", folder, "kept = 7", "python", LIMITS, state_dir=state)
    assert first.ok
    await pool.close()
    assert (state / "kernel" / "meta.json").is_file()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "swapped", "meta", "foreign"])
async def test_a_damaged_or_foreign_image_is_a_lost_state_said_in_a_sentence(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path], damage: str
) -> None:
    """Each saved image is compressed (zstd): damage to the compressed files, one swapped for another
    image's (its recorded size made to match, so that only the digest tells), a broken record or
    another sandbox's image is refused with the sentence, and the chat goes on in a new kernel."""
    folder, state = chat
    await _saved(pool_of(runner, tmp_path), folder, state)
    image = state / "kernel"
    assert json.loads((image / "meta.json").read_text())["codec"] == "zstd"
    big = max((p for p in image.iterdir() if p.name != "meta.json"), key=lambda p: p.stat().st_size)
    assert big.name == "pages.img.zst"
    if damage == "swapped":  # another chat's valid image file in its place
        other_folder, other_state = tmp_path / "sessions" / "other", tmp_path / "state" / "other.kernel"
        other_folder.mkdir(parents=True)
        other = pool_of(runner, tmp_path / "other")
        assert (await other.run("u/o", other_folder, "kept = 8", "python", LIMITS, state_dir=other_state)).ok
        await other.close()
        shutil.copyfile(other_state / "kernel" / big.name, big)
        meta = json.loads((image / "meta.json").read_text())
        meta["files"][big.name][0] = big.stat().st_size
        (image / "meta.json").write_text(json.dumps(meta))
    elif damage == "truncated":
        os.truncate(big, big.stat().st_size // 2)
    elif damage == "flipped":
        with open(big, "r+b") as fh:
            fh.seek(big.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "meta":
        (image / "meta.json").write_bytes(b"\x00not json")
    else:  # saved by another runsc: its identity says so
        meta = json.loads((image / "meta.json").read_text())
        meta["identity"]["runsc"] = "0.0~19990101.0"
        (image / "meta.json").write_text(json.dumps(meta))
    pool = pool_of(runner, tmp_path)
    try:
        started = time.monotonic()
        result = await pool.run(
            "u/c", folder, "print(globals().get('kept'))", "python", LIMITS, state_dir=state
        )
        assert time.monotonic() - started < 20
        assert result.ok and result.stdout == "None\n"
        assert len(result.notes) == 1 and result.notes[0].startswith("The Python state was reset (")
        expected = {
            "truncated": "damaged",
            "flipped": "damaged",
            "swapped": "damaged",
            "meta": "cannot be read",
            "foreign": "saved by another sandbox: runsc",
        }[damage]
        assert expected in result.notes[0]
        assert not image.exists()
        again = await pool.run("u/c", folder, "print(1)", "python", LIMITS, state_dir=state)
        assert again.notes == ()
    finally:
        await pool.close()


async def test_a_saved_image_is_compressed_and_one_saved_uncompressed_still_resumes(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saved kernel takes a fraction of what runsc wrote; an image kept as runsc wrote it (saved
    before images were compressed, or where no zstd is installed) resumes as it did; and a compressed
    image where zstd is missing is a lost state said in a sentence, not an error."""
    folder, state = chat
    await _saved(pool_of(runner, tmp_path), folder, state)
    meta = json.loads((state / "kernel" / "meta.json").read_text())
    on_disk = sum(size for size, _ in meta["files"].values())
    assert meta["format"] == 2 and set(meta["unpacked"]) == {"checkpoint.img", "pages.img", "pages_meta.img"}
    assert on_disk < sum(meta["unpacked"].values()) / 2, meta
    assert on_disk == _hibernate.size_of(state) - (state / "kernel" / "meta.json").stat().st_size

    # Memory of random bytes hardly compresses: its pages are kept as runsc wrote them (unpacking
    # them at every resume would cost time for little disk), the rest compressed; it resumes whole.
    noisy_folder, noisy_state = tmp_path / "sessions" / "noisy", tmp_path / "state" / "noisy.kernel"
    noisy_folder.mkdir(parents=True)
    pool = pool_of(runner, tmp_path)
    try:
        code = "import os, hashlib\nblob = os.urandom(16 << 20)\nseal = hashlib.sha256(blob).hexdigest()"
        assert (await pool.run("u/n", noisy_folder, code, "python", LIMITS, state_dir=noisy_state)).ok
        assert await pool.hibernate("u/n") is None
        noisy = json.loads((noisy_state / "kernel" / "meta.json").read_text())
        assert "pages.img" in noisy["files"] and "pages.img" not in noisy["unpacked"], noisy
        assert "checkpoint.img.zst" in noisy["files"] and "checkpoint.img" in noisy["unpacked"]
        check = "print(hashlib.sha256(blob).hexdigest() == seal, len(blob))"
        back = await pool.run("u/n", noisy_folder, check, "python", LIMITS, state_dir=noisy_state)
        assert back.stdout == f"True {16 << 20}\n" and back.notes == (), back
    finally:
        await pool.close()

    monkeypatch.setattr(_hibernate, "zstd_command", lambda: None)
    pool = pool_of(runner, tmp_path)
    try:
        why = "its saved image is compressed, and zstd is not installed here, which unpacking it needs"
        await reset_said(pool, folder, state, why)
        # Saved without zstd: runsc's files as they are (format 1), and resumed so.
        assert (await pool.run("u/c", folder, "kept = 9", "python", LIMITS, state_dir=state)).ok
    finally:
        await pool.close()
    meta = json.loads((state / "kernel" / "meta.json").read_text())
    assert meta["format"] == 1 and "codec" not in meta and "pages.img" in meta["files"]
    monkeypatch.undo()
    pool = pool_of(runner, tmp_path)
    try:
        back = await pool.run("u/c", folder, "print(kept)", "python", LIMITS, state_dir=state)
        assert back.stdout == "9\n" and back.notes == ()
    finally:
        await pool.close()


DATA = "import pandas as pd\ndf = pd.DataFrame({'a': range(1000)})\nkept = 7"


async def test_a_kernel_from_the_template_is_stored_against_its_pages(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    """A chat that started from the template keeps only the pages that differ from the template's
    (with a copy of those beside the registry): a fraction of the zstd image, resumed whole, saved
    so again after its resume, and still resumed once the host's template is rebuilt (from the copy)."""
    folder, state = chat
    pool = pool_of(runner, tmp_path, warm_start=True)
    try:
        await template_built(pool, tmp_path)
        for turn in range(2):
            code = DATA if turn == 0 else "df['b'] = df.a * 2\nprint(int(df.b.sum()), kept)"
            done = await pool.run("u/c", folder, code, "python", LIMITS, state_dir=state)
            assert done.ok and done.notes == (), done
            assert await pool.hibernate("u/c") is None
            meta = json.loads((state / "kernel" / "meta.json").read_text())
            assert set(meta["based"]["files"]) == {"pages.img"} and "pages.img.delta.zst" in meta["files"]
            assert meta["files"]["pages.img.delta.zst"][0] < meta["unpacked"]["pages.img"] / 8, meta
            base = tmp_path / "registry" / "bases" / f"{meta['based']['digest']}.img"
            assert base.stat().st_size == meta["based"]["size"]
        # The host's template is rebuilt (its environment changed back and forth): the copy serves.
        _hibernate.discard(pool._warm.pages(await pool._image_identity(LIMITS)).parent.parent)
        back = await pool.run(
            "u/c", folder, "print(int(df.b.sum()), kept)", "python", LIMITS, state_dir=state
        )
        assert back.stdout == "999000 7\n" and back.notes == (), back
    finally:
        await pool.close()


@pytest.mark.parametrize("loss", ["gone", "changed"])
async def test_an_image_whose_template_pages_are_gone_or_changed_is_a_lost_state_said(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path], loss: str
) -> None:
    folder, state = chat
    pool = pool_of(runner, tmp_path, warm_start=True)
    try:
        await template_built(pool, tmp_path)
        assert (await pool.run("u/c", folder, DATA, "python", LIMITS, state_dir=state)).ok
        assert await pool.hibernate("u/c") is None
    finally:
        await pool.close()
    meta = json.loads((state / "kernel" / "meta.json").read_text())
    base = tmp_path / "registry" / "bases" / f"{meta['based']['digest']}.img"
    template = pool._warm.pages(await pool._image_identity(LIMITS)).parent.parent
    _hibernate.discard(template)
    if loss == "gone":
        base.unlink()
    else:  # one byte of the copy changed (its name is its digest: no longer its bytes)
        with open(base, "r+b") as fh:
            fh.seek(base.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
    later = pool_of(runner, tmp_path)
    try:
        why = (
            "its saved image was stored against the pages of the kernel template it started from, "
            "and those are gone or changed"
        )
        await reset_said(later, folder, state, why)
    finally:
        await later.close()


async def test_an_image_runsc_cannot_restore_is_a_lost_state_not_a_hang(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    """Damage the digest check cannot see (the meta rewritten to match garbage, compressed as a saved
    image is, so that it unpacks): runsc itself refuses."""
    folder, state = chat
    await _saved(pool_of(runner, tmp_path), folder, state)
    image = state / "kernel"
    meta = json.loads((image / "meta.json").read_text())
    assert meta["codec"] == "zstd"
    for item in image.iterdir():
        if item.name != "meta.json":
            raw = item.with_suffix("")  # pages.img.zst -> pages.img
            raw.write_bytes(os.urandom(4096))
            item.unlink()
            subprocess.run(["zstd", "-q", "--rm", str(raw)], check=True)
            meta["unpacked"][raw.name] = 4096
    meta["files"] = _hibernate.image_files(image)
    (image / "meta.json").write_text(json.dumps(meta))
    pool = pool_of(runner, tmp_path)
    try:
        started = time.monotonic()
        result = await pool.run(
            "u/c", folder, "print(globals().get('kept'))", "python", LIMITS, state_dir=state
        )
        assert time.monotonic() - started < 40
        assert result.ok and result.stdout == "None\n"
        assert len(result.notes) == 1 and "its saved image could not be restored" in result.notes[0], (
            result.notes
        )
    finally:
        await pool.close()


async def test_a_state_over_the_image_limit_is_not_kept_and_said(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, state = chat
    pool = pool_of(runner, tmp_path, idle_s=1.0, max_image_bytes=1024 * 1024)
    try:
        await pool.run(
            "u/c", folder, "blob = bytearray(range(256)) * 40000", "python", LIMITS, state_dir=state
        )
        await wait_until(lambda: ended(pool))
        result = await pool.run(
            "u/c", folder, "print(globals().get('blob') is None)", "python", LIMITS, state_dir=state
        )
        assert result.stdout == "True\n"
        assert len(result.notes) == 1, result.notes
        note = result.notes[0]
        assert note.startswith("The Python state could not be kept (its image of ")
        assert note.endswith("is over the 1 MiB allowed for a saved state); files in /mnt/data are kept.")
        assert not (state / "kernel").exists()
    finally:
        await pool.close()


async def test_two_chats_of_one_user_cannot_pass_the_users_budget_for_saved_states(
    runner: Runner, tmp_path: Path
) -> None:
    """Each image is under the per-image limit; together they are not: the first chat's state is
    kept, the second's is not and says why, and another user's chat beside them is still saved."""
    folders = {}
    for user, name in (("u", "a"), ("u", "b"), ("v", "c")):
        folder = tmp_path / "sessions" / user / name
        folder.mkdir(parents=True)
        folders[f"{user}/{name}"] = (folder, tmp_path / "state" / user / f"{name}.kernel")
    pool = pool_of(runner, tmp_path, idle_s=1.0)
    settings = pool.defaults  # what each run brings
    try:
        for key in folders:  # a kernel per chat, each saved once idle
            folder, state = folders[key]
            await pool.run(key, folder, "kept = 7", "python", LIMITS, state_dir=state, settings=settings)
            await wait_until(lambda key=key: ended(pool, key))
            if key == "u/a":  # the user's budget: what the first image takes, and a little more
                first = _hibernate.saved_bytes_beside(folders["u/a"][1])
                assert first > 0
                settings = KernelSettings(idle_s=1.0, max_saved_bytes_together=first + first // 2)
        said = {}
        for key, (folder, state) in folders.items():
            read = "print(globals().get('kept'))"
            got = await pool.run(key, folder, read, "python", LIMITS, state_dir=state, settings=settings)
            said[key] = (got.stdout, got.notes)
        assert said["u/a"] == ("7\n", ())
        assert said["v/c"] == ("7\n", ())  # another user's states do not count
        stdout, notes = said["u/b"]
        assert stdout == "None\n" and len(notes) == 1, said
        assert notes[0].startswith("The Python state could not be kept (with its image of ")
        assert "this user's saved states would take" in notes[0] and "allowed together" in notes[0]
    finally:
        await pool.close()


async def test_limits_hold_in_a_resumed_kernel(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    """The resumed sandbox is in its own new cgroup with the memory limit, and the time limit holds."""
    folder, state = chat
    limits = LIMITS.model_copy(update={"memory_mb": 256, "timeout_s": 3})
    await _saved_with(pool_of(runner, tmp_path), folder, state, limits)
    pool = pool_of(runner, tmp_path)
    try:
        slow = await pool.run("u/c", folder, "import time\ntime.sleep(60)", "python", limits, state_dir=state)
        assert slow.notes == () and slow.outcome == Outcome.TIMEOUT and slow.state_kept
        hog = await pool.run(
            "u/c",
            folder,
            "x = bytearray(600 * 1024 * 1024)\nx[::4096] = b'1' * len(x[::4096])",
            "python",
            limits,
            state_dir=state,
        )
        assert hog.outcome == Outcome.OOM, hog
    finally:
        await pool.close()


async def _saved_with(pool: KernelPool, folder: Path, state: Path, limits: Limits) -> None:
    assert (await pool.run("u/c", folder, "kept = 7", "python", limits, state_dir=state)).ok
    await pool.close()
    assert (state / "kernel" / "meta.json").is_file()


async def test_a_crash_loses_the_state_with_the_sentence_and_no_old_image_comes_back(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    """A kernel resumed and then lost without a save (its process SIGKILLed) must not come back as the
    older image: that would be a silent step back in time."""
    folder, state = chat
    await _saved(pool_of(runner, tmp_path), folder, state)
    pool = pool_of(runner, tmp_path)
    resumed = await pool.run("u/c", folder, "kept = 8", "python", LIMITS, state_dir=state)
    assert resumed.ok and resumed.notes == ()
    # A crash of its process: the sandbox goes; nothing is saved; the registry still says "running".
    kernel = pool.kernels()["u/c"]
    os.killpg(kernel._proc.pid, 9)
    await kernel._proc.wait()
    pool._chats.clear()
    await kernel.close()
    fresh = pool_of(runner, tmp_path)
    fresh._owner = "1 0"  # another process, as after a restart
    try:
        # the dead owner's entry says running: a crash. A stale image is not there to resume either.
        entry = fresh._registry.get("u/c")
        entry.owner = "1 0"
        fresh._registry.save(entry)
        await reset_said(fresh, folder, state, "Open WebUI restarted")
    finally:
        await fresh.close()
        await pool.close()


EXITING_WORKER = """
import asyncio, sys
from pathlib import Path
from runner import KernelPool, Limits, Runner, RunnerConfig

config = RunnerConfig(runsc_path=sys.argv[1], state_dir=Path(sys.argv[2]), bundle_dir=Path(sys.argv[3]))
pool = KernelPool(Runner(config), Path(sys.argv[4]))
limits = Limits(timeout_s=20, memory_mb=512)

async def main():
    result = await pool.run("u/c", Path(sys.argv[5]), "kept = 'from the first process'", "python", limits,
                            state_dir=Path(sys.argv[6]))
    assert result.ok, result
    print("ran", flush=True)

asyncio.run(main())  # the loop ends with the kernel alive, as uvicorn's does at a restart
"""


async def test_a_process_that_exits_saves_its_idle_kernels(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, state = chat
    config = runner.config
    done = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        EXITING_WORKER,
        config.runsc_path,
        str(runner.state_dir),
        str(runner.bundle_dir),
        str(tmp_path / "registry"),
        str(folder),
        str(state),
        cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(done.communicate(), 120)
    assert done.returncode == 0 and out == b"ran\n", err.decode()[-2000:]
    assert (state / "kernel" / "meta.json").is_file()
    pool = pool_of(runner, tmp_path)
    try:
        result = await pool.run("u/c", folder, "print(kept)", "python", LIMITS, state_dir=state)
        assert result.ok and result.stdout == "from the first process\n" and result.notes == ()
    finally:
        await pool.close()


async def test_a_new_chat_starts_warm_from_a_template_without_its_seeds_or_names(
    runner: Runner, tmp_path: Path
) -> None:
    """The first chat builds the template (in the background); later chats resume it: pandas is
    already imported (not bound), each chat has its own folder and its own random draws."""
    pool = pool_of(runner, tmp_path, warm_start=True)
    try:
        first_folder = tmp_path / "sessions" / "first"
        first_folder.mkdir(parents=True)
        first = await pool.run("first", first_folder, "print(1)", "python", LIMITS)
        assert first.ok
        await pool._warm.wait_built()
        draws = set()
        probe = (
            "import sys, os, random\n"
            "print('pandas' in sys.modules, 'pandas' in globals(), os.listdir('.'))\n"
            "import numpy\n"
            "print(random.random(), numpy.random.random())\n"
            "open('mine.txt', 'w').write('x')"
        )
        for name in ("a", "b"):
            folder = tmp_path / "sessions" / name
            folder.mkdir(parents=True)
            (folder / f"{name}.csv").write_text("x,y\n1,2\n")
            result = await pool.run(name, folder, probe, "python", LIMITS)
            assert result.ok and result.notes == (), result
            loaded, bound = result.stdout.splitlines()[0], result.stdout.splitlines()[1]
            assert loaded == f"True False ['{name}.csv']"
            draws.add(bound)
            assert (folder / "mine.txt").read_text() == "x"
            assert result.changed is None  # a resumed kernel's first run lists the whole folder
        assert len(draws) == 2  # reseeded: two chats never share a random sequence
    finally:
        await pool.close()


async def test_only_a_first_cell_that_needs_more_than_the_standard_library_starts_warm(
    runner: Runner, tmp_path: Path
) -> None:
    """A chat whose first cell is print(1) gets a cold kernel (faster to start, 110 MiB lighter); one
    whose first cell imports a package of the environment, or is bash, resumes the template."""
    pool = pool_of(runner, tmp_path, warm_start=True)
    loaded = "import sys\nprint('pandas' in sys.modules)"
    try:
        first = tmp_path / "sessions" / "first"
        first.mkdir(parents=True)
        assert (await pool.run("first", first, "print(1)", "python", LIMITS)).ok  # cold: builds it
        await pool._warm.wait_built()
        said = {}
        for name, cell, language in (
            ("plain", "print(1)", "python"),
            ("stdlib", "import json, os.path\nprint(json.dumps(os.path.sep))", "python"),
            ("data", "import numpy as np\nprint(int(np.arange(3).sum()))", "python"),
            ("shell", "ls -la /mnt/data | head -1", "bash"),
        ):
            folder = tmp_path / "sessions" / name
            folder.mkdir(parents=True)
            assert (
                await pool.run(name, folder, cell, "python" if language == "python" else "bash", LIMITS)
            ).ok
            said[name] = (await pool.run(name, folder, loaded, "python", LIMITS)).stdout
        assert said == {"plain": "False\n", "stdlib": "False\n", "data": "True\n", "shell": "True\n"}
    finally:
        await pool.close()


async def test_a_template_changed_after_it_was_verified_is_checked_again_and_refused(
    runner: Runner, tmp_path: Path
) -> None:
    """A process verifies a template's digests once and skips them while its files are unchanged: a
    byte flipped in it later (its file rewritten) is caught at the next warm start, the template is
    removed, and the new chat starts cold without a word."""
    pool = pool_of(runner, tmp_path, warm_start=True)
    probe = "import sys, numpy\nprint('pandas' in sys.modules)"
    try:
        folders = {}
        for name in ("first", "verified", "after"):
            folders[name] = tmp_path / "sessions" / name
            folders[name].mkdir(parents=True)
        assert (await pool.run("first", folders["first"], "print(1)", "python", LIMITS)).ok
        await pool._warm.wait_built()
        warm = await pool.run("verified", folders["verified"], probe, "python", LIMITS)
        assert warm.stdout == "True\n" and warm.notes == ()  # resumed from the template, verified
        [place] = [p for p in (runner.bundle_dir / "templates").iterdir() if p.is_dir()]
        image = place / "kernel"
        pages = max((p for p in image.iterdir() if p.name != "meta.json"), key=lambda p: p.stat().st_size)
        with open(pages, "r+b") as fh:
            fh.seek(pages.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
        cold = await pool.run("after", folders["after"], probe, "python", LIMITS)
        assert cold.ok and cold.stdout == "False\n" and cold.notes == ()  # a cold kernel, no sentence
        assert not image.exists()  # removed (the next new chat builds it again)
    finally:
        await pool.close()


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of `size` at `path` (ENOSPC for real), unmounted afterwards whatever happened."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


async def test_a_state_the_full_disk_cannot_hold_is_not_kept_and_said(runner: Runner, tmp_path: Path) -> None:
    """The states' disk has 4 MiB left and the kernel holds 20 MB: the save fails, the next run says
    so in the one sentence, nothing half-written is left to resume, and the chat goes on."""
    folder = tmp_path / "sessions" / "chat"
    folder.mkdir(parents=True)
    with small_disk(tmp_path / "states", "4m") as disk:
        state = disk / "chat.kernel"
        pool = pool_of(runner, tmp_path, idle_s=1.0)
        try:
            blob = "blob = bytes(range(256)) * 80_000\nkept = 1"
            assert (await pool.run("u/c", folder, blob, "python", LIMITS, state_dir=state)).ok
            await wait_until(lambda: ended(pool), 60)
            stay = KernelSettings(idle_s=3600)  # the next kernel stays up for the last run
            result = await pool.run(
                "u/c",
                folder,
                "print(globals().get('kept'))",
                "python",
                LIMITS,
                state_dir=state,
                settings=stay,
            )
            assert result.ok and result.stdout == "None\n"
            assert result.notes == (
                "The Python state could not be kept (its image could not be written: the disk is full); "
                "files in /mnt/data are kept.",
            )
            assert not (state / "kernel").exists() and list(state.iterdir()) == []  # no half image
            assert shutil.disk_usage(disk).used < 1 << 20  # its bytes are given back
            again = await pool.run("u/c", folder, "print(2)", "python", LIMITS, state_dir=state)
            assert again.stdout == "2\n" and again.notes == ()
        finally:
            await pool.close()


REFUSING_RUNSC = """#!/bin/sh
# runsc, except that it refuses to checkpoint (as a runsc without that support, or a broken one, does).
case " $* " in
  *" help "*) ;;
  *" checkpoint "*) echo "checkpoint is not supported by this runsc (test)" >&2; exit 3 ;;
esac
exec {runsc} "$@"
"""


async def test_a_state_runsc_refuses_to_save_is_not_kept_and_said(
    runner: Runner, tmp_path: Path, chat: tuple[Path, Path]
) -> None:
    folder, state = chat
    wrapper = tmp_path / "runsc"
    wrapper.write_text(REFUSING_RUNSC.format(runsc=shutil.which(runner.config.runsc_path) or "runsc"))
    wrapper.chmod(0o755)
    refusing = Runner(runner.config.model_copy(update={"runsc_path": str(wrapper)}))
    pool = pool_of(refusing, tmp_path, idle_s=1.0)
    try:
        assert (await pool.run("u/c", folder, "kept = 1", "python", LIMITS, state_dir=state)).ok
        cid = pool.kernels()["u/c"].cid
        await wait_until(lambda: ended(pool))
        assert gone(refusing, cid) == []  # stopped all the same: a half-saved sandbox is not trusted
        result = await pool.run(
            "u/c", folder, "print(globals().get('kept'))", "python", LIMITS, state_dir=state
        )
        assert result.ok and result.stdout == "None\n"
        assert result.notes == (
            "The Python state could not be kept (checkpoint is not supported by this runsc (test)); "
            "files in /mnt/data are kept.",
        )
        assert not state.exists() or list(state.iterdir()) == []
    finally:
        await pool.close()
