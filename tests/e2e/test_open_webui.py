"""The product through Open WebUI's HTTP API only: a real Open WebUI 0.12.4, the bundled function installed
as an admin would, a scripted model, real gVisor. Each test is one user-visible promise."""

from __future__ import annotations

import io
import json
import re
import uuid
import zipfile

import httpx
import pytest

from tests.support.open_webui import FUNCTION_ID, LINK, MODEL, Account, OpenWebUI, Reply

pytestmark = [pytest.mark.e2e, pytest.mark.runsc]

REPORT = b"name,score\r\nada,3\r\nbob,5\r\n"
WRITE_REPORT = (
    "```python\n"
    "import csv\n"
    "with open('/mnt/data/report.csv', 'w', newline='') as f:\n"
    "    csv.writer(f).writerows([('name', 'score'), ('ada', 3), ('bob', 5)])\n"
    "print('written')\n"
    "```\n"
    "reply: Here is your report: /mnt/data/report.csv"
)


def run(code: str, reply: str = "", language: str = "python") -> str:
    return f"```{language}\n{code}\n```\n" + (f"reply: {reply}" if reply else "")


@pytest.fixture(scope="module")
def first_turn(open_webui: OpenWebUI) -> Reply:
    return open_webui.admin.say(WRITE_REPORT)


def test_turn_one_links_the_file_and_the_link_returns_its_bytes(open_webui: OpenWebUI, first_turn: Reply):
    assert "Here is your report: [report.csv](/api/v1/files/code-sessions-" in first_turn.content
    assert "/mnt/data/report.csv" not in first_turn.content.split("Here is your report:")[1]
    links = first_turn.links()
    assert links, first_turn.content
    download = open_webui.admin.download(links[-1])
    assert download.status_code == 200
    assert download.content == REPORT
    disposition = download.headers.get("content-disposition", "")
    assert "attachment" in disposition and "report.csv" in disposition


def test_the_saved_chat_holds_the_rewritten_answer(open_webui: OpenWebUI, first_turn: Reply):
    chat = open_webui.admin.get(f"/api/v1/chats/{first_turn.chat_id}").json()
    stored = chat["chat"]["history"]["messages"][first_turn.message_id]["content"]
    assert LINK.search(stored), stored


def test_turn_two_of_the_same_chat_reads_the_file(open_webui: OpenWebUI, first_turn: Reply):
    second = open_webui.admin.say(run("print(open('/mnt/data/report.csv').read())"), previous=first_turn)
    assert "ada,3" in second.content
    # The model was told which files the chat already has.
    system = open_webui.model_requests()[-1]["messages"][0]
    assert system["role"] == "system" and "/mnt/data/report.csv" in system["content"]


def test_a_second_chat_does_not_see_the_file(open_webui: OpenWebUI, first_turn: Reply):
    other = open_webui.admin.say(run("import os\nprint('files:', sorted(os.listdir('/mnt/data')))"))
    assert other.chat_id != first_turn.chat_id
    assert "files: []" in other.content


def test_a_second_user_can_neither_list_nor_guess_it(open_webui: OpenWebUI, first_turn: Reply):
    bob: Account = open_webui.accounts["bob"]
    assert bob.get(f"/api/v1/chats/{first_turn.chat_id}").status_code in (401, 403, 404)
    real = first_turn.links()[-1]
    assert bob.download(real).status_code == 404  # the link itself: owner-only
    guessed = re.sub(r"code-sessions-[0-9a-f-]{36}", f"code-sessions-{uuid.uuid4()}", real)
    assert bob.download(guessed).status_code == 404
    listed = bob.get("/api/v1/files/").json()["items"]
    # Bob's own chats (other tests share this Open WebUI) may have links of his: only those are listed.
    assert all(f["user_id"] == bob.user_id for f in listed), listed
    assert real.split("/")[-2] not in {f["id"] for f in listed}
    reply = bob.say(run("import os\nprint('files:', sorted(os.listdir('/mnt/data')))"))
    assert "files: []" in reply.content
    assert not reply.links()


def test_an_uploaded_attachment_is_readable_at_mnt_data(open_webui: OpenWebUI):
    admin = open_webui.admin
    attachment = admin.upload("people.csv", b"who,age\nada,36\n")
    reply = admin.say(run("print(open('/mnt/data/people.csv').read())"), files=[attachment])
    assert "ada,36" in reply.content
    # Next turn: the attachment is still listed by the UI, but it is not copied a second time.
    again = admin.say(
        run("import os\nprint(sorted(os.listdir('/mnt/data')))"), previous=reply, files=[attachment]
    )
    assert "['people.csv']" in again.content


def test_an_image_renders_inline(open_webui: OpenWebUI):
    reply = open_webui.admin.say("please plot a chart\nreply: The chart: /mnt/data/chart.png")
    match = re.search(r"!\[chart\.png\]\((" + LINK.pattern + r")\)", reply.content)
    assert match, reply.content
    image = open_webui.admin.download(match.group(1))
    assert image.status_code == 200
    assert image.headers["content-type"] == "image/png"  # an <img> renders it, attachment or not
    assert image.content.startswith(b"\x89PNG")


def test_after_a_purge_the_link_is_gone_and_the_chat_still_works(open_webui: OpenWebUI):
    admin = open_webui.admin
    reply = admin.say(run("open('/mnt/data/keep.txt', 'w').write('x')", "Saved /mnt/data/keep.txt"))
    link = reply.links()[-1]
    assert admin.download(link).status_code == 200
    open_webui.set_valves(purge=f"chat:{reply.chat_id}")
    after = admin.say(run("import os\nprint('files:', sorted(os.listdir('/mnt/data')))"), previous=reply)
    assert "files: []" in after.content
    assert admin.download(link).status_code == 404
    assert open_webui.valves()["purge"] == ""  # one-shot: cleared once done


def test_user_valves_hide_the_code_and_its_output_for_that_user_only(open_webui: OpenWebUI):
    bob = open_webui.accounts["bob"]
    message = run("print('out' + 'put-' + str(6 * 7))", "done")
    path = f"/api/v1/functions/id/{FUNCTION_ID}/valves/user/update"
    assert bob.post(path, {"show_code": False, "show_output": False}).status_code == 200
    try:
        hidden = bob.say(message)
        assert "output-42" not in hidden.content and "6 * 7" not in hidden.content, hidden.content
        shown = open_webui.admin.say(message)  # the admin kept the defaults
        assert "output-42" in shown.content and "6 * 7" in shown.content, shown.content
    finally:
        bob.post(path, {"show_code": True, "show_output": True})


def test_a_storage_root_inside_the_served_cache_is_refused_with_a_sentence(open_webui: OpenWebUI):
    inside = open_webui.data_dir / "cache" / "sessions"
    open_webui.set_valves(storage_root=str(inside))
    try:
        reply = open_webui.admin.say(run("open('/mnt/data/leak.txt', 'w').write('x')"))
        assert "not set up correctly" in reply.content and "storage_root" in reply.content, reply.content
        assert not inside.exists()
    finally:
        open_webui.set_valves(storage_root="")
    assert "still fine" in open_webui.admin.say(run("print('still fine')")).content


def test_a_streamed_answer_carries_working_links(open_webui: OpenWebUI):
    """The path a browser takes: `stream: true`, the answer arriving as server-sent events."""
    admin = open_webui.admin
    payload = {
        "model": MODEL,
        "stream": True,
        "messages": [
            {
                "role": "user",
                "content": run(
                    "open('/mnt/data/streamed.txt', 'w').write('s')", "See /mnt/data/streamed.txt"
                ),
            }
        ],
    }
    pieces: list[str] = []
    with httpx.stream(
        "POST", open_webui.url + "/api/chat/completions", json=payload, headers=admin.headers, timeout=300
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            for choice in event.get("choices", []):
                pieces.append((choice.get("delta") or {}).get("content") or "")
    content = "".join(pieces)
    assert "See [streamed.txt](/api/v1/files/code-sessions-" in content, content
    [link] = set(LINK.findall(content))
    assert admin.download(link).content == b"s"


def test_make_a_word_document_gives_a_link_to_a_real_docx(open_webui: OpenWebUI):
    """The demo model's own Word step (python-docx from the sandbox environment), as a user asks it."""
    reply = open_webui.admin.say("make a Word document")
    links = reply.links()
    assert links, reply.content
    download = open_webui.admin.download(links[-1])
    assert download.status_code == 200
    disposition = download.headers.get("content-disposition", "")
    assert "attachment" in disposition and "report.docx" in disposition
    with zipfile.ZipFile(io.BytesIO(download.content)) as docx:
        assert "word/document.xml" in docx.namelist()
        body = docx.read("word/document.xml").decode()
    assert "Visitors report" in body and "months of visitors" in body
