"""Tables and text as the notebook shows them: a caption, numbers formatted for reading, a
note under the table, and lines that wrap between words rather than inside them.

Units, the same in every table: the frames a user computes with hold bytes, seconds and
fractions; a table shows bytes in the unit its chart uses (B, KiB, MiB or GiB: the one that
shows the table's largest value as 1 to 1023), times in s, ms or µs chosen the same way, each
named in its column's header (``params (MiB)``, ``step (ms)``), and fractions as percentages.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

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


def percent(digits: int = 3) -> Callable[[Any], str]:
    """A formatter: a fraction as a percentage to ``digits`` significant figures (0.517 ->
    51.7%, 0.0000177 -> 0.00177%)."""
    three = sig(digits)

    def fmt(value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return ""
        return f"{three(float(value) * 100)}%"
    return fmt


class InUnit(NamedTuple):
    """A frame with some columns scaled into one unit, named in their headers."""

    frame: pd.DataFrame
    formats: dict[str, Format]
    """The scaled columns' formats, by their new names."""
    unit: str


def in_byte_unit(frame: pd.DataFrame, columns: Sequence[str]) -> InUnit:
    """``frame`` with the byte counts of ``columns`` in the unit a chart of them would use,
    named in each header (``params`` -> ``params (MiB)``)."""
    from meshlab.notebook.charts import byte_unit

    return _in_unit(frame, columns, byte_unit)


def in_second_unit(frame: pd.DataFrame, columns: Sequence[str]) -> InUnit:
    """``frame`` with the seconds of ``columns`` in s, ms or µs, named in each header."""
    from meshlab.notebook.charts import second_unit

    return _in_unit(frame, columns, second_unit)


def _in_unit(frame: pd.DataFrame, columns: Sequence[str],
             unit_of: Callable[[float], tuple[str, float]]) -> InUnit:
    present = [c for c in columns if c in frame]
    values = frame[present].abs().to_numpy(dtype=float, na_value=math.nan).ravel()
    largest = float(pd.Series(values).max()) if values.size else 0.0
    unit, size = unit_of(largest if math.isfinite(largest) else 0.0)
    names = {c: f"{c} ({unit})" for c in present}
    scaled = frame.assign(**{c: frame[c] / size for c in present}).rename(columns=names)
    # whole bytes stay whole; a scaled value keeps three significant figures
    fmt: Format = "{:,.0f}" if unit == "B" else sig(3)
    return InUnit(scaled, {name: fmt for name in names.values()}, unit)


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
        # blank where a value is missing, as the HTML's formats show it
        body = self.frame.to_string(index=self.index, formatters=self.formats, na_rep="")
        return "\n".join(p for p in (self.caption, body, self.note) if p)

    def __repr__(self) -> str:
        return self.text()

    # `status = %mesh status; status["host"]`: a table reads as the frame it shows
    def __getitem__(self, key: Any) -> Any:
        return self.frame[key]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "frame":  # not while unpickling or half-built
            raise AttributeError(name)
        return getattr(self.frame, name)

    def __len__(self) -> int:
        return len(self.frame)


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
