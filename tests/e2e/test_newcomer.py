"""A newcomer's first hour (issue 36): `./scripts/serve`'s demo walked in headless Chromium the way a person
uses it, from the message box: a failed run headed by its exception, no Pyodide "Run" button on the Code
model's code, an upload link asked for in words and used, Save to Knowledge asked for in words and done,
an attachment whose later answers find their source, a table preview that exports as the data's head and
fits the page, five interactive charts that download as PNG and leave the chat light, ten answers whose
Python states are all kept and a lost one said once, and a data folder that holds everything the command
wrote.

One `python -m demo.serve` (one Open WebUI and the demo model) for the whole module, and one browser page:
each test is a step of the walk, in order, most in a chat of their own. Its screenshots are
docs/features.md's pictures: with UPDATE_SCREENSHOTS=1 set, they are written to docs/images/
(`UPDATE_SCREENSHOTS=1 ./scripts/test tests/e2e/test_newcomer.py`).
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import os
import re
import shutil
import time
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Locator, Page

from demo import launcher
from storage._keys import id_key
from tests.e2e.test_browser import drawn_chart, hover_over, keep_screenshot, shown
from tests.e2e.test_inbound import kb_files, knowledge_base
from tests.e2e.test_serve import Serve
from tests.support.notebooks import digests, run_notebook, source, validated
from tests.support.open_webui import BASE_MODEL, MODEL, Account

pytestmark = [pytest.mark.e2e, pytest.mark.runsc, pytest.mark.browser, pytest.mark.timeout(900)]


@dataclass
class Demo:
    serve: Serve
    home: Path  # the folder the data folder is in: nothing else may appear there
    data_dir: Path
    user: Account
    page: Page
    shots: Path


@pytest.fixture(scope="module")
def demo(browser: Browser, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Demo]:
    home = tmp_path_factory.mktemp("newcomer")
    data_dir = home / "demo-data"
    shots = tmp_path_factory.mktemp("newcomer-out")
    started = time.monotonic()
    serve = Serve(data_dir, launcher.free_port(), shots / "serve.out")
    try:
        serve.wait_ready()
        print(f"\n./scripts/serve ready in {time.monotonic() - started:.1f} s")
        user = serve.account()
        context = browser.new_context(viewport={"width": 1000, "height": 640}, accept_downloads=True)
        page = context.new_page()
        yield Demo(serve, home, data_dir, user, page, shots)
        context.close()
    finally:
        serve.stop()
        print(f"the walk took {time.monotonic() - started:.1f} s in all")


@dataclass
class Answer:
    chat_id: str
    message_id: str
    element: Locator
    question: Locator  # the user's message it answers

    @property
    def content(self) -> Locator:
        return self.element.locator("#response-content-container")


def new_chat(demo: Demo, model: str = MODEL) -> None:
    """A new chat with this model, as the model menu leaves it (the page signs the single user in)."""
    page = demo.page
    page.goto(f"{demo.serve.url}/?models={model}")
    page.locator("#chat-input").wait_for(timeout=60_000)
    page.keyboard.press("Escape")  # the admin's "What's new" dialog, if it shows


def send(demo: Demo, text: str, timeout: float = 180) -> Answer:
    """Type a message in the message box and send it with Enter; the answer once Open WebUI has it done
    and the page shows it."""
    page, user = demo.page, demo.user
    known = set()
    if "/c/" in page.url:
        chat = user.get(f"/api/v1/chats/{page.url.rsplit('/', 1)[1]}").json()["chat"]
        known = set(chat["history"]["messages"])
    box = page.locator("#chat-input")
    box.click()
    box.fill(text)
    page.keyboard.press("Enter")
    page.wait_for_url(re.compile(r"/c/[0-9a-f-]{36}$"), timeout=60_000)
    chat_id = page.url.rsplit("/", 1)[1]
    deadline = time.monotonic() + timeout
    while True:
        chat = user.get(f"/api/v1/chats/{chat_id}").json()["chat"]
        messages = chat["history"]["messages"]
        new = [m for i, m in messages.items() if i not in known and m["role"] == "assistant"]
        busy = user.get(f"/api/tasks/chat/{chat_id}").json().get("task_ids")
        if new and new[0].get("done") and not busy:
            break
        assert time.monotonic() < deadline, f"no answer to {text!r} within {timeout:.0f} s"
        time.sleep(0.3)
    answer = Answer(
        chat_id,
        new[0]["id"],
        page.locator(f"#message-{new[0]['id']}"),
        page.locator(f"#message-{new[0]['parentId']}"),
    )
    answer.element.get_by_role("button", name="Regenerate").wait_for(timeout=60_000)  # shown when done
    return answer


def saved_message(demo: Demo, answer: Answer) -> dict:
    return demo.user.get(f"/api/v1/chats/{answer.chat_id}").json()["chat"]["history"]["messages"][
        answer.message_id
    ]


def screenshot(demo: Demo, name: str, top: Locator) -> None:
    """The page with `top` (a message) first under the chat's title bar."""
    top.evaluate(
        "e => { e.scrollIntoView({block: 'start'});"
        " document.getElementById('messages-container').scrollBy(0, -56); }"
    )
    keep_screenshot(demo.page, demo.shots, name, scroll=False)


# ---- the walk ---------------------------------------------------------------------------------------------

HOSTILE = "<b>bold</b> {{user}} $x$ [a](https://evil.example) &lt;i&gt;"
FAILING = """```python
prices = {"apples": 3}
prices["pears"] * 2
```"""
HOSTILE_FAILING = f"""```python
raise ValueError({HOSTILE!r})
```"""


def test_open_webuis_own_code_execution_is_off_for_the_code_models(demo: Demo):
    # Pyodide in the browser (another Python, without /mnt/data): no Run button on code blocks (global
    # in Open WebUI 0.12.4) and no Code Interpreter for the models of the product.
    features = demo.user.get("/api/config").json()["features"]
    assert features["enable_code_execution"] is False, features
    for model in (MODEL, BASE_MODEL):
        meta = demo.user.get(f"/api/v1/models/model?id={model}").json()["meta"]
        assert meta["capabilities"]["code_interpreter"] is False, (model, meta)
    new_chat(demo)
    demo.page.get_by_role("button", name="Integrations").click()
    menu = demo.page.get_by_role("menu")
    menu.wait_for(timeout=10_000)
    assert "Code Interpreter" not in menu.inner_text(), menu.inner_text()
    demo.page.keyboard.press("Escape")
    ran = send(demo, "```python\nprint(6 * 7)\n```")
    ran.content.get_by_text(re.compile(r"^Python finished in")).click()  # open, as a reader does
    ran.content.get_by_text("42").wait_for(timeout=30_000)
    # Python code on the page: the user's block, the run's code and output. None has a Run button.
    assert demo.page.locator(".cm-content").count() == 3
    assert demo.page.get_by_role("button", name="Run", exact=True).count() == 0
    assert demo.page.locator(".run-code-button").count() == 0


def test_a_failed_run_is_headed_by_its_exception(demo: Demo):
    new_chat(demo)
    failed = send(demo, FAILING)
    headline = failed.content.get_by_text(re.compile(r"^KeyError: 'pears' \(Python, [0-9.]+ m?s\)$"))
    headline.wait_for(timeout=30_000)
    assert "exit code" not in failed.content.inner_text()
    headline.click()  # the block open: the traceback is its record
    failed.content.get_by_text("Traceback (most recent call last):").wait_for(timeout=30_000)
    screenshot(demo, "error-headline.png", failed.question)

    # The exception's text is the code's output, hostile: the headline shows it as written.
    hostile = send(demo, HOSTILE_FAILING)
    title = hostile.content.get_by_text(re.compile(r"^ValueError: .* \(Python, [0-9.]+ m?s\)$"))
    title.wait_for(timeout=30_000)
    assert shown(title).startswith(f"ValueError: {HOSTILE} (Python, "), shown(title)
    made = hostile.content.locator("b, a, .katex, img, i")
    assert made.count() == 0, hostile.content.inner_html()


def test_an_upload_link_is_asked_for_in_words_and_takes_the_file(demo: Demo, tmp_path: Path):
    new_chat(demo)
    asked = send(demo, "give me an upload link")
    asked.content.get_by_text("Which name should the file have in /mnt/data?").wait_for(timeout=30_000)
    offered = send(demo, "sales.csv")
    link = offered.content.locator("a[href*='/code-sessions/upload/']").first
    link.wait_for(timeout=30_000)
    assert "It becomes /mnt/data/sales.csv in this chat" in offered.content.inner_text()
    screenshot(demo, "upload-link.png", asked.question)

    # The link in a tab of its own, as a click opens it: its form takes the file.
    data = b"region,sales\nnorth,10\nsouth,20\n"
    (tmp_path / "sales.csv").write_bytes(data)
    form = demo.page.context.new_page()
    form.goto(str(link.get_attribute("href")))
    form.locator("input[name=file]").set_input_files(str(tmp_path / "sales.csv"))
    with form.expect_navigation():
        form.get_by_role("button", name="Upload").click()
    assert "sales.csv" in form.locator("body").inner_text(), form.content()
    form.close()
    listed = send(demo, "list my files")
    listed.content.get_by_text(re.compile(r"Python finished")).first.click()
    listed.content.get_by_text(re.compile(r"\b31\s+sales\.csv")).wait_for(timeout=30_000)


def test_save_to_knowledge_is_asked_for_in_words_and_works(demo: Demo):
    research = knowledge_base(demo.user, "Research")  # the demo's first base
    new_chat(demo)
    send(demo, "make a csv report")
    told = send(demo, "save it to knowledge")
    command = "!save-to-knowledge /mnt/data/report.csv <name of the base>"
    told.content.get_by_text(command).wait_for(timeout=30_000)
    assert told.content.locator("table").count() == 0  # names the file, does not link it again
    saved = send(demo, "!save-to-knowledge /mnt/data/report.csv Research")
    sentence = saved.content.get_by_text(re.compile(r"^Saved report\.csv \(.*\) to the Knowledge base"))
    sentence.wait_for(timeout=30_000)
    assert "Not saved" not in saved.content.inner_text()
    assert kb_files(demo.user, research) == ["report.csv"]
    screenshot(demo, "save-to-knowledge.png", told.question)


def test_an_attachment_gives_later_answers_their_source(demo: Demo, tmp_path: Path):
    new_chat(demo)
    (tmp_path / "visits.csv").write_text("week,visits\n1,10\n2,30\n")
    demo.page.locator("input[type=file]").first.set_input_files(str(tmp_path / "visits.csv"))
    demo.page.get_by_text("visits.csv").first.wait_for(timeout=30_000)
    first = send(demo, "list my files")
    later = send(demo, "summarise it")
    for answer in (first, later):
        # Open WebUI's retrieval over the attachment found it (embedded offline): no "No sources found".
        retrieved = [s for s in saved_message(demo, answer).get("statusHistory") or [] if "count" in s]
        assert retrieved and all(s["count"] > 0 for s in retrieved), retrieved
        assert answer.element.get_by_text("No sources found").count() == 0
    assert first.element.get_by_text(re.compile(r"^\d+ Sources?$")).count() == 1


BASH_STEP = "```bash\nwc -l < report.csv > lines.txt\ncat lines.txt\n```"


def button(answer: Answer, name: str) -> Locator:
    """One of the Action's buttons under the answer (shown on hover, except under the last answer)."""
    found = answer.element.get_by_role("button", name=name, exact=True)
    answer.element.hover()
    found.wait_for(timeout=30_000)
    return found


def dialog(demo: Demo, title: str) -> Locator:
    found = demo.page.get_by_role("dialog", name=title)
    found.wait_for(timeout=60_000)
    return found


def test_the_buttons_under_an_answer_export_a_notebook_show_zip_and_save_the_files(
    demo: Demo, tmp_path: Path
):
    # Issue 35 and 36: a chat with a CSV, a chart and a bash step; the buttons of the Action that
    # ./scripts/serve installs, pressed in the page as a person does.
    new_chat(demo)
    report = send(demo, "make a csv report")
    send(demo, "plot it")
    third = send(demo, BASH_STEP)
    third.content.get_by_text(re.compile(r"^Bash finished in")).wait_for(timeout=30_000)

    # Export as notebook: attached to the third answer, valid for nbformat, and run top to bottom in
    # the sandbox environment (real gVisor) it writes the chat's very files.
    button(third, "Export as notebook").click()
    chip = third.element.get_by_text(re.compile(r"answer-3\.ipynb"))
    chip.first.wait_for(timeout=60_000)
    screenshot(demo, "notebook-export.png", third.question)
    [item] = [f for f in saved_message(demo, third).get("files") or [] if f["name"].endswith(".ipynb")]
    response = demo.user.get(item["url"])
    assert response.status_code == 200, response.text
    notebook = validated(response.content)
    sources = [source(cell) for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert len(sources) == 4 and sources[3].startswith("%%bash\n"), sources
    assert "Where it ran" in source(notebook["cells"][0])
    figures = [o for c in notebook["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert any("image/png" in o.get("data", {}) for o in figures)  # the chart, as it was shown
    chat_folder = (
        demo.data_dir / "code_sessions" / "sessions" / id_key(demo.user.user_id) / id_key(third.chat_id)
    )
    # In a thread of its own: the page's Playwright keeps its event loop in this one.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, run_notebook(notebook, tmp_path / "rerun", tmp_path / "registry")).result()
    assert digests(tmp_path / "rerun") == digests(chat_folder), sorted(digests(chat_folder))
    assert sorted(digests(chat_folder)) == ["chart.png", "lines.txt", "report.csv"]

    # Files of this chat: /mnt/data in one view, each file with its size and a download link.
    button(third, "Files of this chat").click()
    view = dialog(demo, "Files of this chat")
    for name in ("report.csv", "chart.png", "lines.txt"):
        row = view.locator("li", has_text=f"/mnt/data/{name}")
        row.get_by_role("link", name="download").wait_for(timeout=30_000)
    assert "3 files" in view.inner_text()
    keep_screenshot(demo.page, demo.shots, "files-of-this-chat.png", scroll=False)
    with demo.page.expect_download() as got:
        view.locator("li", has_text="/mnt/data/lines.txt").get_by_role("link", name="download").click()
    assert Path(got.value.path()).read_bytes() == b"7\n"
    view.get_by_role("button", name="Confirm").click()

    # Download all files: one zip of /mnt/data, its link in a dialog.
    button(third, "Download all files (zip)").click()
    zipped = dialog(demo, "This chat's files as a zip")
    keep_screenshot(demo.page, demo.shots, "zip-download.png", scroll=False)
    with demo.page.expect_download() as got:
        zipped.get_by_role("link").first.click()
    with zipfile.ZipFile(got.value.path()) as archive:
        assert sorted(archive.namelist()) == ["chart.png", "lines.txt", "report.csv"]
        assert archive.read("lines.txt") == b"7\n"
    zipped.get_by_role("button", name="Confirm").click()

    # Save to Knowledge on the first answer's files: the user picks the base.
    projects = knowledge_base(demo.user, "Projects")
    knowledge_base(demo.user, "Archive")  # more than one base: the button asks which
    button(report, "Save to Knowledge").click()
    ask = dialog(demo, "Save to Knowledge")
    ask.locator("select").select_option(label="Projects")
    keep_screenshot(demo.page, demo.shots, "save-to-knowledge-button.png", scroll=False)
    ask.get_by_role("button", name="Confirm").click()
    demo.page.get_by_text(re.compile(r"Saved report\.csv \(.*\) to the Knowledge base")).wait_for(
        timeout=60_000
    )
    assert kb_files(demo.user, projects) == ["report.csv"]


def chat_file(demo: Demo, answer: Answer, name: str) -> Path:
    """A file of the answer's chat folder, on the host."""
    sessions = demo.data_dir / "code_sessions" / "sessions" / id_key(demo.user.user_id)
    return sessions / id_key(answer.chat_id) / name


WIDE = """```python
import numpy as np, pandas as pd
rng = np.random.default_rng(7)
frame = pd.DataFrame(rng.normal(size=(5000, 6)) * [1, 10, 100, 0.01, 1000, 5], columns=list("abcdef"))
frame.insert(0, "hour", pd.date_range("2024-01-01", periods=5000, freq="h").strftime("%Y-%m-%d %H:%M"))
frame.to_csv("/mnt/data/measurements.csv", index=False)
```
reply: The measurements: /mnt/data/measurements.csv"""


def test_a_table_preview_exports_the_datas_head_and_fits_the_page(demo: Demo):
    new_chat(demo)
    report = send(demo, "make a csv report")
    table = report.content.locator("table").first
    table.wait_for(timeout=30_000)
    # Open WebUI's own "Export to CSV" of the preview: the file's header and its rows, as they are.
    table.hover()
    with demo.page.expect_download(timeout=30_000) as downloading:
        report.content.get_by_role("button", name="Export to CSV").first.click()
    exported = Path(downloading.value.path()).read_text(encoding="utf-8-sig")
    data = chat_file(demo, report, "report.csv").read_text()
    assert list(csv.reader(io.StringIO(exported))) == list(csv.reader(io.StringIO(data))), (exported, data)

    # 5,000 rows of floats: counted, not "about 5,001"; the floats short, so that every column fits.
    wide = send(demo, WIDE)
    caption = wide.content.get_by_text(re.compile(r"^Preview · "))
    caption.wait_for(timeout=30_000)
    assert shown(caption).startswith(
        "Preview · 5,000 rows, 7 columns (hour: date, a: float, b: float, c: float, d: float, e: float, "
        "f: float), the first 8 shown"
    ), shown(caption)
    table = wide.content.locator("table").first
    assert [h.strip() for h in table.locator("th").all_text_contents()] == ["hour", *"abcdef"]
    cells = table.locator("td").all_inner_texts()
    assert all(len(cell.strip()) <= 16 for cell in cells), cells
    widths = table.evaluate("t => [t.parentElement.scrollWidth, t.parentElement.clientWidth]")
    assert widths[0] <= widths[1] + 1, widths  # no column out of sight
    screenshot(demo, "table-preview.png", wide.element)


def regenerate(demo: Demo, answer: Answer, timeout: float = 180) -> Answer:
    """Regenerate `answer` with the button under it (hovered, as a person does); its new sibling, done."""
    messages = demo.user.get(f"/api/v1/chats/{answer.chat_id}").json()["chat"]["history"]["messages"]
    known = set(messages)
    for _ in range(10):  # the page shows the newest 8 messages, and 8 more each time it is scrolled up
        if answer.element.count():
            break
        demo.page.evaluate("document.getElementById('messages-container').scrollTo(0, 0)")
        demo.page.wait_for_timeout(500)  # what scrolling up shows, as a person waits for it
    answer.element.hover()
    answer.element.get_by_role("button", name="Regenerate").click()
    demo.page.get_by_role("menu").get_by_text("Try Again").click()  # its menu: again, as it was asked
    deadline = time.monotonic() + timeout
    while True:
        messages = demo.user.get(f"/api/v1/chats/{answer.chat_id}").json()["chat"]["history"]["messages"]
        new = [m for i, m in messages.items() if i not in known and m["role"] == "assistant"]
        busy = demo.user.get(f"/api/tasks/chat/{answer.chat_id}").json().get("task_ids")
        if new and new[0].get("done") and not busy:
            break
        if time.monotonic() > deadline:
            demo.page.screenshot(path=str(demo.shots / "regenerate-failed.png"))
            raise AssertionError(f"no regenerated answer within {timeout:.0f} s ({demo.shots})")
        time.sleep(0.3)
    assert new[0]["parentId"] == messages[answer.message_id]["parentId"]
    element = demo.page.locator(f"#message-{new[0]['id']}")
    element.get_by_role("button", name="Regenerate").wait_for(timeout=60_000)
    return Answer(answer.chat_id, new[0]["id"], element, answer.question)


def python_states(demo: Demo, chat_id: str) -> Path:
    """Where the chat's answers keep their Python states (a folder each, named by the answer's digest)."""
    state = demo.data_dir / "code_sessions" / "state" / id_key(demo.user.user_id)
    return state / f"{id_key(chat_id)}.kernel" / "history" / "kernels"


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


RESTORED = "Restored the files and Python state of the message you are continuing from."
LOST = re.compile(
    r"^Restored the files of the message you are continuing from, but not its Python state, which is no "
    r"longer kept \(a chat keeps the Python states of its newest 20 answers, as far as your storage "
    r"allows\): Python starts afresh\.$"
)


def test_ten_answers_keep_their_python_states_and_a_lost_one_is_said_once(demo: Demo):
    new_chat(demo)
    answers = [send(demo, "make a csv report"), send(demo, "summarise it")]
    answers += [send(demo, "```python\ndel df\n```")]
    answers += [send(demo, f"```python\nstep = {n}\n```") for n in range(4, 11)]
    for answer in answers[1:]:
        assert saved_message(demo, answer)["content"].rstrip().endswith("Done. The output is above.")
    # Each answer's state is saved after it, in the background (the next message waits for it).
    kept = python_states(demo, answers[0].chat_id)
    deadline = time.monotonic() + 120
    while len(images := sorted(p for p in kept.iterdir() if (p / "kernel").is_dir())) < 10:
        assert time.monotonic() < deadline, images
        time.sleep(0.3)
    each = [disk_bytes(p) / 2**20 for p in images]
    print(f"\nPython states kept: {len(each)}, {min(each):.0f}-{max(each):.0f} MiB each on disk")

    # The Python state of answer 9 is gone (as when the user's storage is full): regenerating answer
    # 10 gets answer 9's files back and a new Python state, said once, under the run; the status line,
    # which said it as the answer started, is cleared when the run's block says it.
    digest = hashlib.sha256(answers[8].message_id.encode()).hexdigest()[:32]
    shutil.rmtree(kept / digest)
    tenth = regenerate(demo, answers[9])
    lost = tenth.content.get_by_text(LOST)
    lost.wait_for(timeout=30_000)
    said = tenth.content.inner_text()
    assert lost.count() == 1 and "Python state" not in said.replace(shown(lost), ""), said
    assert tenth.element.locator(".status-description").count() == 0
    demo.page.mouse.move(0, 0)
    screenshot(demo, "lost-state.png", tenth.question)

    # Regenerating the second answer: the first one's Python state is still kept (the tenth newest),
    # with the frame the csv step loaded, which a later step deleted.
    second = regenerate(demo, answers[1])
    assert second.content.get_by_text(RESTORED).count() == 1
    said = second.content.inner_text()
    assert said.count("Restored") == 1 and "was reset" not in said, said
    assert second.element.locator(".status-description").count() == 0
    demo.page.mouse.move(0, 0)
    screenshot(demo, "restored-state.png", second.question)
    second.content.get_by_text(re.compile(r"^Python finished in")).click()
    second.content.get_by_text("df is still loaded from the csv step: 6 rows").wait_for(timeout=30_000)


def embeds_bytes(demo: Demo, answer: Answer) -> int:
    """What the answer's embeds add to its saved message (JSON, as the chat's API sends them)."""
    return len(json.dumps(saved_message(demo, answer).get("embeds") or []).encode())


def reload_seconds(demo: Demo, *chats: tuple[Answer, str]) -> list[float]:
    """For each (answer, its text): from opening the answer's chat to that text shown, the best of four
    loads, the chats loaded in turn (so that a busy moment of the machine falls on each alike)."""
    page, best = demo.page, [float("inf")] * len(chats)
    for _ in range(4):
        for i, (answer, text) in enumerate(chats):
            page.goto("about:blank")
            started = time.monotonic()
            page.goto(f"{demo.serve.url}/c/{answer.chat_id}", wait_until="commit")  # not the frames' load
            answer.content.get_by_text(text).wait_for(timeout=60_000)
            best[i] = min(best[i], time.monotonic() - started)
    page.keyboard.press("Escape")
    return best


CHART_TEXT = "Here is the interactive chart"


def test_five_interactive_charts_stay_light_and_download_as_png(demo: Demo, tmp_path: Path):
    new_chat(demo)
    send(demo, "make a csv report")
    charts = [send(demo, "an interactive chart") for _ in range(5)]
    sizes = [embeds_bytes(demo, chart) for chart in charts]
    print(f"\nembeds per chart: {sizes} bytes")
    assert all(0 < size <= 100_000 for size in sizes), sizes
    chat_bytes = len(demo.user.get(f"/api/v1/chats/{charts[0].chat_id}").content)
    print(f"the five-chart chat's JSON: {chat_bytes:,} bytes")

    # The newest chart, drawn: plotly's toolbar has no "Share chart" (it would upload to Plotly's
    # cloud), and its camera downloads the chart as a PNG named after the chart's file.
    last = charts[-1]
    outer = last.element.locator(f"[id='{last.message_id}-embeds-container'] iframe")
    chart = drawn_chart(outer)
    buttons = chart.locator(".modebar-btn")
    titles = [buttons.nth(i).get_attribute("data-title") for i in range(buttons.count())]
    assert "Download plot as a PNG" in titles and not [t for t in titles if "Share" in str(t)], titles
    camera = chart.get_by_role("button", name="Download plot as a PNG")
    with demo.page.expect_download(timeout=30_000) as downloading:
        camera.click()
    download = downloading.value
    saved = tmp_path / download.suggested_filename
    download.save_as(saved)
    assert download.suggested_filename == "chart-5.png", download.suggested_filename
    assert saved.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and saved.stat().st_size > 5_000
    hover_over(demo.page, camera)
    screenshot(demo, "chart-download.png", last.element)

    # plotly.js comes from Open WebUI's route: JavaScript that no browser renders as a page, cached by
    # its digest; a name that is not a digest, or a path out of its folder, is not served.
    embed = saved_message(demo, last)["embeds"][0]
    [script] = re.findall(r"script\.src = &quot;(/code-sessions/plotly/[0-9a-f]{64}\.js)&quot;", embed)
    served = httpx.get(demo.serve.url + script, headers={"Accept-Encoding": "gzip"}, timeout=30)
    assert served.status_code == 200 and served.content.startswith(b"/**\n* plotly.js v")
    assert served.headers["content-type"].startswith("text/javascript")
    assert served.headers["x-content-type-options"] == "nosniff"
    assert served.headers["content-encoding"] == "gzip" and "immutable" in served.headers["cache-control"]
    assert "sandbox" in served.headers["content-security-policy"]
    for wrong in ("x.js", "0" * 64 + ".html", "..%2F..%2Fwebui.db", "%2E%2E/secret_key"):
        answer = httpx.get(f"{demo.serve.url}/code-sessions/plotly/{wrong}", timeout=30)
        assert answer.status_code == 404 or not answer.headers["content-type"].startswith("text/javascript")
        assert b"plotly" not in answer.content[:200] and b"secret" not in answer.content

    # The five charts' chat opens as fast as a chat of as many answers without charts.
    new_chat(demo)
    send(demo, "make a csv report")
    plain = [send(demo, "summarise it") for _ in range(5)]
    with_charts, without = reload_seconds(demo, (last, CHART_TEXT), (plain[-1], "Done. The output is above."))
    print(f"reload: five charts {with_charts:.2f} s, none {without:.2f} s")
    assert with_charts <= 1.25 * without + 0.5, (with_charts, without)


def test_the_data_folder_holds_everything_the_command_wrote(demo: Demo):
    assert sorted(os.listdir(demo.home)) == [demo.data_dir.name], sorted(os.listdir(demo.home))
    for name in ("open-webui.log", "secret_key", "scripted-model.log", "webui.db", "code_sessions"):
        assert (demo.data_dir / name).exists(), name
    assert f"(log: {demo.data_dir / 'open-webui.log'})" in demo.serve.printed()
    # The page and the API still answer: the walk ends with the demo running.
    assert httpx.get(demo.serve.url + "/health", timeout=10).status_code == 200
