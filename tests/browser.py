"""The chat page in a real headless Chromium (Debian's), driven through Playwright."""
from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from scripted import serving

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (requirements-dev.txt)")

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 30_000  # how long a condition may take to become true; never a measured time


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: `make test` installs Debian's chromium package as root")
    with sync_api.sync_playwright() as p:
        # launch() gives the browser a new empty profile directory, removed on close.
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield b
        b.close()


class Page:
    """A fresh browser context (empty localStorage) on one server, recording page errors."""

    def __init__(self, browser, port: int):
        self.port = port
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)

    def open(self) -> "Page":
        self.page.goto(f"http://127.0.0.1:{self.port}/")
        return self.loaded()

    def loaded(self) -> "Page":
        self.page.wait_for_selector("#stat-model-id")
        return self

    def last(self, selector: str):
        """The last element matching: the latest message, when several match."""
        return self.page.locator(selector).last

    def text(self, selector: str) -> str:
        return self.last(selector).inner_text()

    def send(self, text: str) -> None:
        self.page.fill("#input", text)
        self.page.press("#input", "Enter")

    def ask(self, text: str) -> None:
        """Send, and wait for the whole reply."""
        self.send(text)
        self.wait_state("^done")

    # The page's policy forbids eval, which wait_for_function's polling needs: waits go through expect().
    def wait_state(self, pattern: str) -> None:
        sync_api.expect(self.page.locator("#state")).to_have_text(re.compile(pattern), timeout=WAIT_MS)

    def wait_text(self, selector: str, pattern: str) -> None:
        sync_api.expect(self.last(selector)).to_have_text(re.compile(pattern), timeout=WAIT_MS)

    def wait_count(self, selector: str, n: int) -> None:
        sync_api.expect(self.page.locator(selector)).to_have_count(n, timeout=WAIT_MS)

    def wait_visible(self, selector: str) -> None:
        sync_api.expect(self.page.locator(selector)).to_be_visible(timeout=WAIT_MS)

    def close(self) -> None:
        self.context.close()


@contextmanager
def page_on(browser, service, **server_options) -> Iterator[Page]:
    with serving(service, **server_options) as srv:
        page = Page(browser, srv.port)
        try:
            yield page
        finally:
            page.close()
