"""The charts' plotly.js, published for Open WebUI's route (webui/assets.py): under its digest, with a gzipped
copy, once per version; an older version stays for the messages that name it. The route itself is
exercised through a real Open WebUI in tests/e2e/test_newcomer.py (headers, a name that is not a
digest, a file outside the folder)."""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path

from webui.assets import publish


def test_plotly_js_is_published_under_its_digest_once_and_older_versions_stay(tmp_path: Path) -> None:
    source = tmp_path / "env" / "plotly.min.js"
    source.parent.mkdir()
    source.write_bytes(b"/* plotly.js v1 */" * 1000)
    folder = tmp_path / "assets"
    url = publish(folder, source)
    first = hashlib.sha256(source.read_bytes()).hexdigest() + ".js"
    assert url == "/code-sessions/plotly/" + first
    assert (folder / first).read_bytes() == source.read_bytes()
    assert gzip.decompress((folder / (first + ".gz")).read_bytes()) == source.read_bytes()
    assert sorted(os.listdir(folder)) == [first, first + ".gz"]  # no temporary file left
    written = (folder / first).stat().st_mtime_ns
    assert publish(folder, source) == url and (folder / first).stat().st_mtime_ns == written

    # The environment moves on: the new version is published beside the old one.
    source.write_bytes(b"/* plotly.js v2.0 */" * 1000)  # another size: a new version for sure
    second = hashlib.sha256(source.read_bytes()).hexdigest() + ".js"
    assert publish(folder, source) == "/code-sessions/plotly/" + second
    assert sorted(os.listdir(folder)) == sorted([first, first + ".gz", second, second + ".gz"])

    # A published copy removed (an admin cleaning up) is published again.
    (folder / second).unlink()
    assert publish(folder, source).endswith(second) and (folder / second).is_file()
