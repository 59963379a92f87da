"""webui/files.py without Open WebUI: what the Files API publisher decides before it asks Open WebUI
for anything. Storing the copy and who may open it are proven through a real Open WebUI
(tests/e2e/test_files_api.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage import Copy, StorageError
from webui import files


def _copy(path: Path, size: int) -> Copy:
    fd = os.open(path, os.O_RDONLY)
    return Copy(fd, size, path.name, "application/octet-stream", False, path.name, "u", "c", "0" * 64)


async def test_a_sparse_terabyte_is_refused_before_open_webui_would_read_it_dense(tmp_path: Path):
    big = tmp_path / "sparse.bin"
    with open(big, "wb") as f:
        f.truncate(1 << 40)  # a terabyte that takes no disk: Open WebUI would read and write it all
    copy = _copy(big, big.stat().st_size)
    try:
        with pytest.raises(StorageError, match="too large to link"):
            await files.FilesPublisher().put(copy)
    finally:
        os.close(copy.fd)


def test_the_copy_is_read_once_into_one_buffer_of_its_size(tmp_path: Path):
    data = os.urandom(3 << 20) + b"tail"
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, 5, os.SEEK_SET)  # the caller's offset does not matter: reads start at 0
        got = files._WholeFile(fd, len(data)).read()
        assert got == data and len(got) == len(data)
        shorter = files._WholeFile(fd, len(data) + 10).read()  # the file shrank since it was measured
        assert shorter == data
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("content_type", "extension"),
    [("image/png", ".png"), ("image/pjpeg", ".jpg"), ("image/x-icon", ".ico"), ("image/svg+xml", ".bin")],
)
def test_passive_images_keep_their_type_and_everything_else_downloads(content_type: str, extension: str):
    inline = content_type != "image/svg+xml"
    copy = Copy(-1, 1, "f", content_type, inline, "f", "u", "c", "0" * 64)
    stored_ext, stored_type = files._stored_as(copy)
    assert stored_ext == extension
    assert stored_type == (content_type if inline else "application/octet-stream")
