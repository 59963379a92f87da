"""engine/inbound.py without Open WebUI: how the save command and paths are read, and the Pipe's loop
offering a tool beside run_code (the upload link), each call counted as a step."""

from __future__ import annotations

import pytest

from engine import ExtraTool, chat_path, save_command
from engine.loop import LoopOptions, converse
from engine.sse import TextDelta, ToolCall
from storage import InvalidPath as InvalidPathError
from tests.engine.test_loop import StandInChat, collect, no_status, scripted


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("!save-to-knowledge /mnt/data/report.csv Research", ("/mnt/data/report.csv", "Research")),
        ("!save-to-knowledge report.csv to Team notes", ("report.csv", "Team notes")),
        ("!save-to-knowledge 'my report.csv' into Research", ("my report.csv", "Research")),
        ("  !save-to-knowledge  ", ("", "")),
        ("!save-to-knowledge a.csv", ("a.csv", "")),
        ("!save-to-knowledgeX a.csv b", None),
        ("please !save-to-knowledge a.csv b", None),
        ('!save-to-knowledge "unclosed b', ('"unclosed', "b")),
    ],
)
def test_the_save_command_is_read_as_file_and_base(text, expected):
    assert save_command(text) == expected


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/mnt/data/a/b.csv", "a/b.csv"),
        ("a.csv", "a.csv"),
        ("`/mnt/data/x.txt`", "x.txt"),
        ("./a/./b", "a/b"),
    ],
)
def test_chat_paths_are_made_relative_to_the_folder(path, expected):
    assert chat_path(path) == expected


@pytest.mark.parametrize("path", ["/etc/passwd", "/mnt/data/../../etc/passwd", "../x", "", "/mnt/database/x"])
def test_paths_outside_the_folder_are_refused(path):
    with pytest.raises(InvalidPathError):
        chat_path(path)


async def test_the_loop_offers_an_extra_tool_and_counts_its_calls_as_steps():
    seen = []

    async def call(chat, arguments):
        seen.append(arguments)
        return "Upload link for /mnt/data/x.csv: http://h/code-sessions/upload/t"

    spec = {"type": "function", "function": {"name": "upload_link", "parameters": {}}}
    model, calls = scripted(
        [ToolCall("c1", "upload_link", '{"path": "/mnt/data/x.csv"}')],
        [ToolCall("c2", "upload_link", '{"path": "/mnt/data/y.csv"}')],
        [TextDelta("done")],
    )
    options = LoopOptions(max_steps=1, tools=(ExtraTool(spec, call),))
    out = await collect(
        converse(StandInChat(), [{"role": "user", "content": "go"}], model, options, no_status)
    )
    assert out == "done"
    assert seen == [{"path": "/mnt/data/x.csv"}]  # the second call is past the step limit
    assert [t["function"]["name"] for t in calls[0][1]] == ["run_code", "upload_link"]
    results = [m["content"] for m in calls[2][0] if m["role"] == "tool"]
    assert results[0].startswith("Upload link for") and "step limit" in results[1]


async def test_an_unknown_tool_is_told_the_tools_there_are():
    model, calls = scripted([ToolCall("c1", "rm_rf", "{}")], [TextDelta("ok")])
    await collect(
        converse(StandInChat(), [{"role": "user", "content": "go"}], model, LoopOptions(), no_status)
    )
    [result] = [m["content"] for m in calls[1][0] if m["role"] == "tool"]
    assert result == "Unknown tool 'rm_rf'; the tools are run_code."
