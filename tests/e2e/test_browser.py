"""The real Open WebUI page in headless Chromium: the answer renders with a working link and an inline image.

Its screenshot is the README's picture: with UPDATE_SCREENSHOTS=1 set, it is written to docs/images/chat.png
(`UPDATE_SCREENSHOTS=1 ./scripts/test tests/e2e/test_browser.py`).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page

from tests.support.open_webui import Account, OpenWebUI

pytestmark = [pytest.mark.e2e, pytest.mark.runsc, pytest.mark.browser]

REPO = Path(__file__).resolve().parents[2]


def logged_in_page(browser: Browser, server: OpenWebUI, account: Account) -> Page:
    page = browser.new_page(viewport={"width": 1200, "height": 1250})
    page.goto(server.url + "/auth")
    page.evaluate(
        "([token]) => { localStorage.setItem('token', token); localStorage.setItem('version', '0.12.4'); }",
        [account.token],
    )
    return page


def test_a_chat_renders_its_download_link_and_inline_image(browser: Browser, open_webui: OpenWebUI, tmp_path):
    admin = open_webui.admin
    first = admin.say("make a csv report of visitors per month")
    second = admin.say("now plot it as a chart", previous=first)
    assert "![chart.png](/cache/" in second.content

    page = logged_in_page(browser, open_webui, admin)
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    page.goto(f"{open_webui.url}/c/{first.chat_id}")
    link = page.locator('a[href*="/cache/functions/code_sessions/"]', has_text="report.csv").first
    try:
        link.wait_for(timeout=30_000)
    except Exception:
        # Once in a full run the chat page came up without its messages (Open WebUI's page, not the
        # stored answer, which the HTTP tests check): keep what it showed, then load it once more.
        first_load = tmp_path / "first-load.png"
        page.screenshot(path=str(first_load))
        # A script error means our answer broke the page: that is a failure, never a reload.
        assert not page_errors, f"the chat page failed to render ({first_load}): {page_errors}"
        warnings.warn(f"the chat page needed a reload; first load: {first_load}", stacklevel=1)
        page.reload()
    try:
        link.wait_for(timeout=45_000)
    except Exception as error:
        shot = tmp_path / "failed.png"
        page.screenshot(path=str(shot))
        text = page.evaluate("document.body.innerText")[:2000]
        raise AssertionError(f"no report.csv link; page at {page.url} ({shot}):\n{text}") from error
    image = page.locator('img[src*="/cache/functions/code_sessions/"]').first
    image.wait_for(timeout=60_000)
    page.keyboard.press("Escape")  # any welcome dialog
    image.scroll_into_view_if_needed()
    loaded = "img => img.complete && img.naturalWidth > 0"
    page.wait_for_function(loaded, arg=image.element_handle(), timeout=30_000)

    # The link works from the page itself, with the browser's own session (the `token` cookie/header).
    href = link.get_attribute("href")
    auth = "{headers: {Authorization: 'Bearer ' + localStorage.token}}"
    fetch = f"async (href) => (await fetch(href, {auth})).status"
    assert page.evaluate(fetch, href) == 200

    page.evaluate("document.getElementById('messages-container')?.scrollTo(0, 0)")
    page.wait_for_timeout(300)
    shot = tmp_path / "chat.png"
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 10_000
    if os.environ.get("UPDATE_SCREENSHOTS"):
        target = REPO / "docs" / "images" / "chat.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, target)
    page.close()
