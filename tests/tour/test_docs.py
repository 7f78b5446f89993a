"""The documentation site: the guides, the tour as it ran and the API reference, built with
warnings as errors and readable offline.

The site is built once a module by the command the docs document (``python docs/build.py``),
from the tour notebooks this session executed (the ``executed`` fixture: the notebook and
browser tests use the same copies, so nothing runs twice)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest

import meshlab

ROOT = Path(__file__).parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
# Executed here when the site's tests run alone: every notebook, about 20 minutes on 2 cores.
SITE_TIMEOUT = 1800
# Where a page would fetch from another machine: src/href of what loads, CSS imports and url()s.
OUTSIDE = re.compile(
    r"<(?:script|link|img|iframe|source|embed|video|audio)\b[^>]*?\b(?:src|href)\s*=\s*"
    r"[\"']?\s*((?:https?:)?//[^\"'\s>]+)"
    r"|@import\s+(?:url\()?\s*[\"']?((?:https?:)?//[^\"')\s]+)"
    r"|url\(\s*[\"']?((?:https?:)?//[^\"')\s]+)", re.I)
# The rank side's main verbs and types, beside meshlab.__all__.
RANK_SIDE = ["meshlab.mesh.build", "meshlab.mesh.MeshSpec", "meshlab.measure.sharding.describe",
             "meshlab.measure.sharding.ShardingReport", "meshlab.measure.comms.CommTracer",
             "meshlab.measure.memory.measure", "meshlab.measure.memory.zero_bytes",
             "meshlab.plan.estimate", "meshlab.plan.search", "meshlab.plan.Layout",
             "meshlab.schedules.build", "meshlab.schedules.Schedule", "meshlab.parallel.apply_tp",
             "meshlab.parallel.apply_fsdp", "meshlab.parallel.apply_pp"]
Executed = Callable[[str], tuple[nbformat.NotebookNode, Path]]


def outputs(nb: nbformat.NotebookNode) -> list[dict]:
    return [o.get("data", {}) for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if o.output_type in ("display_data", "execute_result")]


def test_readme_is_a_landing_page_that_links_every_guide_and_notebook() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200, "keep the README a landing page: move text to a guide"
    assert "## Set-up" in readme and "docs/images/sharding-widget.png" in readme
    missing = [p.name for p in GUIDES if p.name != "index.md"
               and f"(docs/guides/{p.name})" not in readme]
    missing += [p.name for p in NOTEBOOKS if f"(notebooks/{p.name})" not in readme]
    assert not missing, f"the README links no {missing}"


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_tour_notebook_has_an_executed_copy_for_its_page(executed: Executed, path: Path
                                                         ) -> None:
    nb, _ = executed(path.name)  # one notebook a test: each within the tests' time limit
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert all(c.get("execution_count") for c in code), f"{path.name}: cells did not run"


@pytest.fixture(scope="module")
def site(executed: Executed, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site (its root folder), from this session's executed notebooks."""
    copies = tmp_path_factory.mktemp("executed")
    for path in NOTEBOOKS:
        shutil.copy(executed(path.name)[1], copies / path.name)
    out = tmp_path_factory.mktemp("site") / "html"
    done = subprocess.run([sys.executable, "docs/build.py", "--executed", str(copies),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"the docs build failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.mark.notebook
@pytest.mark.timeout(SITE_TIMEOUT)
def test_every_guide_and_tour_notebook_has_a_page(site: Path) -> None:
    pages = [Path("docs/index.html"), Path("docs/tour.html"), Path("docs/api/index.html")]
    pages += [Path("docs/guides") / f"{p.stem}.html" for p in GUIDES]
    pages += [Path("notebooks") / f"{p.stem}.html" for p in NOTEBOOKS]
    missing = [str(p) for p in pages if not (site / p).is_file()]
    assert not missing, f"no page for {missing}"
    for path in NOTEBOOKS:  # the page's title is the notebook's
        title = nbformat.read(path, as_version=4).cells[0].source.splitlines()[0].lstrip("# ")
        page = (site / "notebooks" / f"{path.stem}.html").read_text()
        assert re.search(r"<h1>\s*" + re.escape(title.split(":")[0]), page), path.name


@pytest.mark.notebook
@pytest.mark.timeout(SITE_TIMEOUT)
def test_notebook_pages_show_their_charts_and_widgets_statically(
        site: Path, executed: Executed) -> None:
    for path in NOTEBOOKS:
        shown = outputs(executed(path.name)[0])
        page = (site / "notebooks" / f"{path.stem}.html").read_text()
        svgs = re.findall(r"<img[^>]*\bsrc=\"([^\"]+\.svg)\"", page)
        charts = sum("image/svg+xml" in d for d in shown)
        assert len(svgs) >= charts, f"{path.name}: {charts} charts, {len(svgs)} pictures"
        assert all((site / "notebooks" / s).resolve().is_file() for s in svgs), path.name
        drawn = sum("application/vnd.jupyter.widget-view+json" in d and "text/html" in d
                    and "meshlab-sharding" in d["text/html"] for d in shown)
        assert page.count("class=\"meshlab-sharding\"") + page.count(
            "class='meshlab-sharding'") >= drawn, f"{path.name}: a widget lost its drawing"
        # nothing that needs a script: the widget view, its manager, the Vega-Lite spec
        for needs_a_script in ("widget-view+json", "widget-state+json", "vnd.vegalite",
                               "html-manager", "require.js"):
            assert needs_a_script not in page, f"{path.name}: {needs_a_script}"
    assert "ready: 4/4 ranks" in (site / "notebooks" / "01-quickstart.html").read_text(), \
        "the start's progress bar shows its last state"


@pytest.mark.notebook
@pytest.mark.timeout(SITE_TIMEOUT)
def test_the_site_makes_no_outside_request(site: Path) -> None:
    found = [f"{f.relative_to(site)}: {next(g for g in m.groups() if g)}"
             for f in sorted([*site.rglob("*.html"), *site.rglob("*.css")])
             for m in OUTSIDE.finditer(f.read_text(errors="replace"))]
    assert not found, "\n".join(found)


@pytest.mark.notebook
@pytest.mark.timeout(SITE_TIMEOUT)
def test_the_api_reference_documents_every_public_name(site: Path) -> None:
    api = "".join(p.read_text() for p in (site / "docs" / "api").glob("*.html"))
    names = [f"meshlab.{n}" for n in meshlab.__all__] + RANK_SIDE + [
        "meshlab.Session.run", "meshlab.Session.export", "meshlab.Cluster.run",
        "meshlab.ParallelPlan.data_parallel"]
    missing = [n for n in names if f'id="{n}"' not in api]
    assert not missing, f"the API reference has no entry for {missing}"


@pytest.mark.notebook
@pytest.mark.timeout(SITE_TIMEOUT)
def test_the_model_matrix_is_in_the_combinations_guide(site: Path) -> None:
    page = (site / "docs" / "guides" / "combinations.html").read_text()
    assert "<p>family</p></th>" in page and "<p>init=meta</p></th>" in page
    assert "Mixtral" in page and "refused (1)" in page
