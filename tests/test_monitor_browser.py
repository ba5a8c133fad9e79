"""The monitor's page in a real headless Chromium, driven over the DevTools protocol.

A small swarm on 127.0.0.1 (a bootstrap node, two servers keeping their records alive with
`BlockAnnouncer`, the monitor's client node) is served by the real app; Chromium loads the
page and the test reads the DOM: no console error or exception, the model and its coverage
bar are shown, the page stays inside a phone-width screen, and after a server leaves the
page updates itself (no reload) with its blocks red. Screenshots are kept as artifacts
(``DISTCONF_TEST_ARTIFACTS`` names the folder; default: pytest's temporary folder).

Needs Debian's ``chromium`` package (``apt-get install -y chromium``) and the ``websockets``
client; without them the test is skipped saying so. Every wait is bounded.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import time
import urllib.request
from functools import partial
from pathlib import Path

import pytest
from dhthelpers import wait_for
from swarm_harness import Swarm
from test_monitor import HOSTILE_NAME, model, start_monitor

from distconf.client.verify_events import VerificationEvent
from distconf.dht import BlockAnnouncer, ServerInfo, ServerState
from distconf.dht.reports import ReportPublisher

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PREFIX = "monitor-browser-hf"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-dev-shm-usage", "--remote-debugging-port=0",
         "--remote-debugging-address=127.0.0.1", "--remote-allow-origins=*", "--window-size=1100,900"]

pytestmark = [pytest.mark.swarm, pytest.mark.skipif(
    CHROMIUM is None, reason="needs a headless Chromium: install Debian's package with `apt-get install -y chromium`")]
websockets_sync = pytest.importorskip(
    "websockets.sync.client", reason="needs the websockets client: `pip install 'websockets>=13'`")


class DevTools:
    """A minimal DevTools-protocol client for one page (calls in order, events collected)."""

    def __init__(self, ws_url: str, timeout: float = 30.0) -> None:
        self.ws = websockets_sync.connect(ws_url, open_timeout=timeout, max_size=64 * 2**20)
        self.timeout = timeout
        self.ids = itertools.count(1)
        self.events: list[dict] = []

    def call(self, method: str, **params) -> dict:
        """Send one command and return its result (events arriving meanwhile are kept)."""
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)

    def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def poll(self, timeout: float = 5.0) -> None:
        """Collect the events that arrive within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.events.append(json.loads(self.ws.recv(timeout=max(0.05, deadline - time.monotonic()))))
            except TimeoutError:
                return

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads seen so far."""
        found = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(f"exception: {params['exceptionDetails'].get('text')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(f"console.{params['type']}: {params.get('args')}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                found.append(f"log: {params['entry'].get('text')} {params['entry'].get('url', '')}")
        return found

    def screenshot(self, path: Path) -> Path:
        """Save a PNG of the whole page."""
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        """Close the websocket."""
        self.ws.close()


@pytest.fixture
def browser(tmp_path):
    """A headless Chromium with a fresh profile; yields a `DevTools` client for its page."""
    profile = tmp_path / "profile"
    proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tools = None
    try:
        port_file = profile / "DevToolsActivePort"
        assert wait_for(lambda: port_file.exists() and port_file.read_text().strip(), timeout=60), \
            f"chromium did not open its DevTools port: {proc.poll()=}"
        port = int(port_file.read_text().split()[0])

        def page_target():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
                return next((t for t in json.load(response) if t.get("type") == "page"), None)

        target = wait_for(page_target, timeout=30)
        assert target, "chromium shows no page"
        tools = DevTools(target["webSocketDebuggerUrl"])
        for domain in ("Runtime", "Log", "Page"):
            tools.call(f"{domain}.enable")
        yield tools
    finally:
        if tools is not None:
            tools.close()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


@pytest.fixture
def small_swarm():
    """``(url, announcers, client node, server nodes)``: two servers (blocks 0..7, 6..11), the monitor served."""
    announcers = []
    with Swarm() as s:
        a, b = s.node(), s.node()
        client = s.node(client_mode=True)
        cfg = model(PREFIX, 12)
        for dht, span, rps, name, relayed in ((a, (0, 8), 12.5, HOSTILE_NAME, False), (b, (6, 12), 7.0, "beta", True)):
            announcer = BlockAnnouncer(dht, cfg, *span, ServerInfo(
                state=ServerState.ONLINE, throughput=rps, public_name=name, cache_tokens_left=65536,
                torch_dtype="bfloat16", version="2.3.0", using_relay=relayed), update_period=30.0)
            s.on_close(partial(announcer.stop, offline=False))
            announcer.start()
            announcers.append(announcer)
        running = start_monitor(client)[1]
        s.on_close(running.stop)
        yield running.url, announcers, client, (a, b)


def artifacts_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("DISTCONF_TEST_ARTIFACTS") or tmp_path / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


BAR = f"document.querySelector('section.model[data-prefix=\"{PREFIX}\"] .bar')"
CLASSES = f"(() => {{ const b = {BAR}; return b ? [...b.children].map(s => s.className) : null; }})()"


def test_page_shows_the_swarm_and_updates_when_a_server_leaves(browser, small_swarm, tmp_path):
    url, announcers, *_ = small_swarm
    browser.call("Page.navigate", url=url + "/")
    full = ["cov-1"] * 6 + ["cov-2"] * 2 + ["cov-1"] * 4
    assert wait_for(lambda: browser.evaluate(CLASSES) == full, timeout=60), browser.evaluate(CLASSES)
    assert browser.evaluate("document.querySelector('section.model h2').textContent") == PREFIX
    assert browser.evaluate("document.querySelectorAll('section.model tbody tr').length") == 2
    # a hostile public name is shown as text: no element is made of it, nothing runs
    assert browser.evaluate("document.querySelector('section.model tbody td.name').textContent") == HOSTILE_NAME
    # how peers reach each server: directly, or through a relay (Petals' using_relay)
    reached = "[...document.querySelectorAll('section.model tbody td.reached')].map(td => td.textContent)"
    assert sorted(browser.evaluate(reached)) == ["direct", "relay"]
    assert browser.evaluate("document.querySelectorAll('main img').length") == 0
    assert browser.evaluate("document.title") == "distconf swarm monitor"
    assert "full route" in browser.evaluate("document.querySelector('.route').textContent")
    assert browser.evaluate("document.getElementById('status').textContent").startswith("read ")
    folder = artifacts_dir(tmp_path)
    shot = browser.screenshot(folder / "monitor.png")
    print(f"screenshot: {shot}")

    # phone width: nothing sticks out of the screen (the server table scrolls inside its box)
    browser.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=1, mobile=True)
    assert wait_for(lambda: browser.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), 10)
    print(f"screenshot: {browser.screenshot(folder / 'monitor-phone.png')}")
    browser.call("Emulation.clearDeviceMetricsOverride")

    # the second server leaves: the page updates in place, its blocks turn red
    browser.evaluate("window.sameDocument = true")
    updates = int(browser.evaluate("document.body.dataset.updates"))
    announcers[1].stop()
    left = ["cov-1"] * 8 + ["cov-0"] * 4
    assert wait_for(lambda: browser.evaluate(CLASSES) == left, timeout=60), browser.evaluate(CLASSES)
    assert int(browser.evaluate("document.body.dataset.updates")) > updates
    assert browser.evaluate("window.sameDocument === true")  # updated in place, not reloaded
    assert "no full route" in browser.evaluate("document.querySelector('.route').textContent")
    print(f"screenshot: {browser.screenshot(folder / 'monitor-after-leave.png')}")
    browser.poll(1.0)
    assert browser.errors() == []


CAUGHT = f"document.querySelector('section.model[data-prefix=\"{PREFIX}\"] table.caught')"


def test_page_shows_servers_clients_caught_as_claims(browser, small_swarm, tmp_path):
    """A client's report of a caught server appears in the "Caught by clients" table, labelled as a claim."""
    url, _, client, servers = small_swarm
    liar = servers[1].peer_id.to_base58()
    publisher = ReportPublisher(client, PREFIX, 12)
    publisher(VerificationEvent(peer_id=liar, start=6, end=12, step=2, position=4, difference=float("inf"),
                                tolerance=0.01, checkers=(servers[0].peer_id.to_base58(),)))
    assert publisher.flush(30.0)
    browser.call("Page.navigate", url=url + "/")
    rows = f"(() => {{ const t = {CAUGHT}; return t ? [...t.querySelectorAll('tbody tr')].map(r => " \
           "[...r.children].map(c => c.textContent)) : null; })()"
    shown = wait_for(lambda: browser.evaluate(rows), timeout=60)
    assert shown, "the page never showed the caught server"
    assert shown[0][:3] == [".." + liar[-8:], "6..11", "1"] and shown[0][4] == "non-finite"
    section = f"document.querySelector('section.model[data-prefix=\"{PREFIX}\"]')"
    assert browser.evaluate(f"{section}.querySelector('h3').textContent") == "Caught by clients"
    assert "Client claims" in browser.evaluate(f"{section}.querySelector('p.claim').textContent")
    # the server table is still the first table of the section
    assert browser.evaluate(f"{section}.querySelectorAll('table')[0].classList.contains('caught')") is False
    browser.call("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=1, mobile=True)
    assert wait_for(lambda: browser.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1"), 10)
    print(f"screenshot: {browser.screenshot(artifacts_dir(tmp_path) / 'monitor-caught-phone.png')}")
    browser.call("Emulation.clearDeviceMetricsOverride")
    assert browser.errors() == []
