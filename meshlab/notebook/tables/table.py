"""Tables and text as the notebook shows them: a caption, numbers formatted for reading, a
note under the table, and lines that wrap between words rather than inside them."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd

Format = str | Callable[[Any], str]


def sig(digits: int = 3) -> Callable[[Any], str]:
    """A formatter: ``digits`` significant figures, thousands separated (593.413877 -> 593,
    311000.0 -> 311,000, 0.000123456 -> 0.000123, 0.5 -> 0.5)."""
    def fmt(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return ""
        x = float(value)
        if x == 0 or not math.isfinite(x):
            return f"{x:g}"
        decimals = digits - 1 - math.floor(math.log10(abs(x)))
        text = f"{round(x, decimals):,.{max(0, decimals)}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    return fmt


class Table:
    """A DataFrame with a caption, per-column formats and a note, as HTML and as text."""

    def __init__(self, frame: pd.DataFrame, *, caption: str = "",
                 formats: Mapping[str, Format] | None = None, note: str = "",
                 index: bool = False) -> None:
        self.frame, self.caption, self.note, self.index = frame, caption, note, index
        self.formats = {c: _callable(f) for c, f in (formats or {}).items() if c in frame}

    def _repr_html_(self) -> str:
        styler = self.frame.style.format(self.formats)  # type: ignore[arg-type]
        if not self.index:
            styler = styler.hide(axis="index")
        if self.caption:
            styler = styler.set_caption(html.escape(self.caption)).set_table_styles(
                [{"selector": "caption", "props": "caption-side: top; text-align: left; "
                                                  "font-weight: bold;"}])
        note = (f'<p style="margin: 2px 0; white-space: normal;">{html.escape(self.note)}'
                "</p>" if self.note else "")
        return styler.to_html() + note

    def text(self) -> str:
        body = self.frame.to_string(index=self.index, formatters=self.formats)
        return "\n".join(p for p in (self.caption, body, self.note) if p)

    def __repr__(self) -> str:
        return self.text()


class Lines:
    """Plain text whose lines wrap at spaces, never inside a word or a number and its unit
    (JupyterLab's stream output breaks anywhere: ``310,828 to|kens/s``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def _repr_html_(self) -> str:
        style = ("white-space: pre-wrap; word-break: normal; overflow-wrap: normal; "
                 "margin: 0; font-family: var(--jp-code-font-family, monospace);")
        # a number stays on the line of its unit: "310,828&nbsp;tokens/s", "378&nbsp;TFLOP/s"
        text = re.sub(r"(\d) (?=[A-Za-z%])", "\\1\u00a0", html.escape(self.text))
        return f'<pre style="{style}">{text}</pre>'

    def __repr__(self) -> str:
        return self.text


def _callable(f: Format) -> Callable[[Any], str]:
    return f.format if isinstance(f, str) else f
