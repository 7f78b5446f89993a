"""Sphinx configuration of meshlab's documentation site.

Build it with ``python docs/build.py`` (it executes the tour notebooks first). The source
folder is the repository root, so that the guides' relative links to ``../../notebooks/`` and
``../images/`` resolve the same way on GitHub and in the site; only ``docs/`` and
``notebooks/*.ipynb`` are read. Nothing is executed here: each tour notebook's page is its
executed copy from ``$MESHLAB_DOCS_NOTEBOOKS`` (see ``_ext/tour_notebooks.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # meshlab itself, for the API reference

project = "meshlab"
author = "the meshlab authors"
copyright = "the meshlab authors"
release = version = "0.1.0"

root_doc = "docs/index"
include_patterns = ["docs/**", "notebooks/*.ipynb"]
exclude_patterns = ["docs/_build/**", "docs/_ext/**", "docs/_static/**", "docs/_root/**"]

extensions = [
    "myst_nb",  # Markdown (MyST) and notebooks
    "sphinx.ext.autodoc",  # the API reference, from the docstrings
    "sphinx.ext.viewcode",  # each API entry links to its source, rendered locally
    "tour_notebooks",  # the executed copies of the tour notebooks
]

# -- strictness: `sphinx-build -W -n --keep-going` (docs/build.py) ----------------------------
nitpicky = True
# No intersphinx: it would fetch other projects' inventories at build time. Types from outside
# meshlab (torch, pandas, the standard library) are therefore written, not linked; a reference
# to a meshlab name must resolve.
nitpick_ignore_regex = [(r"py:.*", r"(?!meshlab\b).*")]

# -- Markdown ---------------------------------------------------------------------------------
myst_heading_anchors = 3  # `guide.md#a-heading` links, with GitHub's slugs
myst_enable_extensions = ["colon_fence"]

# -- notebooks: shown as executed, never executed here ----------------------------------------
nb_execution_mode = "off"
nb_ipywidgets_js: dict[str, dict[str, str]] = {}  # no widget manager from a CDN, ever
# tour_notebooks keeps only an output's static forms; should a widget view or script slip
# through, it is never chosen, and a chart's SVG goes before any HTML beside it.
nb_mime_priority_overrides = [
    ("html", "application/vnd.jupyter.widget-view+json", None),
    ("html", "application/javascript", None),
    ("html", "image/svg+xml", 25),
]
nb_merge_streams = True  # a print split by the kernel's flushes reads as one block
# meshlab's error summaries are not Python tracebacks (a `%mesh restart` in backticks): the
# traceback lexer retries them in relaxed mode, which shows them right, and says so.
suppress_warnings = ["misc.highlighting_failure"]

# -- API reference ----------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
add_module_names = False

# -- HTML -------------------------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = "meshlab"
html_static_path = ["_static"]
html_css_files = ["meshlab.css"]
html_extra_path = ["_root"]  # index.html at the site's root, pointing at docs/index.html
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "navbar_align": "left",
    "footer_start": ["copyright"],
    "footer_end": [],  # no "Created using Sphinx": not even a link off the machine
}
html_sidebars: dict[str, list[str]] = {"docs/index": []}  # the landing page: full width
html_show_sourcelink = False
html_copy_source = False
