"""The real Open WebUI page in headless Chromium: how the demo's answers read, counted on the rendered page.

Each run is one collapsible block and leaves no status line; each file shows once in the answer's text
(where the model names it) and once among its attachments; a chart shows inline and nowhere else; a file
the model did not name is an attachment that downloads; a run stopped by a limit says why, once.

Its screenshots are the pictures of the README and docs/features.md: with UPDATE_SCREENSHOTS=1 set, they
are written to docs/images/chat.png and docs/images/limit.png
(`UPDATE_SCREENSHOTS=1 ./scripts/test tests/e2e/test_browser.py`).
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Frame, Locator, Page

from tests.support.open_webui import FUNCTION_ID, LINK, Account, OpenWebUI, Reply, say_streamed

pytestmark = [pytest.mark.e2e, pytest.mark.runsc, pytest.mark.browser]

REPO = Path(__file__).resolve().parents[2]


def logged_in(browser: Browser, server: OpenWebUI, account: Account, height: int = 1250) -> BrowserContext:
    """A browser session of the user as Open WebUI's own login leaves it: the token in localStorage (what
    the app's API calls send) and the `token` cookie (what an <img> or a new tab sends to the Files API)."""
    context = browser.new_context(viewport={"width": 1200, "height": height}, accept_downloads=True)
    context.add_cookies([{"name": "token", "value": account.token, "url": server.url}])
    context.add_init_script(  # in the page only: a frame without same-origin has no localStorage
        "if (window === window.top) {"
        f" localStorage.setItem('token', {account.token!r}); localStorage.setItem('version', '0.12.4'); }}"
    )
    return context


def link_named(reply: Reply, name: str, image: bool = False) -> str:
    """The one Files API URL the answer links (or, with image=True, shows) under this name."""
    pattern = ("!" if image else r"(?<!!)") + r"\[" + re.escape(name) + r"\]\((" + LINK.pattern + r")\)"
    urls = re.findall(pattern, reply.content)
    assert len(urls) == 1, (name, reply.content)  # once, not also in a list of saved files
    return urls.pop()


def chat_file(server: OpenWebUI, chat_id: str, name: str) -> Path:
    """The file in the chat's /mnt/data folder on the host (folders are named <chat id slug>-<hash>)."""
    found = list((server.sessions_root / "sessions").glob(f"*/{chat_id[:32]}-*/{name}"))
    assert len(found) == 1, found
    return found[0]


def attachments(account: Account, reply: Reply) -> list[dict]:
    """The files of the answer's message in the saved chat (what the page renders as attachments)."""
    messages = account.get(f"/api/v1/chats/{reply.chat_id}").json()["chat"]["history"]["messages"]
    return messages[reply.message_id].get("files") or []


def wait_for_messages(
    page: Page, ready: Locator, errors: list[str], console: list[str], tmp_path: Path
) -> None:
    try:
        ready.wait_for(timeout=30_000)
    except Exception:
        # Once in a full run the chat page came up without its messages (Open WebUI's page, not the
        # stored answer, which the HTTP tests check): keep what it showed, then load it once more.
        first_load = tmp_path / "first-load.png"
        page.screenshot(path=str(first_load))
        # A script error means our answer broke the page: that is a failure, never a reload.
        assert not errors, f"the chat page failed to render ({first_load}): {errors}"
        # Seen: SvelteKit's "500: Internal Error" page, every request of the page answered 200.
        said = "; ".join(console)[:1000]
        warnings.warn(f"the chat page needed a reload ({first_load}); console errors: {said}", stacklevel=1)
        page.reload()
    try:
        ready.wait_for(timeout=45_000)
    except Exception as error:
        shot = tmp_path / "failed.png"
        page.screenshot(path=str(shot))
        text = page.evaluate("document.body.innerText")[:2000]
        raise AssertionError(f"the answers did not render; page at {page.url} ({shot}):\n{text}") from error


def open_chat(page: Page, server: OpenWebUI, reply: Reply, ready: Locator, tmp_path: Path) -> list[str]:
    """Load the chat's page until `ready` shows; returns the list its script errors are collected in."""
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text) if message.type == "error" else None)
    page.goto(f"{server.url}/c/{reply.chat_id}")
    wait_for_messages(page, ready, errors, console, tmp_path)
    page.keyboard.press("Escape")  # the admin's "What's new" dialog, which covers the chat
    page.get_by_role("dialog").first.wait_for(state="detached", timeout=10_000)
    return errors


class Rendered:
    """One answer as the page renders it."""

    def __init__(self, page: Page, reply: Reply) -> None:
        self.message = page.locator(f"#message-{reply.message_id}")
        self.content = self.message.locator("#response-content-container")

    def text(self) -> str:
        """What a reader sees of the answer's text (a closed block shows its title only)."""
        return self.content.inner_text()

    def chips(self, name: str) -> int:
        """Attachments of the message shown with this name (outside the text)."""
        return self.message.locator("button", has_text=name).count()

    def status_lines(self) -> int:
        return self.message.locator(".status-description").count()


def assert_reads_cleanly(answer: Rendered, runs: str, files: dict[str, tuple[int, int]]) -> None:
    """One block for the answer's one run (its title matches `runs`), no status line left, and each file
    (name: times in the text, attachments) shown as often as expected."""
    text = answer.text()
    assert len(re.findall(runs, text)) == 1, text
    assert answer.status_lines() == 0, answer.message.inner_text()
    assert "Saved" not in text, text
    for name, (in_text, chips) in files.items():
        assert (text.count(name), answer.chips(name)) == (in_text, chips), (name, answer.message.inner_text())


def download_through_chip(
    page: Page, context: BrowserContext, answer: Rendered, name: str, url: str, data: bytes
) -> None:
    """What a user does: click the chip, then the file's name in the dialog it opens, which opens the
    Files API link in a new tab of the same browser (so with the cookie): the file downloads."""
    answer.message.locator("button", has_text=name).click()
    link = page.get_by_role("dialog").get_by_role("link", name=name)
    link.wait_for(timeout=30_000)
    assert link.get_attribute("href") == url
    assert link.get_attribute("target") == "_blank"
    with context.expect_page(), page.expect_download() as download:  # a new tab, which downloads
        link.click()
    assert download.value.url == page.url.split("/c/")[0] + url
    assert download.value.suggested_filename == name
    assert Path(download.value.path()).read_bytes() == data
    page.keyboard.press("Escape")


def keep_screenshot(
    page: Page, tmp_path: Path, name: str, *, scroll: bool = True, hover: Locator | None = None
) -> None:
    if scroll:
        page.evaluate("document.getElementById('messages-container')?.scrollTo(0, 0)")
    if hover is not None:
        hover_over(page, hover)
    page.wait_for_timeout(300)
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 10_000
    if os.environ.get("UPDATE_SCREENSHOTS"):
        target = REPO / "docs" / "images" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, target)


def test_the_demo_shows_each_run_once_and_each_file_once(
    browser: Browser, open_webui: OpenWebUI, tmp_path: Path
):
    admin = open_webui.admin
    first = admin.say("make a csv report")
    second = admin.say("plot it", previous=first)
    third = admin.say("zip both", previous=second)
    report_url = link_named(first, "report.csv")
    chart_url = link_named(second, "chart.png", image=True)
    bundle_url = link_named(third, "bundle.zip")
    report = chat_file(open_webui, first.chat_id, "report.csv").read_bytes()
    assert report.startswith(b"month,visitors")

    # What the page renders from: the saved chat. Each file the answer names is an attachment of its
    # message; the chart is not (it shows inline in the text: an attachment would show it twice).
    [item] = attachments(admin, first)
    assert item["type"] == "file" and item["name"] == "report.csv", item
    assert item["url"] == report_url and report_url == f"/api/v1/files/{item['id']}/content", item
    assert attachments(admin, second) == []
    assert [f["url"] for f in attachments(admin, third)] == [bundle_url]

    context = logged_in(browser, open_webui, admin, height=1620)
    page = context.new_page()
    one, two, three = Rendered(page, first), Rendered(page, second), Rendered(page, third)
    errors = open_chat(
        page, open_webui, first, three.message.locator("button", has_text="bundle.zip"), tmp_path
    )

    image = two.content.locator("img")
    image.first.wait_for(timeout=60_000)
    assert image.count() == 1 and image.get_attribute("src") == chart_url
    image.scroll_into_view_if_needed()
    # Loaded and decoded: the browser sent the cookie, Open WebUI answered with the PNG.
    loaded = "img => img.complete && img.naturalWidth > 0"
    page.wait_for_function(loaded, arg=image.element_handle(), timeout=30_000)

    finished = r"Python finished in [0-9.]+ m?s"
    # The chart's name is not shown at all: the picture is (an <img>'s alt is not text on the page).
    assert_reads_cleanly(one, finished, {"report.csv": (1, 1)})
    assert_reads_cleanly(two, finished, {"chart.png": (0, 0), "report.csv": (0, 0)})
    assert_reads_cleanly(three, finished, {"bundle.zip": (1, 1), "report.csv": (0, 0), "chart.png": (0, 0)})
    keep_screenshot(page, tmp_path, "chat.png")

    download_through_chip(page, context, one, "report.csv", report_url, report)
    assert not errors, errors
    context.close()


def test_a_run_stopped_by_a_limit_says_why_once_and_still_gives_the_file_it_wrote(
    browser: Browser, open_webui: OpenWebUI, tmp_path: Path
):
    admin = open_webui.admin
    open_webui.set_valves(timeout_seconds=3)
    try:
        reply = admin.say("run a long job")  # the demo model's job writes a row a second, for 10 minutes
    finally:
        open_webui.set_valves(timeout_seconds=20)
    why = "Why: interrupted after 3 s; the Python state is kept."
    assert reply.content.count(why) == 1, reply.content
    assert not reply.links()  # the model did not name progress.csv ...
    [item] = attachments(admin, reply)  # ... so it reaches the user as the message's attachment
    assert item["name"] == "progress.csv", item
    data = chat_file(open_webui, reply.chat_id, "progress.csv").read_bytes()
    assert data.startswith(b"step,seconds\r\n1,1\r\n2,2\r\n") and len(data.splitlines()) < 10, data

    context = logged_in(browser, open_webui, admin, height=560)
    page = context.new_page()
    answer = Rendered(page, reply)
    chip = answer.message.locator("button", has_text="progress.csv")
    errors = open_chat(page, open_webui, reply, chip, tmp_path)
    text = answer.text()
    assert text.count(why) == 1 and "progress.csv" not in text, text
    assert_reads_cleanly(
        answer, r"Python was stopped: time limit reached in [0-9.]+ s", {"progress.csv": (0, 1)}
    )
    keep_screenshot(page, tmp_path, "limit.png")

    download_through_chip(page, context, answer, "progress.csv", item["url"], data)
    assert not errors, errors
    context.close()


HOSTILE_ROWS = [
    ("name", "note", "score"),
    ("<script>alert(1)</script>", "a|b", 1),
    ('<img src=x onerror="alert(2)">', "[click](https://evil.example)", 2),
    ("~~~ fence", "line one\nline two", 3),  # a code fence (~~~ here: the demo model's block ends at ```)
    ("https://evil.example/x", "$x^2$ **bold**", 4),
    (r"\(512 MB\) C:\bin [1] [^2]", "&lt;b&gt; {{user}} www.evil.example", 5),
]
TABLES = f"""import csv
import pandas as pd
rows = [[str(cell).replace("~~~", "`" * 3) for cell in row] for row in {HOSTILE_ROWS!r}]
with open("/mnt/data/hostile.csv", "w", newline="") as handle:
    csv.writer(handle).writerows(rows)
pd.DataFrame({{"city": ["Oslo", "Lima", "Pune"], "people": [709000, 10092000, 7764000]}}).to_excel(
    "/mnt/data/cities.xlsx", index=False)
"""
CHART = """import plotly.graph_objects as go
fig = go.Figure(go.Scatter(x=[1, 2, 3, 4], y=[10, 30, 20, 40], mode="lines+markers", name="visits"))
fig.update_layout(title="Visits per week", xaxis_title="week", yaxis_title="visits")
fig.show()
"""


def code(source: str, reply: str) -> str:
    return f"```python\n{source}```\nreply: {reply}"


def preview_tables(answer: Rendered) -> Locator:
    return answer.content.locator("table")


def test_tables_show_a_preview_whose_hostile_cells_are_text(
    browser: Browser, open_webui: OpenWebUI, tmp_path: Path
):
    admin = open_webui.admin
    reply = say_streamed(admin, code(TABLES, "The tables: /mnt/data/hostile.csv and /mnt/data/cities.xlsx"))
    # In the saved message: after the answer's text, one preview per table, in the order linked.
    assert "_Preview 1 of 2 · 5 rows, 3 columns (name: text, note: text, score: int)_" in reply.content
    assert "_Preview 2 of 2 · 3 rows, 2 columns (city: text, people: int)_" in reply.content

    context = logged_in(browser, open_webui, admin, height=1100)
    page = context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    answer = Rendered(page, reply)
    errors = open_chat(page, open_webui, reply, preview_tables(answer).nth(1), tmp_path)
    hostile, cities = preview_tables(answer).nth(0), preview_tables(answer).nth(1)
    assert preview_tables(answer).count() == 2
    # Every hostile cell is its text: one row per record, no element made of a cell, nothing ran.
    assert hostile.locator("tr").count() == 1 + 5
    assert hostile.locator("a, img, script, strong, code, sup, .katex").count() == 0, hostile.inner_html()
    # (Word joiners keep brackets from being read as math or links: they show nothing.)
    cells = [c.replace("\u2060", "").strip() for c in hostile.locator("td").all_inner_texts()]
    assert cells == [
        "<script>alert(1)</script>",
        "a|b",
        "1",
        '<img src=x onerror="alert(2)">',
        "[click](https://evil.example)",
        "2",
        "``` fence",
        "line one\\nline two",
        "3",
        "https://evil.example/x",
        "$x^2$ **bold**",
        "4",
        r"\(512 MB\) C:\bin [1] [^2]",
        "&lt;b&gt; {{user}} www.evil.example",
        "5",
    ], cells
    headers = [h.strip() for h in hostile.locator("th").all_text_contents()]
    assert headers == ["name", "note", "score"], headers  # the data's own header: the types are above
    # The XLSX was read in the sandbox: its columns and types, its rows.
    assert [h.strip() for h in cities.locator("th").all_text_contents()] == ["city", "people"]
    assert cities.locator("tr").nth(2).inner_text().split() == ["Lima", "10092000"]
    # Each file once in the text (where the answer names it), once among the attachments.
    assert_reads_cleanly(
        answer, r"Python finished in [0-9.]+ m?s", {"hostile.csv": (1, 1), "cities.xlsx": (1, 1)}
    )
    hostile.scroll_into_view_if_needed()
    keep_screenshot(page, tmp_path, "previews.png", scroll=False)
    assert not dialogs and not errors, (dialogs, errors)
    context.close()


def test_a_plotly_chart_is_interactive_isolated_and_still_there_after_a_reload(
    browser: Browser, open_webui: OpenWebUI, tmp_path: Path
):
    admin = open_webui.admin
    reply = say_streamed(admin, code(CHART, "Here is the chart."))
    message = admin.get(f"/api/v1/chats/{reply.chat_id}").json()["chat"]["history"]["messages"]
    [embed] = message[reply.message_id]["embeds"]  # saved with the message: what a reload shows
    # plotly.js is not in it: the one script it loads is the sandbox environment's, from Open WebUI's own
    # route; nothing is fetched from anywhere else.
    assert len(embed) < 20_000, len(embed)
    [script] = re.findall(r"script\.src = &quot;(/code-sessions/plotly/[0-9a-f]{64}\.js)&quot;", embed)
    rest = embed.replace(script, "")
    assert not re.search(r"https?:|//|\b(?:src|href)=", rest), rest[:2000]

    context = logged_in(browser, open_webui, admin, height=900)
    page = context.new_page()
    answer = Rendered(page, reply)
    outer = answer.message.locator(f"[id='{reply.message_id}-embeds-container'] iframe")
    errors = open_chat(page, open_webui, reply, outer, tmp_path)
    chart = drawn_chart(outer)
    # The page holds the chart's trace, and a hover over a point shows its tooltip.
    assert chart.evaluate("() => document.getElementById('chart-0').data.length") == 1
    assert chart.evaluate("() => Array.from(document.getElementById('chart-0').data[0].y)") == [
        10,
        30,
        20,
        40,
    ]
    point = chart.locator(".scatterlayer .point").nth(2)
    hover_over(page, point)
    tooltip = chart.locator(".hoverlayer .hovertext")
    tooltip.first.wait_for(timeout=15_000)
    assert "20" in tooltip.first.text_content()
    # Its script is cut off from Open WebUI's page: an opaque origin, no parent document, no network
    # (not even Open WebUI's own server, which serves both of these to a plain page).
    assert admin.get("/api/v1/auths/").status_code == 200
    assert_isolated(chart)
    outer.scroll_into_view_if_needed()
    keep_screenshot(page, tmp_path, "interactive-chart.png", scroll=False, hover=point)
    # The static picture is in the run's block, for where embeds are not shown (a shared chat).
    answer.content.get_by_text(re.compile(r"Python finished in")).first.click()
    still = answer.content.locator("img")
    still.first.wait_for(timeout=30_000)
    assert still.count() == 1 and still.get_attribute("alt") == "chart-1.png"

    # Even with the user's "allow same origin" for iframes, the chart's own frame stays opaque.
    settings = admin.get("/api/v1/users/user/settings").json() or {}
    ui = {**(settings.get("ui") or {}), "iframeSandboxAllowSameOrigin": True}
    admin.post("/api/v1/users/user/settings/update", {**settings, "ui": ui}).raise_for_status()
    try:
        page.reload()
        wait_for_messages(page, outer, errors, [], tmp_path)
        assert "allow-same-origin" in (outer.get_attribute("sandbox") or "")
        chart = drawn_chart(outer)
        assert chart.evaluate("() => document.getElementById('chart-0').data.length") == 1
        assert_isolated(chart)
    finally:
        ui["iframeSandboxAllowSameOrigin"] = False
        admin.post("/api/v1/users/user/settings/update", {**settings, "ui": ui}).raise_for_status()
    assert not errors, errors
    context.close()

    # Shared with bob: Open WebUI 0.12.4 draws no embeds on a shared chat's page (read-only), so bob
    # sees the chart as its static picture, in the run's block.
    shared = admin.post(f"/api/v1/chats/{reply.chat_id}/share")
    assert shared.status_code == 200, shared.text
    bob = open_webui.accounts["bob"]
    grant = {
        "access_grants": [{"principal_type": "user", "principal_id": bob.user_id, "permission": "read"}],
        "share_mode": None,
    }
    admin.post(f"/api/v1/chats/shared/{reply.chat_id}/access/update", grant).raise_for_status()
    context = logged_in(browser, open_webui, bob, height=900)
    page = context.new_page()
    page.goto(f"{open_webui.url}/s/{shared.json()['share_id']}")
    block = page.get_by_text(re.compile(r"Python finished in")).first
    block.wait_for(timeout=60_000)
    assert page.locator("iframe").count() == 0
    block.click()
    still = page.locator("img[alt='chart-1.png']")
    still.wait_for(timeout=30_000)
    loaded = "img => img.complete && img.naturalWidth > 0"
    page.wait_for_function(loaded, arg=still.element_handle(), timeout=30_000)
    context.close()


# Hostile text in each place our sentences quote it (engine/markup.py). What Open WebUI's renderer
# would read in it: KaTeX (`$...$`, `\(...\)`, `\[...\]`, and its paragraph cut before `\b`, `\[`,
# `$$`), links, images, citations, footnotes, autolinks, HTML, emphasis, code, its `{{...}}` tokens,
# and inside a run's block, entities (`&#91;`), which its <details> decodes.
MATHS = r"$x$ (512 MB) \(y\) \[z\] C:\bin $$w$$"
LINKISH = "[1] [^1] [a](https:evil.example) ![i](https:evil.example) www.evil.example a@evil.example"
MARKUP = "<b>b</b> <img src=x onerror=alert(1)> &lt;i&gt; &#91;k&#93;(https:e.example) **s** _u_ `c` {{user}}"
# Chosen by the user, said back when it is refused. (No `/`: Open WebUI keeps what follows the last one.)
UPLOAD_NAME = f"{MATHS} {LINKISH} {MARKUP}.csv".replace("/", "")
LABEL = f"see {MATHS} <i>i</i> **s** http://evil.example [1] &lt;b&gt;"  # the model's text for a link
IN_PATH = r"$x$_\bin&lt;b&gt;~~s~~@a.co^1_www.e.co#!.txt"  # a name the model writes as a bare path
IN_CODE = r"a &#96;&#96;&#96; [x](https:evil.example) {{user}} $$ C:\bin.txt"  # a name made by code
OUTPUT = "&#96;&#96;&#96;\n<details>\n&#91;x&#93;(http://e.example) &#36;y&#36; {{user}}\n</details>\n&& done"
WRITE = f"""import pathlib
data = pathlib.Path("/mnt/data")
for name in ["ok.txt", "__init__.py", {IN_PATH!r}, {IN_CODE!r}]:
    (data / name).write_text("x")
print({OUTPUT!r})
"""
DELETE = f"""import os
for name in ["__init__.py", {IN_PATH!r}, {IN_CODE!r}]:
    os.remove("/mnt/data/" + name)
"""


def shown(locator: Locator) -> str:
    """A rendered element's text, without the invisible word joiners our escapes may add."""
    return locator.inner_text().replace("\u2060", "")


def test_hostile_text_in_our_sentences_shows_as_written(
    browser: Browser, open_webui: OpenWebUI, tmp_path: Path
):
    admin = open_webui.admin
    valves = open_webui.valves()
    upload = admin.upload(UPLOAD_NAME, b"n\n" + b"1\n" * 600_000)  # over the 1 MB per-file limit below
    open_webui.set_valves(max_file_mb=1)
    try:
        reply = f"Here: [{LABEL}](/mnt/data/ok.txt) and /mnt/data/{IN_PATH} done."
        first = say_streamed(admin, code(WRITE, reply), files=[upload])
    finally:  # the valves as they were (the endpoint replaces them all)
        restored = open_webui.admin_http.post(f"/api/v1/functions/id/{FUNCTION_ID}/valves/update", valves)
        restored.raise_for_status()
    second = say_streamed(admin, code(DELETE, "Removed them."), previous=first)
    for answer in (first, second):
        assert answer.content.count("Python finished in") == 1, answer.content

    context = logged_in(browser, open_webui, admin, height=1400)
    page = context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    one, two = Rendered(page, first), Rendered(page, second)
    errors = open_chat(page, open_webui, first, two.content.get_by_text("Removed them."), tmp_path)
    for answer in (one, two):  # the run's block open, as a reader opens it
        answer.content.get_by_text(re.compile(r"Python finished in")).first.click()
    one.content.locator(".cm-content").nth(1).wait_for(timeout=30_000)
    two.content.get_by_text(re.compile("^Deleted:")).wait_for(timeout=30_000)

    # The attachment's name, in the sentence that says why it was not copied: every character as is.
    refused = one.content.locator("p", has_text="was not copied into /mnt/data")
    assert shown(refused).startswith(f"The attachment {UPLOAD_NAME} was not copied into /mnt/data: "), (
        refused.inner_html()
    )
    # The model's text for a link, and a name it wrote as a bare path: the texts of the two links.
    links = one.content.locator("a")
    assert [shown(links.nth(i)) for i in range(links.count())] == [LABEL, IN_PATH], one.content.inner_html()
    assert all(LINK.fullmatch(links.nth(i).get_attribute("href") or "") for i in range(links.count()))
    # In the run's block: the code and its output as written (Open WebUI decodes entities there).
    code_shown = [shown(block) for block in one.content.locator(".cm-content").all()]
    assert code_shown == [WRITE.rstrip(), OUTPUT], code_shown
    # ... and the names the next run deleted (a name read as markup if bare is shown as code).
    deleted = two.content.get_by_text(re.compile("^Deleted:"))
    names = ", ".join("/mnt/data/" + name for name in sorted(["__init__.py", IN_PATH, IN_CODE]))
    assert shown(deleted) == f"Deleted: {names}", deleted.inner_html()

    # Nothing became math, a link elsewhere, a picture, HTML, emphasis or a page of a file.
    for answer in (one, two):
        made = answer.content.locator(
            ".katex, img, sup, script, iframe, video, strong, del, b, i, "
            "a[href*='example'], a[href^='mailto'], a[href*='www']"
        )
        assert made.count() == 0, answer.content.inner_html()
    assert "admin" not in one.content.inner_text()  # `{{user}}` was not replaced by the user's name
    assert not dialogs and not errors, (dialogs, errors)
    context.close()


def hover_over(page: Page, target: Locator) -> None:
    """The mouse over the middle of `target`, as a user moves it (plotly's drag layer lies on top of
    its points, so only the pointer's position, not an element, gets the hover)."""
    box = target.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2 - 5, box["y"] + box["height"] / 2 - 5)
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2, steps=5)


def drawn_chart(outer: Locator) -> Frame:
    """The chart's own frame (inside the embed's), once plotly.js has drawn it."""
    outer.scroll_into_view_if_needed()
    frame = outer.element_handle(timeout=30_000).content_frame()
    assert frame is not None
    inner = frame.locator("iframe").element_handle(timeout=30_000).content_frame()
    assert inner is not None
    inner.wait_for_function("() => document.querySelector('#chart-0 .main-svg') !== null", timeout=60_000)
    return inner


def assert_isolated(chart: Frame) -> None:
    assert chart.evaluate("() => window.origin") == "null"
    reach = (
        "() => { try { return parent.document.cookie + top.localStorage.getItem('token') }"
        " catch (e) { return 'blocked' } }"
    )
    assert chart.evaluate(reach) == "blocked"
    fetched = "() => fetch('/api/v1/auths/').then(() => 'fetched', () => 'blocked')"
    assert chart.evaluate(fetched) == "blocked"
    image = (
        "() => new Promise(done => { const i = new Image(); i.onload = () => done('loaded');"
        " i.onerror = () => done('blocked'); i.src = '/favicon.png'; })"
    )
    assert chart.evaluate(image) == "blocked"
