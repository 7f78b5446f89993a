"""Sphinx extension: a tour notebook's page shows its executed copy, in static form.

The repository keeps ``notebooks/*.ipynb`` without outputs. ``docs/build.py`` (or the docs
test) executes them with nbclient into a folder and names it in ``$MESHLAB_DOCS_NOTEBOOKS``;
here each notebook's source is swapped for that copy as Sphinx reads it. A notebook without
one is a warning, so a strict build fails naming it.

What a page must not do is load a widget manager or Vega from a CDN. Outputs keep only their
static forms: a chart shows the SVG drawn in the kernel (its Vega-Lite spec is dropped), the
sharding widget its HTML fallback (the widget view is dropped).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import nbformat
from sphinx.application import Sphinx
from sphinx.util import logging

ENV = "MESHLAB_DOCS_NOTEBOOKS"
STDERR = "application/vnd.jupyter.stderr"
# What a page shows of an output, static all: anything else (a widget view, a Vega-Lite spec,
# JavaScript) would need a script that is not on the page.
SHOWN = ("text/plain", "text/html", "text/markdown", "text/latex", "image/svg+xml",
         "image/png", "image/jpeg", "image/gif")

logger = logging.getLogger(__name__)


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("source-read", use_executed_copy)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


def use_executed_copy(app: Sphinx, docname: str, source: list[str]) -> None:
    """Swap a tour notebook's source for its executed copy, in static form."""
    if not docname.startswith("notebooks/"):
        return
    name = docname.split("/", 1)[1] + ".ipynb"
    folder = os.environ.get(ENV)
    copy = Path(folder) / name if folder else None
    if copy is None or not copy.is_file():
        logger.warning("%s has no executed copy (looked for %s): build with "
                       "`python docs/build.py`, which executes the tour first",
                       name, copy or f"${ENV}/{name}", type="meshlab", subtype="tour",
                       location=docname)
        return
    notebook = nbformat.read(copy, as_version=4)
    source[0] = nbformat.writes(static_form(notebook))


def static_form(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook with every output in its static forms and the saved widget state removed
    (no manager will read it on the page)."""
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        outputs = cell.get("outputs", [])
        for i, output in enumerate(outputs):
            data = output.get("data", {})
            if STDERR in data:  # a rank's stderr, as meshlab displays it: a stderr stream
                outputs[i] = nbformat.v4.new_output("stream", name="stderr", text=data[STDERR])
                continue
            for mime in [m for m in data if m not in SHOWN]:
                del data[mime]  # the widget view, the Vega-Lite spec: what needs scripts
    return notebook
