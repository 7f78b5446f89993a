"""The tour's notebooks in a real JupyterLab, driven by headless Chromium.

JupyterLab runs on 127.0.0.1; Playwright drives Debian's Chromium (no browser download).
Each test runs every cell of one notebook (Run All), checks what its pictures say in the
page (computed styles, contrast, positions, tooltips), that the page fetched nothing from
outside this machine and logged no error, and saves screenshots to artifacts/.
"""

from __future__ import annotations

import contextlib
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
NOTEBOOKS = Path(__file__).parents[2] / "notebooks"
TOURED = ("01-quickstart", "02-mesh-and-sharding", "05-pipeline-schedules")  # Run All here
# every other notebook is opened as nbclient's test ran and saved it: pictures, not a rerun
OPENED = tuple(p.stem for p in sorted(NOTEBOOKS.glob("*.ipynb")) if p.stem not in TOURED)
ARTIFACTS = Path(os.environ.get("MESHLAB_ARTIFACTS", Path(__file__).parents[2] / "artifacts"))

pytestmark = pytest.mark.browser  # without Chromium: skipped, naming tests/machine/up.sh


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def lab_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder JupyterLab serves: copies of the notebooks in TOURED, unexecuted; tests add
    executed copies with ``open_executed``."""
    root = tmp_path_factory.mktemp("lab")
    for name in TOURED:
        shutil.copy(NOTEBOOKS / f"{name}.ipynb", root / f"{name}.ipynb")
    return root


def open_executed(root: Path, executed: Any, name: str) -> None:
    """Serve the notebook as nbclient's test executed and saved it (outputs, widget state)."""
    if not (root / f"{name}.ipynb").exists():
        shutil.copy(executed(f"{name}.ipynb")[1], root / f"{name}.ipynb")


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory: pytest.TempPathFactory, lab_root: Path) -> Iterator[str]:
    """A JupyterLab server on loopback serving ``lab_root``; yields its URL."""
    root = lab_root
    port, token = free_port(), secrets.token_hex(16)
    # the user's settings start empty; the default-setting overrides are this environment's
    # JupyterLab's, as the README's set-up left them (`meshlab lab-settings` saves widget
    # state with the notebook; tests/conftest.py skips these tests without it)
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


ALL_RAN = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  if (!panel || !panel.content || !panel.sessionContext) return false;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = panel.content.widgets.filter(c => c.model.type === 'code');
  return !!kernel && kernel.status === 'idle' && cells.length > 0 &&
    cells.every(c => c.model.executionCount !== null);
}"""

# Run All ran a part only (seen under load: the last cell alone), with no error to stop it
STALLED = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const code = panel.content.widgets.filter(c => c.model.type === 'code');
  return !!kernel && kernel.status === 'idle' &&
    code.some(c => c.model.executionCount === null) &&
    !code.some(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'));
}"""

HAS_KERNEL = """() => { const panel = window.jupyterapp.shell.currentWidget;
  return !!(panel && panel.sessionContext && panel.sessionContext.session &&
            panel.sessionContext.session.kernel); }"""

COUNTS = """() => window.jupyterapp.shell.currentWidget.content.widgets
  .filter(c => c.model.type === 'code').map(c => c.model.executionCount)"""

# the colour behind a block's label: the nearest element with a background colour of its own
LABELS = """(root) => [...root.querySelectorAll('.meshlab-block')].map(block => {
  const walker = document.createTreeWalker(block, NodeFilter.SHOW_TEXT);
  let text = walker.nextNode();
  while (text && !text.textContent.trim()) text = walker.nextNode();
  if (!text) return null;
  let node = text.parentElement;
  const colour = getComputedStyle(node).color;
  const clear = (n) => ['rgba(0, 0, 0, 0)', 'transparent'].includes(
    getComputedStyle(n).backgroundColor);
  while (node && clear(node)) node = node.parentElement;
  return {ranks: block.dataset.ranks, text: text.textContent.trim(), colour,
          background: node ? getComputedStyle(node).backgroundColor : 'rgb(255, 255, 255)',
          fill: getComputedStyle(block).backgroundColor,
          image: getComputedStyle(block).backgroundImage,
          partial: block.classList.contains('partial')};
})"""

# per panel of a faceted vega chart: the right edge of its last bar, from the first bar's left
PANEL_EXTENTS = """(svg) => {
  const panels = [...svg.querySelectorAll('g.mark-rect.role-mark')]
    .map(p => [...p.querySelectorAll('path')].map(b => b.getBoundingClientRect()));
  const left = Math.min(...panels.flat().map(r => r.left));
  return panels.filter(p => p.length).map(p => Math.max(...p.map(r => r.right)) - left);
}"""

# how much of the plot the bars cover, across and down (an empty-looking chart: ~0 one way)
BAR_COVER = """(svg) => {
  const bars = [...svg.querySelectorAll('g.mark-rect path')].map(b => b.getBoundingClientRect());
  const plot = svg.querySelector('g.role-frame.root path.background').getBoundingClientRect();
  if (!bars.length) return [0, 0];
  const across = Math.max(...bars.map(r => r.right)) - Math.min(...bars.map(r => r.left));
  const down = Math.max(...bars.map(r => r.bottom)) - Math.min(...bars.map(r => r.top));
  return [across / plot.width, down / plot.height];
}"""


# the kernel's status messages (JupyterLab's indicator shows the last, whatever its parent)
# and when the cell that starts the ranks ran, from its execute_input to its reply (ms)
RECORD_STATUS = """() => {
  window.meshlabStatus = [];
  window.meshlabStart = {};
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  kernel.anyMessage.connect((_, args) => {
    const m = args.msg, now = performance.now();
    if (args.direction !== 'recv') return;
    if (m.header.msg_type === 'status')
      window.meshlabStatus.push([now, m.content.execution_state, m.parent_header.msg_type,
                                 m.parent_header.msg_id]);
    if (m.header.msg_type === 'execute_input' && m.content.code.startsWith('%mesh start'))
      window.meshlabStart = {id: m.parent_header.msg_id, from: now};
    if (m.header.msg_type === 'execute_reply' &&
        m.parent_header.msg_id === window.meshlabStart.id) window.meshlabStart.to = now;
  });
}"""

# the Idle statuses the page was told while the start's cell ran (null: it did not run), as
# [parent's type, ms after the cell began]; not counting the status the kernel publishes
# around the debugger's and kernel-info requests, which JupyterLab sends on the control
# channel whenever it likes (late, under load), nor the cell's own closing Idle: it comes on
# the iopub channel and its execute_reply on the shell channel, which can arrive later
IDLE_DURING_START = """() => {
  const start = window.meshlabStart;
  if (!start.to) return null;
  const control = ['debug_request', 'kernel_info_request'];
  return window.meshlabStatus
    .filter(([t, s, parent, id]) => s === 'idle' && t > start.from && t < start.to &&
                                    !control.includes(parent) && id !== start.id)
    .map(([t, s, parent]) => [parent, Math.round(t - start.from)]);
}"""

# what the notebook shows as pictures, and what shows as a broken one
PICTURES = """() => {
  const area = document.querySelector('.jp-Notebook');
  const text = area.innerText;
  return {widgets: area.querySelectorAll('.jp-OutputArea-output .meshlab-sharding').length,
          charts: area.querySelectorAll('.vega-embed svg.marks').length,
          starts: area.querySelectorAll('.meshlab-start').length,
          broken: (text.match(/Error displaying widget|model not found|Loading widget/g) || [])
            .length};
}"""

# whether JupyterLab marks the notebook modified (a dot on its tab; "Save changes?" on close)
UNSAVED = "() => window.jupyterapp.shell.currentWidget.context.model.dirty"

# widgets showing ipywidgets' red broken-link mark (drawn from saved state, no kernel behind)
DISCONNECTED_MARKS = """() => [...document.querySelectorAll('.jupyter-widgets-disconnected')]
  .filter(e => { const mark = getComputedStyle(e, '::before');
                 return mark.display !== 'none' && mark.content !== 'none'; })
  .map(e => e.className)"""

# stderr shown by a cell that raised nothing: the red block of a warning (IPython shows a
# UsageError, a magic's refusal, on stderr: that cell failed, on purpose)
STDERR_IN_GOOD_CELLS = """() => window.jupyterapp.shell.currentWidget.content.widgets
  .filter(c => c.model.type === 'code')
  .map(c => [c.model.sharedModel.getSource(), c.model.outputs.toJSON()])
  .filter(([_, outs]) => !outs.some(o => o.output_type === 'error' ||
    (o.output_type === 'stream' && [].concat(o.text).join('').startsWith('UsageError'))))
  .flatMap(([src, outs]) => outs.filter(o => o.output_type === 'stream' && o.name === 'stderr')
    .map(o => src.split('\\n')[0] + ' -> ' + [].concat(o.text).join('').slice(0, 200)))"""

# text drawn over other text in one output (vega hides labels it thins out with opacity 0),
# and labels cut by their sharding block's edge
OVERLAPS = """() => {
  const shown = (t) => {
    for (let n = t; n && n.nodeType === 1; n = n.parentElement) {
      const cs = getComputedStyle(n);
      if (cs.display === 'none' || cs.visibility === 'hidden' || cs.opacity === '0' ||
          n.getAttribute('opacity') === '0') return false;
    }
    const r = t.getBoundingClientRect();
    return r.width > 0 && r.height > 0;
  };
  const found = [];
  for (const out of document.querySelectorAll('.jp-OutputArea-output')) {
    const texts = [...out.querySelectorAll('svg text, .meshlab-block span')]
      .filter(t => t.textContent.trim() && shown(t))
      .map(t => [t.textContent.trim(), t.getBoundingClientRect(), t]);
    for (let i = 0; i < texts.length; i++) {
      for (let j = i + 1; j < texts.length; j++) {
        const [a, ra, ta] = texts[i], [b, rb, tb] = texts[j];
        if (ta.contains(tb) || tb.contains(ta)) continue;
        const w = Math.min(ra.right, rb.right) - Math.max(ra.left, rb.left);
        const h = Math.min(ra.bottom, rb.bottom) - Math.max(ra.top, rb.top);
        if (w > 1.5 && h > 1.5) found.push(`"${a}" over "${b}"`);
      }
    }
    for (const span of out.querySelectorAll('.meshlab-block span')) {
      const block = span.closest('.meshlab-block').getBoundingClientRect();
      const r = span.getBoundingClientRect();
      if (shown(span) && (r.right > block.right + 1 || r.bottom > block.bottom + 1))
        found.push(`"${span.textContent.trim()}" cut by its block`);
    }
  }
  return found;
}"""


def hex_of(css: str) -> str:
    """'rgb(78, 121, 167)' -> '#4e79a7'."""
    parts = css[css.index("(") + 1:css.index(")")].split(",")[:3]
    return "#" + "".join(f"{int(float(p)):02x}" for p in parts)


def watched_page(browser: Any, requests: list[str], errors: list[str]) -> Any:
    """A new page whose requests and logged errors are appended to ``requests``, ``errors``."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on("request", lambda request: requests.append(request.url))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return page


class Lab:
    """One notebook opened in JupyterLab and run to the end, with what the page did."""

    def __init__(self, browser: Any, jupyterlab: str, name: str) -> None:
        self.base, self.token = jupyterlab.split("|")
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page = page = watched_page(browser, self.requests, self.errors)
        # a workspace of its own, reset: no tabs (and kernels) of earlier tests come back
        page.goto(f"{self.base}/lab/workspaces/{name}/tree/{name}.ipynb?reset&token={self.token}")
        page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')",
                               timeout=60_000)
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                               timeout=60_000)
        page.wait_for_timeout(2000)
        deadline = time.monotonic() + 60  # seen once: idle shown before the session had one
        while not page.evaluate(HAS_KERNEL):
            accept_dialogs(page)  # JupyterLab sometimes asks which kernel, even with one running
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: JupyterLab started no kernel within 60 s")
            page.wait_for_timeout(500)
        page.evaluate(RECORD_STATUS)
        # not awaited: the command's promise settles late; the cells say when they ran
        run_all = "() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }"
        page.evaluate(run_all)
        asked, deadline, stalled = time.monotonic(), time.monotonic() + 240, 0.0
        while not page.evaluate(ALL_RAN):
            accept_dialogs(page)
            # asked before the kernel was there, or run in part: ask again once it has idled
            # 5 s (not the blink between two cells)
            stalled = (stalled or time.monotonic()) if page.evaluate(STALLED) else 0.0
            if stalled and time.monotonic() - stalled > 5 and time.monotonic() - asked > 30:
                page.evaluate(run_all)
                asked, stalled = time.monotonic(), 0.0
            if time.monotonic() > deadline:
                page.screenshot(path=str(ARTIFACTS / f"{name}-failure.png"), full_page=True)
                counts = page.evaluate(COUNTS)
                self.shutdown_kernel()  # its ranks would slow the tests after this one
                raise AssertionError(f"{name} did not finish in JupyterLab within 240 s "
                                     f"(execution counts {counts}); "
                                     f"see artifacts/{name}-failure.png")
            page.wait_for_timeout(500)
        page.wait_for_timeout(1000)  # widgets render after their cell's reply

    def charts(self) -> Any:
        """The interactive charts (vega drawn as SVG by JupyterLab's Vega-Lite renderer)."""
        return self.page.locator(".vega-embed svg.marks")

    def save_and_reopen_without_its_kernel(self) -> None:
        """Save the notebook, shut its kernel down and load the page again: what shows now
        comes from the saved file alone."""
        page = self.page
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        page.wait_for_function("() => !window.jupyterapp.shell.currentWidget.context"
                               ".model.dirty", timeout=30_000)
        self.shutdown_kernel()
        page.wait_for_timeout(1000)
        page.reload()
        page.wait_for_function("window.jupyterapp && document.querySelector('.jp-Notebook')",
                               timeout=60_000)
        # the kernel Lab starts for it settles first: shut down while the debugger asks it
        # for its state, the page logs a cancelled debug_request
        page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                               timeout=60_000)
        page.wait_for_timeout(2000)
        accept_dialogs(page)

    def pictures(self) -> dict[str, int]:
        return dict(self.page.evaluate(PICTURES))

    def check_clean(self) -> None:
        """No red block on a cell that succeeded, no label over another or cut off."""
        warned = self.page.evaluate(STDERR_IN_GOOD_CELLS)
        assert warned == [], f"cells that succeeded printed to stderr: {warned[:5]}"
        overlaps = self.page.evaluate(OVERLAPS)
        assert overlaps == [], f"labels drawn over each other or cut: {overlaps[:8]}"

    def check_pictures_survive_saving(self) -> None:
        """Save, reopen without a kernel: every picture the run drew is drawn again, from the
        file alone (widget state saved by meshlab's JupyterLab settings default)."""
        before = self.pictures()
        assert before["broken"] == 0, before
        self.save_and_reopen_without_its_kernel()
        try:
            self.page.wait_for_function(
                f"(() => {{ const p = ({PICTURES})(); return p.widgets >= {before['widgets']}"
                f" && p.charts >= {before['charts']} && p.starts >= {before['starts']}"
                f" && p.broken === 0; }})()", timeout=60_000)
        except Exception:
            raise AssertionError(f"after saving and reopening: {self.pictures()}, "
                                 f"before: {before}") from None
        assert self.page.evaluate(COUNTS)[0] is not None  # the outputs shown are the saved ones
        self.check_opened_untouched()

    def check_opened_untouched(self) -> None:
        """Opened from its file and left alone, the notebook is not marked modified (the
        widget manager restoring saved widgets did, within ~3 s; JupyterLab adding a PNG to
        a chart without one did too) and no widget wears the broken-link mark over what
        works without a kernel. Called once its pictures are drawn: 3 s more for late ones."""
        self.page.wait_for_timeout(3000)
        assert not self.page.evaluate(UNSAVED), "opened untouched, the notebook reads as " \
            "modified: see labextension/ (meshlab-lab) and charts.offline.png_of"
        assert self.page.evaluate(DISCONNECTED_MARKS) == []

    def shutdown_kernel(self) -> None:
        self.page.evaluate("() => { const s = window.jupyterapp.shell.currentWidget"
                           ".sessionContext.session; if (s) return s.shutdown(); }")

    def close(self) -> None:
        """Check the page stayed on this machine and logged no error, then stop its kernel
        (what the page logs while its kernel goes away is not the notebook's doing)."""
        self.page.wait_for_timeout(1000)
        requests, errors = list(self.requests), list(self.errors)
        self.shutdown_kernel()
        self.page.close()
        outside = [u for u in requests if not u.startswith((self.base, "data:", "blob:",
                                                              "about:"))]
        assert outside == [], f"the page fetched from outside this machine: {outside[:5]}"
        assert errors == [], f"the page logged errors: {errors[:5]}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        yield chromium
        chromium.close()


# The main area emptied (what an earlier test left open, even one that failed), then `path`
# opened in its own tab, with its kernel's debugger requests counted (see SETTLED)
OPEN = """async (path) => {
  const app = window.jupyterapp;
  for (const widget of Array.from(app.shell.widgets('main'))) widget.dispose();
  const panel = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
  const debug = window.meshlabDebug = {pending: new Set(), replies: 0, idleSince: null};
  const watch = (kernel) => kernel && kernel.anyMessage.connect((_, args) => {
    const m = args.msg;
    if (args.direction === 'send' && m.header.msg_type === 'debug_request')
      debug.pending.add(m.header.msg_id);
    if (args.direction === 'recv' && m.header.msg_type === 'debug_reply') {
      debug.pending.delete(m.parent_header.msg_id);
      debug.replies += 1;
    }
  });
  panel.sessionContext.kernelChanged.connect((_, change) => watch(change.newValue));
  watch(panel.sessionContext.session && panel.sessionContext.session.kernel);
  await panel.context.ready;
}"""

# The kernel JupyterLab started is idle and its debugger has its state (shut down while the
# debugger asks for it, the page logs a cancelled debug_request): a reply came and none is
# pending, or the kernel has no debugger, or none was asked for 3 s of idle
SETTLED = """async () => {
  const context = window.jupyterapp.shell.currentWidget.sessionContext;
  const kernel = context.session && context.session.kernel;
  const debug = window.meshlabDebug;
  if (!kernel || kernel.status !== 'idle') return false;
  debug.idleSince = debug.idleSince || performance.now();
  const info = await kernel.info;
  return debug.pending.size === 0 && (debug.replies > 0 || !info.debugger ||
                                      performance.now() - debug.idleSince > 3000);
}"""


class Viewer:
    """One JupyterLab page for the module's saved notebooks, opened one after another (a page
    load costs each ~5-10 s of CPU; a saved notebook draws from its file, as in a new page)."""

    def __init__(self, browser: Any, jupyterlab: str) -> None:
        self.base, self.token = jupyterlab.split("|")
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page = page = watched_page(browser, self.requests, self.errors)
        page.goto(f"{self.base}/lab/workspaces/saved?reset&token={self.token}")
        page.wait_for_function("window.jupyterapp && document.querySelector('.jp-LabShell')",
                               timeout=60_000)
        page.evaluate("() => window.jupyterapp.restored")
        # what loading the page fetched and logged: every notebook's checks include it
        self.loaded = list(self.requests), list(self.errors)
        self.current: SavedLab | None = None  # the notebook open now


class SavedLab(Lab):
    """A notebook opened as nbclient saved it, in the module's `Viewer` page: what it shows
    comes from the file (the kernel JupyterLab starts for it runs nothing)."""

    def __init__(self, viewer: Viewer, name: str) -> None:
        self.base, self.token, self.page = viewer.base, viewer.token, viewer.page
        self.viewer = viewer
        if viewer.current is not None:  # an earlier test failed before its close()
            with contextlib.suppress(Exception):
                self.page.wait_for_function(SETTLED, timeout=30_000)
            viewer.current.go_away()
        viewer.current = self
        viewer.requests, viewer.errors = [], []
        self.requests, self.errors = viewer.requests, viewer.errors
        self.page.mouse.move(0, 0)  # no tooltip of an earlier notebook's chart stays up
        self.page.evaluate(OPEN, f"{name}.ipynb")
        self.page.wait_for_function("document.querySelector('.jp-Notebook')", timeout=60_000)
        accept_dialogs(self.page)

    def close(self) -> None:
        """Check the page stayed on this machine and logged no error (loading it included),
        then stop the notebook's kernel and close its tab. What the page logs from then on,
        while they go away, is not the notebook's doing (nor the next one's)."""
        accept_dialogs(self.page)  # JupyterLab sometimes asks which kernel
        self.page.wait_for_function(SETTLED, timeout=60_000)
        self.page.wait_for_timeout(1000)
        requests = self.viewer.loaded[0] + list(self.requests)
        errors = self.viewer.loaded[1] + list(self.errors)
        self.go_away()
        outside = [u for u in requests if not u.startswith((self.base, "data:", "blob:",
                                                              "about:"))]
        assert outside == [], f"the page fetched from outside this machine: {outside[:5]}"
        assert errors == [], f"the page logged errors: {errors[:5]}"

    def go_away(self) -> None:
        """Stop the kernel, close the tab; what the page logs meanwhile is recorded nowhere."""
        self.viewer.requests, self.viewer.errors = [], []
        self.shutdown_kernel()
        self.page.evaluate("() => { for (const w of Array.from(window.jupyterapp.shell"
                           ".widgets('main'))) w.dispose(); }")
        self.page.wait_for_timeout(300)
        self.viewer.current = None


@pytest.fixture(scope="module")
def viewer(browser: Any, jupyterlab: str) -> Iterator[Viewer]:
    """The page the saved notebooks open in (`SavedLab`)."""
    view = Viewer(browser, jupyterlab)
    yield view
    view.page.close()


def test_quickstart_runs_and_reports_in_jupyterlab(browser: Any, jupyterlab: str) -> None:
    lab = Lab(browser, jupyterlab, "01-quickstart")
    text = lab.page.locator(".jp-OutputArea-output").all_inner_texts()
    assert any("ranks ready in" in t for t in text), text[:3]
    assert any("[rank 1] ValueError" in t for t in text)  # errors summarised by rank
    lab.page.screenshot(path=str(ARTIFACTS / "01-quickstart.png"), full_page=True)
    assert lab.pictures()["starts"] == 1  # the start's progress, not a widget
    # the kernel showed busy through the start (a widget's subshell once showed it Idle for
    # the whole start, inviting a second Run All)
    assert lab.page.evaluate(IDLE_DURING_START) == []
    lab.check_clean()
    lab.check_pictures_survive_saving()
    lab.close()


def test_sharding_widget_tells_ranks_ranges_and_partial_apart(
        browser: Any, jupyterlab: str) -> None:
    from meshlab.notebook.palette import contrast, rank_colour

    lab = Lab(browser, jupyterlab, "02-mesh-and-sharding")
    page = lab.page
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
    first.screenshot(path=str(ARTIFACTS / "sharding-widget.png"))

    # (a block too small for any text is told in the key under its grid)
    labels = [x for w in page.locator(".meshlab-sharding").all() for x in w.evaluate(LABELS)
              if x is not None]
    assert len(labels) > 10
    for x in labels:  # every label readable on its colour (WCAG AA: 4.5:1)
        assert contrast(hex_of(x["colour"]), hex_of(x["background"])) >= 4.5, x
    colours: dict[str, set[str]] = {}  # one colour per rank, in every widget
    for x in labels:
        if "," not in x["ranks"] and "-" not in x["ranks"]:
            colours.setdefault(x["ranks"], set()).add(hex_of(x["fill"]))
    assert colours == {str(r): {rank_colour(r)} for r in range(4)}
    replicated = page.locator(".meshlab-block.replicated")  # one block, said in words
    assert replicated.count() > 0
    assert all("replicated" in replicated.nth(i).inner_text()
               for i in range(replicated.count()))
    partial = [x for x in labels if x["partial"]]  # `%mesh inspect partial`: hatched
    assert partial and all("repeating-linear-gradient" in x["image"] for x in partial)
    hatched = page.locator(".meshlab-sharding", has=page.locator(".meshlab-block.partial"))
    hatched.first.screenshot(path=str(ARTIFACTS / "sharding-partial.png"))

    # the module table: clicking a parameter draws it
    module = page.locator(".meshlab-sharding", has=page.locator(".meshlab-params")).first
    module.scroll_into_view_if_needed()
    module.locator("tr.meshlab-param").nth(2).click()
    page.wait_for_function(
        "[...document.querySelectorAll('.meshlab-caption')].some(c => "
        "c.textContent.startsWith('2.weight'))", timeout=30_000)
    module.screenshot(path=str(ARTIFACTS / "sharding-module.png"))

    chart = lab.charts().last  # %%mesh --comms: interactive, drawn here
    chart.scroll_into_view_if_needed()
    assert chart.is_visible()
    chart.screenshot(path=str(ARTIFACTS / "comms-chart.png"))
    page.screenshot(path=str(ARTIFACTS / "jupyterlab.png"))
    lab.check_clean()
    lab.check_pictures_survive_saving()
    page.locator(".meshlab-sharding").first.screenshot(
        path=str(ARTIFACTS / "sharding-widget-reopened.png"))
    # reopened, with no kernel behind the widget: a row clicked is drawn from the saved state
    module = page.locator(".meshlab-sharding", has=page.locator(".meshlab-params")).first
    module.scroll_into_view_if_needed()
    for row, name in ((2, "2.weight"), (1, "0.bias")):
        module.locator("tr.meshlab-param").nth(row).click()
        page.wait_for_function(
            "(name) => [...document.querySelectorAll('.meshlab-caption')].some(c => "
            "c.textContent.startsWith(name))", arg=name, timeout=10_000)
    module.screenshot(path=str(ARTIFACTS / "sharding-module-reopened.png"))
    # and an edit still marks the notebook modified
    page.evaluate("() => { const cell = window.jupyterapp.shell.currentWidget.content"
                  ".widgets[0].model.sharedModel; cell.setSource(cell.getSource() + ' '); }")
    page.wait_for_function(UNSAVED, timeout=10_000)
    lab.close()


def test_compared_schedules_share_one_time_axis_and_show_tooltips(
        browser: Any, jupyterlab: str) -> None:
    lab = Lab(browser, jupyterlab, "05-pipeline-schedules")
    chart = lab.charts().first  # gpipe,1f1b,interleaved_1f1b,zb_h1 on 4 stages, 8 micro-batches
    chart.scroll_into_view_if_needed()
    extents = chart.evaluate(PANEL_EXTENTS)
    assert len(extents) == 4, extents
    # one time axis: ZB-H1 (27 slots) draws shorter than GPipe (33), not as long
    assert max(extents) / min(extents) > 1.1, extents
    chart.screenshot(path=str(ARTIFACTS / "schedules-compared.png"))
    bar = chart.locator("g.mark-rect path").first.bounding_box()
    assert bar is not None
    for dx in (2, 3):  # vega shows the tooltip on a move within the mark
        lab.page.mouse.move(bar["x"] + dx, bar["y"] + bar["height"] / 2)
    tooltip = lab.page.locator("#vg-tooltip-element.visible")
    tooltip.wait_for(timeout=10_000)
    assert "rank" in tooltip.inner_text()
    assert lab.charts().count() >= 2
    lab.check_clean()
    lab.check_pictures_survive_saving()
    lab.page.screenshot(path=str(ARTIFACTS / "05-saved-and-reopened.png"), full_page=True)
    lab.close()


def drawn_in_file(path: Path) -> dict[str, int]:
    """How many sharding widgets (saved with their state) and charts the notebook holds. (A
    widget closed before the save, like transformers' download bars in 14, has no state in
    the file: nothing can draw it, and Lab shows nothing in its place.)"""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    state = nb.metadata.get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "data" in o]
    views = [o.data["application/vnd.jupyter.widget-view+json"]["model_id"] for o in outputs
             if "application/vnd.jupyter.widget-view+json" in o.data]
    return {"widgets": sum("tensor" in state.get(m, {}).get("state", {}) for m in views),
            "charts": sum(any(k.startswith("application/vnd.vegalite") for k in o.data)
                          for o in outputs)}


# what the sharding widget must say of each holder where ranks hold different tensors: the
# stages of 09 (pp=2) and the experts of 08, each drawn apart (never "[ranks 0,4]")
HOLDERS = {"09-composed-3d": ["(pp 0)", "(pp 1)"],
           "08-expert-parallel": ["experts 0 of 4", "experts 3 of 4"]}

# each drawn part's caption (an untrusted notebook, as nbclient saved it, shows the widget's
# static HTML, which JupyterLab's sanitizer strips of data- attributes: the text says it)
PARTS = """() => [...document.querySelectorAll('.meshlab-part')].map(p =>
  (p.querySelector('.meshlab-holder') || {innerText: ''}).innerText)"""


@pytest.mark.parametrize("name", OPENED)
def test_a_saved_tour_notebook_shows_every_picture_clean(
        viewer: Viewer, lab_root: Path, executed: Any, name: str) -> None:
    """Opened as nbclient ran and saved it: every widget and chart drawn from the file, no
    red block on a cell that succeeded, no label over another."""
    open_executed(lab_root, executed, name)
    held = drawn_in_file(lab_root / f"{name}.ipynb")
    lab = SavedLab(viewer, name)
    try:
        lab.page.wait_for_function(
            f"(() => {{ const p = ({PICTURES})(); return p.widgets >= {held['widgets']}"
            f" && p.charts >= {held['charts']} && p.broken === 0; }})()", timeout=60_000)
    except Exception:
        raise AssertionError(f"{name} shows {lab.pictures()}; its file holds {held}") from None
    lab.page.screenshot(path=str(ARTIFACTS / f"{name}-opened.png"), full_page=True)
    lab.check_clean()
    lab.page.wait_for_function(SETTLED, timeout=60_000)
    lab.check_opened_untouched()
    if name in HOLDERS:
        parts = lab.page.evaluate(PARTS)  # each holder drawn apart, captioned
        assert all(any(h in part for part in parts) for h in HOLDERS[name]), parts
        assert len(set(parts)) == len(parts) > 1, parts
    lab.close()


def test_planning_charts_fill_their_axes(viewer: Viewer, lab_root: Path,
                                         executed: Any) -> None:
    open_executed(lab_root, executed, "11-planning-at-scale")
    lab = SavedLab(viewer, "11-planning-at-scale")
    charts = lab.charts()
    charts.first.wait_for(timeout=60_000)
    assert charts.count() >= 1
    for i in range(charts.count()):
        chart = charts.nth(i)
        chart.scroll_into_view_if_needed()
        across, down = chart.evaluate(BAR_COVER)
        # a bar chart whose values fill a sliver of their axis reads as empty
        assert across > 0.25 and down > 0.25, f"chart {i}: bars cover {across:.0%} x {down:.0%}"
        chart.screenshot(path=str(ARTIFACTS / f"planning-chart-{i}.png"))
    lab.close()


# the widest bar of a vega chart: where a hover surely lands on it
WIDEST_BAR = """(svg) => {
  const bars = [...svg.querySelectorAll('g.mark-rect path')].map(b => b.getBoundingClientRect());
  const widest = bars.reduce((a, b) => (b.width > a.width ? b : a), bars[0]);
  return {x: widest.left, y: widest.top, width: widest.width, height: widest.height,
          bars: bars.length};
}"""


def test_the_profile_timeline_shows_every_rank_and_names_the_op_on_hover(
        viewer: Viewer, lab_root: Path, executed: Any) -> None:
    open_executed(lab_root, executed, "15-timelines")
    lab = SavedLab(viewer, "15-timelines")
    charts = lab.charts()
    charts.first.wait_for(timeout=60_000)
    chart = charts.first  # the ZeRO-3 x TP step's timeline, drawn from the saved notebook
    chart.scroll_into_view_if_needed()
    rows = chart.locator("g.role-axis-label text").all_text_contents()
    assert {"0", "1", "2", "3"} <= set(rows), rows  # a row per rank
    bar = chart.evaluate(WIDEST_BAR)
    assert bar["bars"] > 8 and bar["width"] > 3, bar
    for dx in (1, 2):  # vega shows the tooltip on a move within the mark
        lab.page.mouse.move(bar["x"] + bar["width"] / 2 + dx, bar["y"] + bar["height"] / 2)
    tooltip = lab.page.locator("#vg-tooltip-element.visible")
    tooltip.wait_for(timeout=10_000)
    text = tooltip.inner_text()
    assert "op" in text and "duration (ms)" in text and "rank" in text, text
    chart.screenshot(path=str(ARTIFACTS / "profile-timeline.png"))
    lab.close()


def test_a_notebook_without_widget_state_reads_without_javascript(
        browser: Any, executed: Any, tmp_path: Path) -> None:
    """As GitHub or a viewer that keeps no widget state shows it: nbconvert's HTML of the
    saved notebook, its widget state dropped, in a page with JavaScript off. Every sharding
    output falls back to its static drawing, every chart to its SVG."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(executed("02-mesh-and-sharding.ipynb")[1], as_version=4)
    nb.metadata.pop("widgets", None)
    held = drawn_in_file(executed("02-mesh-and-sharding.ipynb")[1])
    page_path = tmp_path / "02-static.html"
    page_path.write_text(HTMLExporter().from_notebook_node(nb)[0])
    context = browser.new_context(java_script_enabled=False,
                                  viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(page_path.as_uri())
    drawings = page.locator(".meshlab-sharding")
    assert drawings.count() == held["widgets"] > 0
    for i in range(drawings.count()):
        blocks = drawings.nth(i).locator(".meshlab-block")
        assert blocks.count() > 0 and all(
            (box := blocks.nth(j).bounding_box()) and box["width"] > 4 and box["height"] > 4
            for j in range(blocks.count())), f"drawing {i} lost its blocks"
    charts = page.locator(".jp-OutputArea-output img, .jp-OutputArea-output svg")
    assert charts.count() >= held["charts"] > 0
    page.screenshot(path=str(ARTIFACTS / "02-static.png"), full_page=True)
    context.close()


# what the notebook shows: a progress bar (tqdm's widgets), a slider, a sharding view
WIDGETS_THAT_OUTLIVE_THEIR_KERNEL = [
    "from tqdm.notebook import tqdm\nfor _ in tqdm(range(3)):\n    pass",
    "import ipywidgets\nipywidgets.IntSlider(3)",
    "from meshlab.measure.sharding import ModuleReport, RankShard, ShardingReport\n"
    "from meshlab.notebook.widgets import ShardingView\n"
    "ShardingView(ModuleReport('m', [ShardingReport(\n"
    "    name=name, kind='dtensor', global_shape=[4, 4], dtype='float32', mesh_shape=[2],\n"
    "    mesh_axes=['tp'], placements=[f'Shard({d})'], shards=[RankShard(\n"
    "        rank=r, coordinate=[r], local_shape=[4 - 2 * d, 2 + 2 * d], bytes=32,\n"
    "        offsets=[2 * r * (1 - d), 2 * r * d]) for r in range(2)])\n"
    "    for d, name in enumerate(['rows', 'cols'])]))",
]


def test_only_controls_wear_the_broken_link_mark_once_their_kernel_is_gone(
        browser: Any, jupyterlab: str, lab_root: Path) -> None:
    """ipywidgets marks every widget whose kernel went away (restarted, say) with a
    red broken link. A progress bar or a sharding view loses nothing: no mark (meshlab's
    plugin, the view's CSS); a slider's input goes nowhere: it keeps its mark."""
    write_notebook(lab_root, "widgets-without-kernel", WIDGETS_THAT_OUTLIVE_THEIR_KERNEL)
    lab = Lab(browser, jupyterlab, "widgets-without-kernel")
    page = lab.page
    page.locator(".meshlab-sharding").wait_for(timeout=30_000)
    assert page.evaluate(DISCONNECTED_MARKS) == []  # live: no mark anywhere
    page.evaluate("() => { window.jupyterapp.shell.currentWidget.sessionContext.session"
                  ".kernel.restart(); }")  # what disconnects live widgets
    page.wait_for_function("() => document.querySelectorAll("
                           "'.jupyter-widgets-disconnected').length > 0", timeout=30_000)
    marked = page.evaluate(DISCONNECTED_MARKS)
    assert len(marked) == 1 and "widget-slider" in marked[0], marked
    # the sharding view still draws the other row from its saved state
    page.locator("tr.meshlab-param").nth(1).click()
    page.wait_for_function("() => [...document.querySelectorAll('.meshlab-caption')]"
                           ".some(c => c.textContent.startsWith('cols'))", timeout=10_000)
    page.screenshot(path=str(ARTIFACTS / "widgets-without-kernel.png"), full_page=True)
    page.wait_for_function("() => window.jupyterapp.shell.currentWidget.sessionContext"
                           ".session.kernel.status === 'idle'", timeout=60_000)
    lab.close()


def write_notebook(lab_root: Path, name: str, cells: list[str]) -> None:
    """A notebook of code ``cells`` as ``name``.ipynb, on the kernel JupyterLab starts."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, lab_root / f"{name}.ipynb")


def run_all_of(browser: Any, jupyterlab: str, lab_root: Path, name: str, cells: list[str],
               requests: list[str], errors: list[str]) -> tuple[Any, str]:
    """A notebook of ``cells`` written as ``name``.ipynb, opened in JupyterLab and Run All
    started: (its page, the server's base URL)."""
    write_notebook(lab_root, name, cells)
    base, token = jupyterlab.split("|")
    page = watched_page(browser, requests, errors)
    page.goto(f"{base}/lab/workspaces/{name}/tree/{name}.ipynb?reset&token={token}")
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=60_000)
    page.wait_for_timeout(2000)
    accept_dialogs(page)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    return page, base


DEBUGGED = ["%load_ext meshlab\n%mesh start 2",
            "%%mesh\nx = rank * 7 + 5\nif rank == 1:\n    breakpoint()\n    x = 0\ny = x",
            "%mesh stop"]


def test_breakpoint_in_a_cell_gives_a_pdb_prompt_in_jupyterlab(
        browser: Any, jupyterlab: str, lab_root: Path) -> None:
    name = "debugged"
    requests: list[str] = []
    errors: list[str] = []
    page, base = run_all_of(browser, jupyterlab, lab_root, name, DEBUGGED, requests, errors)
    # the prompt JupyterLab draws for input(); one answered may stay in the page beside the
    # next, so each is marked once typed into
    fresh = ".jp-Stdin-input:not([data-typed])"

    def answer(text: str) -> None:
        page.locator(fresh).first.wait_for(timeout=120_000)
        box = page.locator(fresh).first.element_handle()
        box.evaluate("e => { e.dataset.typed = '1'; }")
        box.fill(text)
        box.press("Enter")

    try:  # rank 1 stopped, named in the prompt
        page.locator(fresh).first.wait_for(timeout=120_000)
        assert "(Pdb rank 1)" in page.locator(".jp-Stdin-prompt").last.inner_text()
        answer("p x")
        # the typed command echoed, rank 1's x below it (7 + 5)
        page.wait_for_function("() => /Pdb rank 1\\)\\s*p x\\s*\\n\\s*12\\b/.test("
                               "document.querySelector('.jp-Notebook').innerText)",
                               timeout=30_000)
        answer("c")
        page.wait_for_function(ALL_RAN, timeout=120_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"{name}-failure.png"), full_page=True)
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session"
                      ".shutdown()")  # its ranks would slow the tests after this one
        raise
    text = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    assert "[rank 1] stopped at Cell In[" in text and "`x = 0`" in text
    assert "stopped 2 ranks" in text  # the cell went on and the next one ran
    page.wait_for_timeout(500)
    page.close()
    outside = [u for u in requests if not u.startswith((base, "data:", "blob:", "about:"))]
    assert outside == [] and errors == [], (outside[:5], errors[:5])


PROGRESSED = ["%load_ext meshlab\n%mesh start 2",
              "%%mesh\nimport time\nprint('training')\n"
              "opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)\n"
              "for _ in range(12):\n    time.sleep(0.5)\n    opt.step()",
              "%mesh stop"]

# the cell's progress outputs and what the notebook shows, as the page has them now
PROGRESS = """() => ({
  shown: [...document.querySelectorAll('.meshlab-cell-progress')]
    .map(e => [e.dataset.state, e.innerText]),
  text: document.querySelector('.jp-Notebook').innerText})"""


def test_a_long_cell_shows_its_progress_live_in_jupyterlab(
        browser: Any, jupyterlab: str, lab_root: Path) -> None:
    import re

    name = "progressed"
    requests: list[str] = []
    errors: list[str] = []
    page, base = run_all_of(browser, jupyterlab, lab_root, name, PROGRESSED, requests, errors)
    try:  # while the cell runs: its progress, a step counted, below the output so far
        page.wait_for_function(
            "() => [...document.querySelectorAll('.meshlab-cell-progress')].some(e => "
            "e.dataset.state === 'running' && /step [1-9]/.test(e.innerText))", timeout=120_000)
        live = page.evaluate(PROGRESS)
        page.wait_for_function(ALL_RAN, timeout=120_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"{name}-failure.png"), full_page=True)
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session"
                      ".shutdown()")  # its ranks would slow the tests after this one
        raise
    assert len(live["shown"]) == 1, live  # one output, updated in place
    assert re.fullmatch(r"running [\d.]+ s on 2 ranks: \[ranks? [\d,-]+\] step \d+.*",
                        live["shown"][0][1]), live
    assert "training" in live["text"].split("running ")[0], live  # streamed, kept, above it
    ended = page.evaluate(PROGRESS)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)
    # the cell's output kept, and its progress ended on what the ranks replied
    assert "training" in ended["text"] and "stopped 2 ranks" in ended["text"]
    assert len(ended["shown"]) == 1 and ended["shown"][0][0] == "ended", ended["shown"]
    assert re.fullmatch(r"ran [\d.]+ s on 2 ranks: \[ranks 0-1\] step 12",
                        ended["shown"][0][1]), ended["shown"]
    page.wait_for_timeout(500)
    page.close()
    outside = [u for u in requests if not u.startswith((base, "data:", "blob:", "about:"))]
    assert outside == [] and errors == [], (outside[:5], errors[:5])
