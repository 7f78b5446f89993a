"""A long cell's progress where its user looks: one notebook output updated in place, or one
line rewritten on a terminal; ended on what the cell did (meshlab.notebook.cell_progress).

In a notebook (JupyterLab or the classic one) it is an HTML output with a display_id, not a
widget, as the start's progress is (meshlab.notebook.launch.StartProgress says why: a widget
showed the kernel idle while it worked, and a saved notebook kept only "model not found").
On a terminal it is one line on stderr, rewritten in place and taken away while the cell's
output is printed, so no output lands on it; where stderr is no terminal (a log, CI) it shows
nothing, rather than a line a second.
"""

from __future__ import annotations

import contextlib
import html
import shutil
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from meshlab.notebook.cell_progress import CellProgress
from meshlab.notebook.launch import in_kernel

T = TypeVar("T")
ERASE = "\r\x1b[K"  # back to the line's start, and clear it


class ProgressLine:
    """Shows a cell's CellProgress as it comes (``update``) and ends on its final one
    (``finish``); a cell that never reached the first showing leaves nothing."""

    def __init__(self, kind: str | None = None) -> None:
        """``kind``: "display" (a notebook output), "terminal" (a line on stderr) or "none";
        by default whichever fits where this runs."""
        self.kind = kind or ("display" if in_kernel() else
                             "terminal" if _isatty(sys.stderr) else "none")
        if self.kind not in ("display", "terminal", "none"):
            raise ValueError(f"ProgressLine kind {kind!r}: expected 'display', 'terminal' or "
                             "'none' (or nothing: the one that fits where this runs)")
        self._handle: Any = None  # the notebook's output, once shown
        self._line = ""  # the terminal's line as drawn now ("" when taken away)

    @property
    def on_progress(self) -> Callable[[CellProgress], None] | None:
        """``update``, for a run's on_progress; None where nothing shows, so that the ranks
        are not asked for what no one sees."""
        return None if self.kind == "none" else self.update

    def update(self, progress: CellProgress) -> None:
        if self.kind == "display":
            from IPython.display import display

            if self._handle is None:
                self._handle = display(_Drawn(progress), display_id=True)
            else:
                self._handle.update(_Drawn(progress))
        elif self.kind == "terminal":
            width = shutil.get_terminal_size().columns - 1
            text = progress.text()
            self._line = text if len(text) <= width else text[:max(0, width - 1)] + "…"
            sys.stderr.write(ERASE + self._line)
            sys.stderr.flush()

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """The terminal's line taken away while the block prints, then drawn again below
        what it printed (a notebook's outputs are apart: nothing to do there)."""
        line = self._line
        if line:
            sys.stderr.write(ERASE)
            sys.stderr.flush()
        try:
            yield
        finally:
            if line:
                sys.stdout.flush()
                sys.stderr.write(ERASE + line)
                sys.stderr.flush()

    def around(self, on_output: Callable[[T], None] | None) -> Callable[[T], None] | None:
        """``on_output``, printing aside from the terminal's line."""
        if on_output is None or self.kind != "terminal":
            return on_output

        def shown(result: T) -> None:
            with self.aside():
                on_output(result)
        return shown

    def finish(self, progress: CellProgress | None, cleared: bool = False) -> None:
        """End on ``progress``, the cell's final one (``CellResult.progress``): the notebook's
        output says it in place, or anew at the end if ``cleared`` took it away (LiveOutput
        replacing the live output); the terminal's line is replaced by it. A cell whose
        progress was never shown ends without a word."""
        if progress is None or not progress.shown:
            return
        if self.kind == "display":
            from IPython.display import display

            if self._handle is not None and not cleared:
                self._handle.update(_Drawn(progress))
            else:
                self._handle = display(_Drawn(progress), display_id=True)
        elif self.kind == "terminal":
            sys.stderr.write(ERASE + progress.text() + "\n")
            sys.stderr.flush()
            self._line = ""


class _Drawn:
    """A cell's progress as the notebook shows it: HTML in a notebook, its text elsewhere."""

    def __init__(self, progress: CellProgress) -> None:
        self.text, self.ended = progress.text(), progress.ended

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        state = "ended" if self.ended else "running"
        colour = ("var(--jp-ui-font-color2,#616161)" if self.ended
                  else "var(--jp-brand-color1,#1976d2)")
        return (f"<div class='meshlab-cell-progress' data-state='{state}' "
                f"style='font-family:var(--jp-code-font-family,monospace);font-size:"
                f"var(--jp-code-font-size,13px);color:{colour}'>{html.escape(self.text)}</div>")


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced by something without one, or closed
        return False
