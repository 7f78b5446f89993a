"""A layout diff as the notebook shows it (``%mesh compare``): the verdict, the ten largest
differences, and the module x step picture of every tensor (charts/layout_diff.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

from meshlab.notebook.tables.table import Lines, Table

if TYPE_CHECKING:
    from meshlab.verify.layout_diff import LayoutDiff

def layout_diff_frame(diff: LayoutDiff) -> pd.DataFrame:
    """One row per (phase, module, step): the largest error over the ranks, the ranks beyond
    the tolerance, the shape, its place in the order differences are born, and whether it is
    the first difference."""
    rows = [{"phase": d.phase, "module": d.module or "(the model)", "step": d.step,
             "rank": f"{d.layout} {d.rank}" if d.layout else d.rank, "error": d.error,
             "tolerance": d.tolerance,
             "shape": "x".join(map(str, d.shape)), "born": i, "ok": d.ok}
            for i, d in enumerate(diff.born())]
    if not rows:
        return pd.DataFrame(columns=["phase", "module", "step", "error", "tolerance", "shape",
                                     "born", "ranks beyond", "first"])
    frame = pd.DataFrame(rows)
    beyond = (frame[~frame["ok"]].groupby(["phase", "module", "step"])["rank"]
              .agg(lambda r: ",".join(map(str, sorted(r)))))
    keys = ["phase", "module", "step"]
    worst = frame.sort_values("error").groupby(keys).tail(1).set_index(keys)
    worst["born"] = frame.groupby(keys)["born"].min()  # where the key's first rank is born
    worst["ranks beyond"] = [beyond.get(key, "") for key in worst.index]
    out = worst.reset_index().drop(columns=["rank", "ok"])
    first = diff.first
    out["first"] = [first is not None and (p, m, s) == (first.phase, first.module or
                                                       "(the model)", first.step)
                    for p, m, s in zip(out["phase"], out["module"], out["step"], strict=True)]
    return out.sort_values("born").reset_index(drop=True)


def sci(value: float) -> str:
    """An error or tolerance as a power of ten reads: 1.9e+00, 1e-10."""
    return f"{value:.1e}" if value else "0"


def worst_table(diff: LayoutDiff, n: int = 10) -> Table:
    """The ``n`` largest errors, one per (module, phase), with the ranks beyond tolerance."""
    frame = layout_diff_frame(diff)
    top = (frame.sort_values("error", ascending=False).drop_duplicates(["module", "phase"])
           .head(n))
    return Table(top[["module", "phase", "step", "error", "tolerance", "shape",
                      "ranks beyond"]],
                 caption=f"the {min(n, len(top))} largest differences from {diff.against}",
                 formats={"error": sci, "tolerance": sci},
                 note="error: largest |difference| over the tensor's largest magnitude "
                      "(an update in float32: over its parameter's)")


def layout_diff_views(diff: LayoutDiff) -> list[Any]:
    """What ``%mesh compare`` shows: the verdict, then (when something differs) the table
    of the largest differences, and the picture of every tensor."""
    from meshlab.notebook.charts import layout_diff_chart

    views: list[Any] = [Lines(str(diff))]
    if not diff.ok:
        views.append(worst_table(diff))
    if diff.differences:
        views.append(layout_diff_chart(layout_diff_frame(diff), diff.against))
    return views
