"""The index_database valve, read by webui.host (no Open WebUI needed for an explicit choice)."""

from __future__ import annotations

import pytest

from webui import Misconfigured, OpenWebUI


@pytest.mark.parametrize(
    ("choice", "url"),
    [
        ("sqlite", ""),
        (" SQLite ", ""),
        ("sqlite:////data/webui.db", ""),
        ("sqlite+sqlcipher:///x.db", ""),
        ("postgresql://u:p@db/owui", "postgresql://u:p@db/owui"),
        ("postgresql+psycopg://db/owui", "postgresql+psycopg://db/owui"),
    ],
)
def test_the_choices_the_valve_takes(choice: str, url: str) -> None:
    assert OpenWebUI().index_url(choice) == url


@pytest.mark.parametrize("choice", ["mysql://u:secret@db/x", "index.sqlite3", "postgres-ish"])
def test_anything_else_is_the_admins_to_fix_and_never_shows_a_password(choice: str) -> None:
    with pytest.raises(Misconfigured, match="not a database the index can use") as raised:
        OpenWebUI().index_url(choice)
    assert "secret" not in str(raised.value)


def test_temporary_chats() -> None:
    temporary = OpenWebUI.temporary_chat
    assert temporary("")
    assert temporary("temporary:abc")
    assert temporary("local:abc")
    assert not temporary("5b2c-uuid")
    assert not temporary("temporary")
    assert not temporary("channel:abc")  # not saved as a chat, but not temporary either
