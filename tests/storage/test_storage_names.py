"""Keys from hostile ids, path validation, and the names we make up."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

from storage import InvalidPath, Store
from storage._keys import id_key
from storage._names import attachment_name, numbered, publish_name, split_path
from tests.storage.storage_helpers import stored_id

HOSTILE = [
    "../x",
    "/",
    ".",
    "..",
    "a\x00b",
    "x" * 512,  # the longest id the index keeps (longer ones are refused: test_storage_hostile)
    "admin",
    "\u0430dmin",  # Cyrillic a
    unicodedata.normalize("NFC", "caf\u00e9"),
    unicodedata.normalize("NFD", "caf\u00e9"),
    "",
    "-rf",
    "a/b/../../c",
    "\ud800",  # lone surrogate
    "日本語",
]


def test_keys_are_safe_bounded_and_distinct() -> None:
    keys = [id_key(v) for v in [*HOSTILE, "x" * 10240]]
    assert len(set(keys)) == len(keys)
    for key in keys:
        assert 0 < len(key) <= 57
        assert all(c.isascii() and (c.isalnum() or c in "_-") for c in key)
        assert key not in (".", "..") and not key.startswith("-")
    assert id_key("").startswith("empty-")
    assert id_key("admin") == id_key("admin")  # stable


async def test_hostile_ids_map_inside_root_and_round_trip(
    store: Store, root: Path, database_url: str
) -> None:
    sessions_root = (root / "sessions").resolve()
    paths = set()
    for user in HOSTILE:
        session = await store.session(user, HOSTILE[0] if user else "chat")
        resolved = session.path.resolve()
        assert resolved.is_relative_to(sessions_root)
        assert resolved.parent.parent == sessions_root
        assert session.path.is_dir()
        paths.add(resolved)
    for chat in HOSTILE:
        session = await store.session("u", chat)
        assert session.path.resolve().is_relative_to(sessions_root)
        paths.add(session.path.resolve())
    assert len(paths) == 2 * len(HOSTILE) - 0
    # Exact ids come back from the index, except the lone surrogate, which SQLite cannot hold, and on
    # PostgreSQL NUL, which its text cannot hold (shown as `\\x00`); rows are found by key either way.
    listed = {(s.user_id, s.chat_id) for s in await store.sessions()}
    for user in HOSTILE:
        if user != "\ud800":
            assert (stored_id(user, database_url), HOSTILE[0] if user else "chat") in listed
    # Nothing was created outside the root.
    assert not (root.parent / "x").exists()


@pytest.mark.parametrize(
    "bad",
    ["", "/etc/passwd", "../x", "a/../b", "a//b", "a/", "a\x00b", ".", "./.", "x" * 300, "a/" * 40 + "b"],
)
def test_invalid_paths_are_refused(bad: str) -> None:
    with pytest.raises(InvalidPath):
        split_path(bad)


def test_paths_are_normalised() -> None:
    assert split_path("./a/./b.txt") == ("a", "b.txt")
    assert split_path("dir\\name") == ("dir\\name",)


def test_attachment_names() -> None:
    assert attachment_name("C:\\Users\\me\\a.csv") == "a.csv"
    assert attachment_name("../../etc/passwd") == "passwd"
    assert attachment_name("..") == "file"
    assert attachment_name(".bashrc") == "_bashrc"
    assert attachment_name("a\nb.txt") == "a_b.txt"
    assert attachment_name("résumé.pdf") == "résumé.pdf"
    long = attachment_name("x" * 400 + ".csv")
    assert long.endswith(".csv") and len(long.encode()) <= 255 - 16
    assert numbered("a.csv", 2) == "a (2).csv"
    assert numbered("archive.tar.gz", 3) == "archive (3).tar.gz"


@pytest.mark.parametrize(
    ("path", "name", "image"),
    [
        ("plots/chart.png", "chart.png", True),
        ("photo.JPG", "photo.JPG", True),
        ("logo.svg", "logo.svg.txt", False),
        ("x.svgz", "x.svgz.txt", False),
        ("scan.tiff", "scan.tiff.txt", False),
        ("song.mp3", "song.mp3", False),
        ("clip.mp4", "clip.mp4", False),
        ("page.html", "page.html", False),
        ('we"ird; name.csv', "we_ird__name.csv", False),
        ("图表.png", "file.png", True),
        (".htaccess", "_htaccess", False),
    ],
)
def test_publish_names(path: str, name: str, image: bool) -> None:
    got, kind = publish_name(path)
    assert got == name
    assert all(c.isascii() and (c.isalnum() or c in "._-") for c in got)
    assert (kind in {"image/png", "image/jpeg"}) == image
