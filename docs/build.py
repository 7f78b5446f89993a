"""Build meshlab's documentation site into docs/_build/html (open its index.html).

    $ pip install -e ".[docs]"
    $ python docs/build.py                  # execute the tour, then build (~20 min on 2 cores)
    $ python docs/build.py                  # again: only notebooks changed since are executed
    $ python docs/build.py --executed DIR   # executed copies from DIR (the missing executed here)
    $ python docs/build.py --fresh          # execute every notebook again (meshlab changed)

Warnings are errors (``sphinx-build -W -n --keep-going``): a broken link, a reference that
does not resolve, a notebook without its executed copy fail the build. The built site is then
checked to make no request off the reader's machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
NOTEBOOKS = ROOT / "notebooks"
BUILD = DOCS / "_build"
STAMP = "meshlab_docs_source"  # metadata key: the hash of the source an executed copy ran
# An outside URL where a page would fetch it: src/href of script, link, img, iframe, source,
# and CSS imports or url()s.
OUTSIDE = re.compile(
    r"<(?:script|link|img|iframe|source|embed)\b[^>]*?\b(?:src|href)\s*=\s*[\"']?\s*"
    r"((?:https?:)?//[^\"'\s>]+)"
    r"|@import\s+(?:url\()?\s*[\"']?((?:https?:)?//[^\"')\s]+)"
    r"|url\(\s*[\"']?((?:https?:)?//[^\"')\s]+)", re.I)


def source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def execute(path: Path, into: Path) -> Path:
    """Run one tour notebook in a real kernel (in a scratch folder) and save it into ``into``."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="meshlab-docs-") as cwd:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": cwd}}).execute()
    nb.metadata[STAMP] = source_hash(path)
    into.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, into / path.name)
    return into / path.name


def executed_copies(given: Path | None, cache: Path, fresh: bool) -> Path:
    """The folder of executed copies: ``given`` where it has a notebook, else ``cache``,
    executing there what is missing or ran an older source."""
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        if given is not None and (given / path.name).is_file():
            if given != cache:
                cache.mkdir(parents=True, exist_ok=True)
                (cache / path.name).write_bytes((given / path.name).read_bytes())
            continue
        copy = cache / path.name
        if not fresh and copy.is_file() and nbformat.read(copy, as_version=4).metadata.get(
                STAMP) == source_hash(path):
            continue
        started = time.monotonic()
        print(f"executing {path.name} ...", flush=True)
        execute(path, cache)
        print(f"  {path.name}: {time.monotonic() - started:.0f} s", flush=True)
    return cache


def outside_requests(html: Path) -> list[str]:
    """Every place a built page or stylesheet would fetch something from another machine."""
    found = []
    for page in sorted([*html.rglob("*.html"), *html.rglob("*.css")]):
        for match in OUTSIDE.finditer(page.read_text(errors="replace")):
            found.append(f"{page.relative_to(html)}: {next(g for g in match.groups() if g)}")
    return found


def build(out: Path, notebooks: Path) -> int:
    """sphinx-build, warnings as errors; the exit status."""
    command = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "-n", "--keep-going", "-E",
               "-q", "-c", str(DOCS), "-d", str(out.parent / "doctrees"), str(ROOT), str(out)]
    env = {**os.environ, "MESHLAB_DOCS_NOTEBOOKS": str(notebooks)}
    return subprocess.run(command, cwd=ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--executed", type=Path, metavar="DIR",
                        help="executed copies of the tour notebooks to use as they are")
    parser.add_argument("--fresh", action="store_true",
                        help="execute every notebook again, even one whose copy is current")
    parser.add_argument("--out", type=Path, default=BUILD / "html", metavar="DIR",
                        help="where the HTML goes (default: docs/_build/html)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    given = args.executed.resolve() if args.executed else None
    notebooks = executed_copies(given, out.parent / "executed", args.fresh)
    status = build(out, notebooks)
    if status:
        print(f"the build failed (sphinx-build exited {status}): see the warnings above",
              file=sys.stderr)
        return status
    outside = outside_requests(out)
    if outside:
        print("the site would fetch from other machines:\n  " + "\n  ".join(outside),
              file=sys.stderr)
        return 1
    print(f"built {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
