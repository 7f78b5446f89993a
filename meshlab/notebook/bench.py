"""Notebook side of ``%mesh bench``: run meshlab.kernels.bench on the ranks, gather one
table, and mark the slow ranks; then show it as one compact table and a chart."""

from __future__ import annotations

from typing import Any, cast

import pandas as pd

from meshlab.notebook.charts import OfflineChart, bench_chart, bench_result
from meshlab.notebook.cluster import Cluster
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
