"""The demo model (demo/scripted_model.py) understands what a newcomer types first: an upload link and
Save to Knowledge asked for in words, with the user's own words read out of what Open WebUI wraps them
in. The same, through `./scripts/serve` in Chromium: tests/e2e/test_newcomer.py."""

from __future__ import annotations

import json

import pytest

from demo.scripted_model import answer

TOOLS = [{"type": "function", "function": {"name": name}} for name in ("run_code", "upload_link")]
PROMPT = {
    "role": "system",
    "content": "You can run code ...\nFiles now in /mnt/data (2 files, 136 B):\n"
    "- /mnt/data/report.csv (105 B)\n- /mnt/data/sales.csv (31 B)",
}


def reply(text: str, *earlier: dict, tools: list[dict] | None = TOOLS, prompt: dict | None = PROMPT) -> dict:
    messages = [*([prompt] if prompt else []), *earlier, {"role": "user", "content": text}]
    return answer({"messages": messages, "tools": tools})


def upload_path(said: dict) -> str:
    assert said.get("tool_call", ("",))[0] == "upload_link", said
    return json.loads(said["tool_call"][1])["path"]


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("give me an upload link for sales.csv", "/mnt/data/sales.csv"),
        ("Can I upload export.parquet?", "/mnt/data/export.parquet"),
        ("I need a link to upload /mnt/data/in/big.zip please", "/mnt/data/in/big.zip"),
        ("upload link: q3-report.xlsx", "/mnt/data/q3-report.xlsx"),
    ],
)
def test_an_upload_link_asked_for_in_words_is_made_for_the_file_named(text: str, path: str):
    assert upload_path(reply(text)) == path


def test_without_a_name_it_asks_which_and_understands_the_answer():
    for text in ("give me an upload link", "How can I upload a big file?", "upload"):
        asked = reply(text)
        assert asked["content"].startswith("Which name should the file have in /mnt/data?"), asked
        assert "tool_call" not in asked
    question = {"role": "assistant", "content": reply("give me an upload link")["content"]}
    assert upload_path(reply("sales.csv", {"role": "user", "content": "upload link"}, question)) == (
        "/mnt/data/sales.csv"
    )
    # A name in another conversation is not an answer to a question never asked.
    assert reply("sales.csv").get("tool_call", ("",))[0] != "upload_link"


def test_without_the_tool_it_says_so_instead_of_a_broken_link():
    said = reply("give me an upload link for sales.csv", tools=[TOOLS[0]])
    assert "tool_call" not in said and "Attach the file" in said["content"], said


def test_the_link_is_passed_on_with_what_it_does():
    result = (
        "Upload link for /mnt/data/sales.csv: http://127.0.0.1:8080/code-sessions/upload/abc_DEF-123\n"
        "It takes one file (at most 100 MiB), once, within 15m. Give the user this link: ..."
    )
    said = answer(
        {
            "messages": [
                {"role": "user", "content": "give me an upload link for sales.csv"},
                {"role": "tool", "content": result},
            ]
        }
    )["content"]
    assert said.startswith("Upload the file here: http://127.0.0.1:8080/code-sessions/upload/abc_DEF-123\n")
    assert "It becomes /mnt/data/sales.csv in this chat" in said and "once, within 15m" in said


@pytest.mark.parametrize(
    ("text", "command"),
    [
        ("save it to knowledge", "!save-to-knowledge /mnt/data/report.csv <name of the base>"),
        ("Please add this to my knowledge", "!save-to-knowledge /mnt/data/report.csv <name of the base>"),
        ("save sales.csv to knowledge base Research", "!save-to-knowledge /mnt/data/sales.csv Research"),
        ("save it to my Research knowledge base", "!save-to-knowledge /mnt/data/report.csv Research"),
        (
            "put it in the knowledge base called Team notes",
            "!save-to-knowledge /mnt/data/report.csv Team notes",
        ),
    ],
)
def test_save_to_knowledge_in_words_gives_the_command_to_send(text: str, command: str):
    said = reply(text)
    assert "tool_call" not in said  # the user's to type: never done by the model
    assert f"`{command}`" in said["content"], said
    if "<name" in command:  # no base named: it asks which, and how to list them
        assert said["content"].startswith("Which Knowledge base should report.csv go into?")
        assert "`!save-to-knowledge` alone lists the bases" in said["content"]


def test_save_to_knowledge_names_the_last_file_the_answers_named_without_a_prompt():
    earlier = {"role": "assistant", "content": "Your files are ready: /mnt/data/a.csv, /mnt/data/b.txt"}
    said = reply("save it to knowledge", earlier, prompt=None)
    assert "`!save-to-knowledge /mnt/data/b.txt <name of the base>`" in said["content"], said
    empty = reply("save it to knowledge", prompt=None)
    assert "no file to save yet" in empty["content"], empty


def test_the_users_own_words_are_read_out_of_what_open_webui_wraps_them_in():
    attached = '<attached_files>\n<file type="file" url="x" name="sales.csv"/>\n</attached_files>\n\n'
    listed = reply(attached + "list my files")
    assert "os.listdir" in listed["tool_call"][1], listed  # not the csv report the file's name suggests
    retrieval = (
        "### Task:\nRespond to the user query using the provided context ...\n<context>\n"
        "<source>region,sales report\nnorth,10</source>\n</context>\nsave it to knowledge"
    )
    assert "!save-to-knowledge /mnt/data/report.csv" in reply(retrieval)["content"]


def test_a_sentence_the_filter_left_is_passed_on():
    left = (
        "(The user typed !save-to-knowledge. Saved report.csv into Research. Tell the user this in one "
        "sentence; run no code.)"
    )
    assert reply(left) == {"content": "Saved report.csv into Research."}
