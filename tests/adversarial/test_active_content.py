"""Active content: a published .html or .svg must not run script in Open WebUI's origin, nor may file names.

Open WebUI serves /cache/ to any logged-in user, image/* inline (SVG included) and everything else as an
attachment. A script running there would act as the logged-in user (its token is in localStorage). The
browser is real (headless Chromium), logged in like a user, and a listener on 127.0.0.1 catches any call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from playwright.sync_api import Browser, BrowserContext, Error

from tests.support.open_webui import Account, OpenWebUI

pytestmark = [pytest.mark.e2e, pytest.mark.runsc, pytest.mark.browser]


class Listener:
    """Records every request a script in the page manages to make."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(204)
                self.send_header("Access-Control-Allow-Origin", "*")
                self.end_headers()

            do_POST = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    found = Listener()
    yield found
    found.server.shutdown()


def logged_in(browser: Browser, server: OpenWebUI, account: Account) -> BrowserContext:
    """A browser session of the user: the `token` cookie (sent to /cache) and localStorage (the app)."""
    context = browser.new_context(accept_downloads=True)
    context.add_cookies([{"name": "token", "value": account.token, "url": server.url}])
    context.add_init_script(f"localStorage.setItem('token', {account.token!r})")
    return context


def payloads(listener: Listener) -> dict[str, str]:
    script = f"document.title='pwned';fetch('{listener.url}/ran');alert('pwned')"
    return {
        "page.html": f'<html><body><script>{script}</script><img src=x onerror="{script}"></body></html>',
        "logo.svg": (
            '<svg xmlns="http://www.w3.org/2000/svg" onload="' + script.replace("'", "&apos;") + '">'
            f"<script>{script}</script><circle r='5'/></svg>"
        ),
        "page.xhtml": f'<html xmlns="http://www.w3.org/1999/xhtml"><script>{script}</script></html>',
        "pic.png": f"<html><script>{script}</script></html>",  # HTML behind an image name: no sniffing
    }


@pytest.fixture(scope="module")
def hostile_answer(open_webui: OpenWebUI, listener: Listener):
    files = payloads(listener)
    names = ["<img src=x onerror=alert(document.domain)>.txt", "<svg onload=alert(1)>.csv"]
    make = "files = " + repr(files) + "\nfor name, text in files.items():\n    open(name, 'w').write(text)\n"
    make += "for name in " + repr(names) + ":\n    open(name, 'w').write('x')\n"
    reply = (
        "Page: /mnt/data/page.html Logo: ![logo](/mnt/data/logo.svg) "
        "Doc: /mnt/data/page.xhtml Pic: ![pic](/mnt/data/pic.png)"
    )
    return open_webui.admin.say(f"```python\n{make}```\nreply: {reply}")


def test_active_files_are_served_as_downloads_that_cannot_sniff(open_webui: OpenWebUI, hostile_answer):
    """Naive: logo.svg is published under its own name, so Open WebUI serves it inline as image/svg+xml."""
    content = hostile_answer.content
    assert "![logo]" not in content  # an SVG is never shown inline
    reply = content.splitlines()[-1]
    urls = dict(zip(["page", "logo", "doc", "pic"], reply.split("](")[1:], strict=True))
    urls = {key: value.split(")")[0] for key, value in urls.items()}
    assert urls["logo"].endswith("/logo.svg.txt")
    for key, url in urls.items():
        response = open_webui.admin.download(url)
        assert response.status_code == 200
        assert response.headers["x-content-type-options"] == "nosniff"
        kind = response.headers["content-type"]
        if key == "pic":
            assert kind == "image/png"  # inline, but nosniff: never parsed as HTML
        else:
            assert "attachment" in response.headers.get("content-disposition", ""), key
            assert not kind.startswith(("image/", "audio/", "video/")), (key, kind)


def test_opening_the_links_runs_no_script(browser: Browser, open_webui: OpenWebUI, hostile_answer, listener):
    """Naive: the browser navigates to the published page and its script runs with the user's token."""
    context = logged_in(browser, open_webui, open_webui.admin)
    page = context.new_page()
    dialogs: list[str] = []
    downloads: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.on("download", lambda download: downloads.append(download.suggested_filename))
    for url in hostile_answer.links()[-4:]:
        try:
            page.goto(open_webui.url + url, wait_until="load", timeout=15_000)
        except Error as error:  # an attachment: Chromium downloads it instead of opening it
            assert "Download is starting" in str(error) or "ERR_ABORTED" in str(error), error
        page.wait_for_timeout(500)
        assert page.title() != "pwned"
    assert len(downloads) == 3  # page.html, logo.svg.txt, page.xhtml
    assert dialogs == [] and listener.hits == []
    context.close()


def test_the_chat_page_shows_hostile_names_as_text(
    browser: Browser, open_webui: OpenWebUI, hostile_answer, listener
):
    """Naive: a file named <img onerror=...> is pasted into the answer's markdown and runs in the chat."""
    context = logged_in(browser, open_webui, open_webui.admin)
    page = context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(f"{open_webui.url}/c/{hostile_answer.chat_id}")
    page.get_by_text("onerror=alert(document.domain)", exact=False).first.wait_for(timeout=60_000)
    page.wait_for_timeout(500)
    assert dialogs == [] and listener.hits == []
    assert page.title() != "pwned"
    context.close()
