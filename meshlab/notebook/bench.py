"""Notebook side of ``%mesh bench``: run meshlab.kernels.bench on the ranks, gather one
table, and mark the slow ranks; then show it as one compact table and a chart."""

from __future__ import annotations

from typing import Any, cast

import altair as alt
import pandas as pd

from meshlab.notebook.charts import AXIS_FORMAT, WIDTH, OfflineChart, chart_legend
from meshlab.notebook.cluster import Cluster
from meshlab.notebook.palette import rank_colour
from meshlab.notebook.ranks import format_ranks
from meshlab.notebook.tables.table import Table, sig

BUILT_IN = ("rmsnorm", "softmax", "swiglu", "cross_entropy")
MODE_WORDS = {"fwd": "forward", "bwd": "backward", "full": "forward + backward"}


def run_bench(cluster: Cluster, target: str, *, ref: str | None = None,
              sizes: list[int] | None = None, dtype: str = "float32", mode: str = "fwd",
              rows: int | None = None, ranks: str | None = None) -> pd.DataFrame:
    """Benchmark a built-in kernel (by name) or an expression on the ranks (a callable
    defined in a %%mesh cell) on every rank; one row per (rank, provider, size)."""
    kernel = repr(target) if target in BUILT_IN else target
    code = ("from meshlab.kernels.bench import bench as _meshlab_bench\n"
            f"_meshlab_bench({kernel}, {ref or 'None'}, sizes={sizes or [256, 1024]!r}, "
            f"dtype={dtype!r}, mode={mode!r}, rows={rows!r}, name={target!r})")
    result = cluster.run(code, ranks, keep_values=True, timeout=600)
    frame = pd.concat(list(result.values.values()), ignore_index=True)
    # the same kernel, size and provider on every rank: how far each is from the fastest
    fastest = frame.groupby(["provider", "size"])["median_ms"].transform("min")
    return frame.assign(vs_fastest_rank=frame["median_ms"] / fastest)


def bench_table(frame: pd.DataFrame) -> Table:
    """The benchmark in one row per (provider, size) over all ranks: the fastest and the
    slowest rank's median time, how far apart they are, GB/s where it means a speed, the
    largest error and the check. What every row shares (kernel, mode, dtype, device) is the
    caption."""
    out = []
    for (provider, size), group in frame.groupby(["provider", "size"], sort=False):
        timed = group[group["median_ms"].notna()]
        timer = str(group["timer"].iloc[0])
        row: dict[str, Any] = {"provider (timer)": f"{provider} ({timer})",
                               "row length": int(cast(int, size)), "_first": provider != "triton"}
        if len(timed):
            by_time = timed.sort_values("median_ms", kind="stable")
            fast, slow = by_time.iloc[0], by_time.iloc[-1]
            row |= {"fastest rank (ms)": fast["median_ms"],
                    "slowest rank (ms)": slow["median_ms"], "slowest rank": int(slow["rank"]),
                    "slowest / fastest": slow["median_ms"] / fast["median_ms"]}
            # an interpreter's GB/s is not a bandwidth: left empty
            if timer != "interpreter" and timed["gbps"].notna().any():
                row["GB/s (median rank)"] = timed["gbps"].median()
            peak = pd.to_numeric(timed["peak_pct"], errors="coerce")
            if peak.notna().any():
                row["% of HBM peak (median rank)"] = peak.median()
        if provider != "torch":  # the reference's error against itself says nothing
            row["max |error| vs torch"] = pd.to_numeric(group["max_error"], errors="coerce").max()
        row["check"] = _check(group)
        out.append(row)
    columns = ["provider (timer)", "row length", "fastest rank (ms)", "slowest rank (ms)",
               "slowest rank", "slowest / fastest", "GB/s (median rank)",
               "% of HBM peak (median rank)", "max |error| vs torch", "check"]
    table = pd.DataFrame(out).sort_values(["_first", "row length"], kind="stable")
    table = table[[c for c in columns if c in table]].reset_index(drop=True)
    three = sig(3)
    formats = {"row length": _blank_or("{:d}"), "fastest rank (ms)": three,
               "slowest rank (ms)": three, "slowest rank": _blank_or("{:d}"),
               "slowest / fastest": _blank_or("{:.2f}x"), "GB/s (median rank)": three,
               "% of HBM peak (median rank)": _blank_or("{:.0f}"),
               "max |error| vs torch": _blank_or("{:.2g}")}
    same = [str(frame[c].iloc[0]) for c in ("kernel", "mode", "dtype", "device")
            if c in frame and frame[c].nunique() == 1]
    interpreted = bool((frame["timer"] == "interpreter").any())
    caption = " · ".join(same) + ("  (interpreter rows: Triton's CPU interpreter, not kernel "
                                  "speed)" if interpreted else "")
    ranks = sorted(set(frame["rank"].astype(int)))
    notes = [f"{len(ranks)} rank{'s' if len(ranks) > 1 else ''} ({format_ranks(ranks)}); "
             "times are each rank's median"]
    modes = list(dict.fromkeys(frame["mode"]))
    notes.append(", ".join(f"{m}: {MODE_WORDS.get(m, m)}" for m in modes))
    if interpreted:
        notes.append("no GB/s for interpreter rows: they check results and the harness")
    return Table(table, caption=caption, formats=formats, note="; ".join(notes))


def _blank_or(pattern: str) -> Any:
    """A format that leaves a missing value (NaN) blank."""
    def fmt(value: Any) -> str:
        return "" if value is None or value != value else pattern.format(
            int(value) if "d}" in pattern else value)
    return fmt


def _check(group: pd.DataFrame) -> str:
    """The check of one (provider, size) over the ranks, in words: what failed where."""
    results = [(int(r), bench_result(str(p), c) if e is None or e != e or
                str(e).startswith("wrong result") else "error")
               for r, p, c, e in zip(group["rank"], group["provider"], group["correct"],
                                     group["error"], strict=True)]
    by: dict[str, list[int]] = {}
    for rank, result in results:
        by.setdefault(result, []).append(rank)
    if len(by) == 1:
        return f"{next(iter(by))}, every rank"
    return "; ".join(f"{result} on {format_ranks(ranks)}" for result, ranks in by.items())


def bench_views(frame: pd.DataFrame) -> list[Table | OfflineChart]:
    """What ``%mesh bench`` shows: the compact table and, if anything was timed, the chart."""
    views: list[Table | OfflineChart] = [bench_table(frame)]
    if frame["median_ms"].notna().any():
        views.append(bench_chart(frame))
    return views


BENCH_RESULTS = {"matches the reference": ("circle", 70, "white"),
                 "the reference": ("square", 60, "white"),
                 "wrong result": ("cross", 280, "#000000"),
                 "not checked": ("triangle-up", 70, "white")}
"""How a benchmark point is drawn by its check: a wrong result a large cross outlined black
(red would read as rank 3's colour, palette.RANKS[3]; no rank is black)."""


def bench_path(provider: str, timer: str) -> str:
    """Which code produced a benchmark row's time: an interpreter timing is not a kernel
    speed, so it never shares an axis with one."""
    if timer == "interpreter":
        return f"{provider}, in Triton's CPU interpreter"
    if timer == "do_bench":
        return f"{provider}, on the GPU (do_bench)"
    return f"{provider}, eager on the CPU (wall clock)"


def bench_result(provider: str, correct: Any) -> str:
    """A row's check against the reference, in words."""
    if provider == "torch":
        return "the reference"
    if correct is None or correct != correct:  # NaN: nothing to compare with
        return "not checked"
    return "matches the reference" if bool(correct) else "wrong result"


def bench_chart(frame: pd.DataFrame) -> OfflineChart:
    """Time per call (GB/s where every panel is compiled code) against row length, one
    panel per provider and the path that ran it, one line per rank in its colour: a slow
    rank stands out. Triton's CPU interpreter has a panel and a time axis of its own (its
    milliseconds are not a kernel's); a wrong result is a large cross outlined black."""
    data = frame[frame["median_ms"].notna()].copy()  # timed, right or wrong
    data["path"] = [bench_path(p, t) for p, t in zip(data["provider"], data["timer"],
                                                      strict=True)]
    data["result"] = [bench_result(p, c) for p, c in zip(data["provider"], data["correct"],
                                                         strict=True)]
    data["rank"] = data["rank"].astype(int)
    paths = list(dict.fromkeys(data.sort_values("provider", key=lambda s: s != "triton")["path"]))
    interpreted = bool((data["timer"] == "interpreter").any())
    bandwidth = not interpreted and data["gbps"].notna().all() and len(data) > 0
    y_field, y_title = ("gbps", "bandwidth (GB/s)") if bandwidth else ("median_ms",
                                                                      "median time (ms)")
    ranks = sorted(data["rank"].unique())
    sizes = sorted(set(data["size"].astype(int)))
    colour = alt.Color("rank:O", title="rank", sort=ranks, legend=chart_legend("rank"),
                       scale=alt.Scale(domain=ranks, range=[rank_colour(r) for r in ranks]))
    # every result in the scales (a one-value range draws nothing), the legend lists those shown
    results = [r for r in BENCH_RESULTS if r in set(data["result"])]
    check = chart_legend("check", values=results)  # the shape, size and stroke of a point
    # ordinal: a point scale (the default for a nominal size) would interpolate the sizes
    shape, size, stroke = (alt.Scale(type="ordinal", domain=list(BENCH_RESULTS),
                                     range=[v[i] for v in BENCH_RESULTS.values()])
                           for i in range(3))
    tooltip = [alt.Tooltip("rank:O"), alt.Tooltip("path:N", title="ran as"),
               alt.Tooltip("size:Q", title="row length (elements)", format="d"),
               alt.Tooltip("median_ms:Q", title="median (ms)", format=",.3~r"),
               alt.Tooltip("p20_ms:Q", title="20th percentile (ms)", format=",.3~r"),
               alt.Tooltip("p80_ms:Q", title="80th percentile (ms)", format=",.3~r"),
               alt.Tooltip("result:N", title="check"),
               alt.Tooltip("max_error:Q", title="max error vs reference", format=".3~g")]
    if bandwidth:
        tooltip.insert(6, alt.Tooltip("gbps:Q", title="GB/s", format=",.3~r"))
    def span(values: pd.Series, margin: float) -> list[float]:
        """A log axis's domain with room for the markers at either end."""
        low, high = float(values.min()), float(values.max())
        return [low / margin, high * margin] if low > 0 else [high / 10, high * margin]

    if len(sizes) > 1:
        # log2: sizes are powers of two or near them; ticks at the sizes run, as integers
        x = alt.X("size:Q", title="row length (elements, log scale)",
                  scale=alt.Scale(type="log", base=2, domain=span(data["size"], 1.25)),
                  axis=alt.Axis(values=sizes, format="d", labelOverlap="greedy"))
    else:  # one size: a dot per rank, not one lonely dot per line
        x = alt.X("rank:O", title=f"rank (row length {sizes[0] if sizes else 0})",
                  sort=ranks, axis=alt.Axis(labelAngle=0))
    width = max(200, min(WIDTH // max(1, len(paths)), 300))

    def panel(path: str) -> alt.LayerChart | alt.FacetChart:
        # its own time axis for the interpreter: its milliseconds are not a kernel's
        values = data.loc[data["path"] == path, y_field] if interpreted else data[y_field]
        low, high = float(values.min()), float(values.max())
        if low > 0 and high / low > 8:  # log: sizes and ranks apart by orders of magnitude
            scale = alt.Scale(type="log", domain=span(values, 1.15))
            title = y_title.replace(")", ", log)")
        else:  # a linear axis reads better, and labels more ticks, over a narrow range
            pad = 0.1 * (high - low) or 0.1 * high or 1.0
            scale = alt.Scale(domain=[max(0.0, low - pad), high + pad], nice=False)
            title = y_title
        y = alt.Y(f"{y_field}:Q", title=title, scale=scale,
                  axis=alt.Axis(format=AXIS_FORMAT, tickCount=5, labelOverlap="greedy"))
        points = alt.Chart().mark_point(filled=True, strokeWidth=2, opacity=1).encode(
            x=x, y=y, color=colour, tooltip=tooltip,
            shape=alt.Shape("result:N", scale=shape, legend=check),
            size=alt.Size("result:N", scale=size, legend=check),
            stroke=alt.Stroke("result:N", scale=stroke, legend=check))
        lines = alt.Chart().mark_line(strokeWidth=1.5).encode(x=x, y=y, color=colour,
                                                             detail="rank:O")
        return alt.layer(*([lines, points] if len(sizes) > 1 else [points]),
                         data=data[data["path"] == path]).properties(
            width=width, height=180, title=alt.TitleParams(path, fontSize=11, anchor="start"))

    chart = alt.hconcat(*(panel(p) for p in paths), spacing=24)
    first = data.iloc[0] if len(data) else None
    what = (f"{first['kernel']} ({first['mode']}, {first['dtype']})" if first is not None
            else "no timed rows")
    notes = ["one line per rank, in its colour" if len(sizes) > 1
             else "one dot per rank, in its colour"]
    if interpreted:
        notes.append("each panel has its own time axis: the interpreter's times check the "
                     "harness, they are not a kernel's speed")
    untimed = sorted(set(frame["provider"]) - set(data["provider"]))
    if untimed:
        notes.append(f"{', '.join(untimed)}: not timed on any rank (the errors are printed "
                     "above the chart)")
    wrong = data[data["result"] == "wrong result"]
    if len(wrong):
        ranks_wrong = sorted(set(wrong["rank"]))
        sizes_wrong = ", ".join(map(str, sorted(set(wrong["size"].astype(int)))))
        notes.append(f"black cross: a wrong result (rank{'s' if len(ranks_wrong) > 1 else ''} "
                     f"{format_ranks(ranks_wrong)}, row length {sizes_wrong})")
    label = "bandwidth" if bandwidth else "median time per call"
    return OfflineChart(chart.properties(title=alt.TitleParams(
        f"{what}: {label} by {'row length' if len(sizes) > 1 else 'rank'}",
        subtitle=notes, anchor="start")))
