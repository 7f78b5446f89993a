"""The sharding notebook in a real JupyterLab, driven by headless Chromium.

JupyterLab runs on 127.0.0.1; Playwright drives Debian's Chromium (no browser download).
The test runs every cell, checks the widget's blocks and the chart in the page, checks that
the page fetched nothing from outside this machine, and saves a screenshot.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NOTEBOOK = Path(__file__).parents[2] / "notebooks" / "02-mesh-and-sharding.ipynb"
ARTIFACTS = Path(os.environ.get("MESHLAB_ARTIFACTS", Path(__file__).parents[2] / "artifacts"))

pytestmark = [pytest.mark.browser, pytest.mark.skipif(
    not Path(CHROMIUM).exists() and not os.environ.get("CI"),
    reason="needs Debian's chromium (apt-get install chromium); CI installs it")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A JupyterLab server on loopback serving a copy of the notebook; yields its base URL."""
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    port, token = free_port(), secrets.token_hex(16)
    settings = tmp_path_factory.mktemp("lab-settings")
    for plugin, value in {
        # draw every cell, not only those on screen, so outputs can be found in the DOM
        "notebook-extension/tracker": '{"windowingMode": "none"}',
        "apputils-extension/notification": '{"fetchNews": "false"}',
    }.items():
        path = settings / f"@jupyterlab/{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value)
    log = (root / "jupyterlab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
         "--ip=127.0.0.1", f"--port={port}", f"--ServerApp.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings)})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("JupyterLab did not start:\n" +
                                   (root / "jupyterlab.log").read_text()[-3000:]) from None
            time.sleep(0.5)
    yield f"{base}|{token}"
    server.terminate()
    try:
        server.wait(20)
    except subprocess.TimeoutExpired:
        server.kill()


def accept_dialogs(page: Any) -> None:
    """Press the default button of any JupyterLab dialog (the kernel chooser, say)."""
    for button in page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").all():
        button.click()


def test_sharding_widget_and_chart_render_in_jupyterlab_offline(jupyterlab: str) -> None:
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab.split("|")
    requests: list[str] = []
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("request", lambda request: requests.append(request.url))
        page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
        page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')",
                               timeout=60_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                               timeout=60_000)
        page.wait_for_timeout(2000)
        accept_dialogs(page)  # JupyterLab sometimes asks which kernel, even with one running
        # not awaited: the command's promise settles late, the page tells us when cells ran
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        chart_selector = ".jp-RenderedSVG img[src^='data:image/svg+xml']"
        deadline = time.monotonic() + 240
        # the chart comes from the second-to-last cell: once it shows, the cells before ran
        while not page.locator(chart_selector).count():
            accept_dialogs(page)
            if time.monotonic() > deadline:
                page.screenshot(path=str(ARTIFACTS / "browser-failure.png"), full_page=True)
                raise AssertionError("the notebook did not finish in JupyterLab within 240 s; "
                                     "see artifacts/browser-failure.png")
            page.wait_for_timeout(500)
        first = page.locator(".meshlab-sharding").first
        first.scroll_into_view_if_needed()
        blocks = first.locator(".meshlab-block")
        assert blocks.count() == 4
        assert sorted(blocks.nth(i).get_attribute("data-ranks") for i in range(4)) == \
            ["0", "1", "2", "3"]
        # rank 1 holds rows 0-3 and columns 3-5: top right of the 8 x 6 tensor
        box0, box1 = blocks.nth(0).bounding_box(), blocks.nth(1).bounding_box()
        assert box0 and box1 and box1["x"] > box0["x"] and abs(box1["y"] - box0["y"]) < 1
        blocks.nth(1).hover()
        assert "rank 1 at [0,1]: local [4,3] from offset [0,3]" in \
            first.locator(".meshlab-detail").inner_text()
        page.screenshot(path=str(ARTIFACTS / "jupyterlab.png"))
        first.screenshot(path=str(ARTIFACTS / "sharding-widget.png"))

        # the module table: clicking a parameter draws it
        module = page.locator(".meshlab-sharding", has=page.locator(".meshlab-params")).first
        module.scroll_into_view_if_needed()
        module.locator("tr.meshlab-param").nth(2).click()
        page.wait_for_function(
            "[...document.querySelectorAll('.meshlab-caption')].some(c => "
            "c.textContent.startsWith('2.weight'))", timeout=30_000)
        module.screenshot(path=str(ARTIFACTS / "sharding-module.png"))

        chart = page.locator(chart_selector).last
        chart.scroll_into_view_if_needed()
        assert chart.is_visible()
        chart.screenshot(path=str(ARTIFACTS / "comms-chart.png"))
        browser.close()
    outside = [u for u in requests if not u.startswith((base, "data:", "blob:", "about:"))]
    assert outside == [], f"the page fetched from outside this machine: {outside[:5]}"
