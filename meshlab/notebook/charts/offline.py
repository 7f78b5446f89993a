"""OfflineChart: an altair chart shown as a Vega-Lite spec (interactive in JupyterLab, live or
saved) with an SVG drawn here beside it, and the MIME types front ends render it by."""

from __future__ import annotations

import base64
import sys
from typing import Any

import altair as alt

# JupyterLab 4 and VS Code render Vega-Lite 5 themselves (vega bundled with the front end);
# altair 6 writes Vega-Lite 6, which they do not render. The charts here use nothing v6 added.
VEGALITE = "application/vnd.vegalite.v5+json"
VEGALITE_SCHEMA = "https://vega.github.io/schema/vega-lite/v5.json"  # a name, never fetched
EMBED = {"renderer": "svg", "actions": False}  # crisp, searchable; no menu of web links


def _interactive() -> bool:
    """``meshlab.notebook.charts.interactive``, read when a chart is shown. It is set on the
    package, which imports this module: importing it back here would be a circle."""
    return bool(sys.modules["meshlab.notebook.charts"].interactive)


class OfflineChart:
    """An altair chart shown as a Vega-Lite spec (interactive in JupyterLab, live or saved)
    with an SVG beside it for viewers that do not render Vega-Lite."""

    def __init__(self, chart: alt.TopLevelMixin) -> None:
        self.chart = chart

    def svg(self) -> str:
        """The chart drawn here by vl-convert (no network)."""
        import vl_convert

        return str(vl_convert.vegalite_to_svg(self.chart.to_dict()))

    def spec(self) -> dict[str, Any]:
        """The chart as the Vega-Lite 5 spec front ends render, its data inline."""
        return {**self.chart.to_dict(), "$schema": VEGALITE_SCHEMA}

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
        spec = self.chart.to_dict()
        title = spec.get("title", "")
        mark = spec.get("mark") or next((k for k in ("layer", "facet", "hconcat", "vconcat")
                                         if k in spec), "layered")
        kind = {"layer": "layered", "facet": "faceted", "hconcat": "panelled",
                "vconcat": "panelled"}.get(mark, mark) if isinstance(mark, str) else mark["type"]
        text = f"<{kind} chart: {title.get('text', '') if isinstance(title, dict) else title}>"
        try:
            bundle: dict[str, Any] = {"image/svg+xml": self.svg(), "text/plain": text}
        except ImportError:  # a broken install: say so beside the chart, not as a traceback
            bundle = {"text/plain": f"{text} (no SVG drawn: vl-convert-python is not "
                                    "installed; pip install vl-convert-python)"}
        if not _interactive():
            return bundle, {}
        if "image/svg+xml" in bundle:
            bundle["image/png"] = png_of(bundle["image/svg+xml"])
        bundle[VEGALITE] = self.spec()
        return bundle, {VEGALITE: {"embed_options": EMBED}}


def png_of(svg: str) -> str:
    """The SVG as a base64 PNG. JupyterLab's Vega renderer writes a PNG into any chart output
    that lacks one the first time it draws it, which marks a saved notebook modified as soon as
    it is opened; with one already there it leaves the output as it is."""
    import vl_convert

    return base64.b64encode(vl_convert.svg_to_png(svg, scale=1)).decode()
