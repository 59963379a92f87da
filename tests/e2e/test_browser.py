"""The real Open WebUI page in headless Chromium: the chart shows inline, the CSV is a file chip under the
answer, and the chip's link, opened in a new tab, downloads the report.

Its screenshot is the README's picture: with UPDATE_SCREENSHOTS=1 set, it is written to docs/images/chat.png
(`UPDATE_SCREENSHOTS=1 ./scripts/test tests/e2e/test_browser.py`).
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Locator, Page

from tests.support.open_webui import LINK, Account, OpenWebUI, Reply

pytestmark = [pytest.mark.e2e, pytest.mark.runsc, pytest.mark.browser]

REPO = Path(__file__).resolve().parents[2]


def logged_in(browser: Browser, server: OpenWebUI, account: Account) -> BrowserContext:
    """A browser session of the user as Open WebUI's own login leaves it: the token in localStorage (what
    the app's API calls send) and the `token` cookie (what an <img> or a new tab sends to the Files API)."""
    context = browser.new_context(viewport={"width": 1200, "height": 1250}, accept_downloads=True)
    context.add_cookies([{"name": "token", "value": account.token, "url": server.url}])
    context.add_init_script(
        f"localStorage.setItem('token', {account.token!r}); localStorage.setItem('version', '0.12.4');"
    )
    return context


def link_named(reply: Reply, name: str, image: bool = False) -> str:
    """The one Files API URL the answer links (or, with image=True, shows) under this name."""
    pattern = ("!" if image else r"(?<!!)") + r"\[" + re.escape(name) + r"\]\((" + LINK.pattern + r")\)"
    urls = set(re.findall(pattern, reply.content))
    assert len(urls) == 1, (name, reply.content)
    return urls.pop()


def chat_file(server: OpenWebUI, chat_id: str, name: str) -> Path:
    """The file in the chat's /mnt/data folder on the host (folders are named <chat id slug>-<hash>)."""
    found = list((server.sessions_root / "sessions").glob(f"*/{chat_id[:32]}-*/{name}"))
    assert len(found) == 1, found
    return found[0]


def wait_for_messages(
    page: Page, chip: Locator, errors: list[str], console: list[str], tmp_path: Path
) -> None:
    try:
        chip.wait_for(timeout=30_000)
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
        chip.wait_for(timeout=45_000)
    except Exception as error:
        shot = tmp_path / "failed.png"
        page.screenshot(path=str(shot))
        text = page.evaluate("document.body.innerText")[:2000]
        raise AssertionError(f"no report.csv chip; page at {page.url} ({shot}):\n{text}") from error


def test_a_chat_shows_its_chart_inline_and_its_csv_as_a_chip_that_downloads(
    browser: Browser, open_webui: OpenWebUI, tmp_path: Path
):
    admin = open_webui.admin
    first = admin.say("make a csv report of visitors per month")
    second = admin.say("now plot it as a chart", previous=first)
    report_url = link_named(first, "report.csv")
    chart_url = link_named(second, "chart.png", image=True)
    report = chat_file(open_webui, first.chat_id, "report.csv").read_bytes()
    assert report.startswith(b"month,visitors")

    # What the page renders from: the saved chat. The CSV is a file of its answer; the chart is not (it
    # shows inline in the text, a chip would show it twice).
    messages = admin.get(f"/api/v1/chats/{first.chat_id}").json()["chat"]["history"]["messages"]
    [item] = messages[first.message_id]["files"]
    assert item["type"] == "file" and item["name"] == "report.csv", item
    assert item["url"] == report_url and report_url == f"/api/v1/files/{item['id']}/content", item
    assert not [f for f in messages[second.message_id].get("files") or [] if f.get("url") == chart_url]

    context = logged_in(browser, open_webui, admin)
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    console: list[str] = []
    page.on("console", lambda message: console.append(message.text) if message.type == "error" else None)
    page.goto(f"{open_webui.url}/c/{first.chat_id}")
    answer = page.locator(f"#message-{first.message_id}")
    # The chip: a FileItem button under the answer, outside its text (which links report.csv too).
    chip = answer.locator("button", has_text="report.csv")
    wait_for_messages(page, chip, page_errors, console, tmp_path)
    assert chip.count() == 1
    assert answer.locator(f'#response-content-container a[href="{report_url}"]').count() >= 1

    image = page.locator(f"#message-{second.message_id} #response-content-container img").first
    image.wait_for(timeout=60_000)
    assert image.get_attribute("src") == chart_url and LINK.fullmatch(chart_url)
    page.keyboard.press("Escape")  # the admin's "What's new" dialog, which covers the chat
    page.get_by_role("dialog").first.wait_for(state="detached", timeout=10_000)
    image.scroll_into_view_if_needed()
    # Loaded and decoded: the browser sent the cookie, Open WebUI answered with the PNG.
    loaded = "img => img.complete && img.naturalWidth > 0"
    page.wait_for_function(loaded, arg=image.element_handle(), timeout=30_000)

    page.evaluate("document.getElementById('messages-container')?.scrollTo(0, 0)")
    page.wait_for_timeout(300)
    shot = tmp_path / "chat.png"
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 10_000
    if os.environ.get("UPDATE_SCREENSHOTS"):
        target = REPO / "docs" / "images" / "chat.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, target)

    # What a user does: click the chip, then the file's name in the dialog it opens, which opens the
    # Files API link in a new tab of the same browser (so with the cookie): the report downloads.
    chip.click()
    name = page.get_by_role("dialog").get_by_role("link", name="report.csv")
    name.wait_for(timeout=30_000)
    assert name.get_attribute("href") == report_url
    assert name.get_attribute("target") == "_blank"
    with context.expect_page(), page.expect_download() as download:  # a new tab, which downloads
        name.click()
    assert download.value.url == open_webui.url + report_url
    assert download.value.suggested_filename == "report.csv"
    assert Path(download.value.path()).read_bytes() == report
    assert not page_errors, page_errors
    context.close()
