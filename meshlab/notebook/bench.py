"""Notebook side of ``%mesh bench``: run meshlab.kernels.bench on the ranks, gather one
table, and mark the slow ranks."""

from __future__ import annotations

import pandas as pd

from meshlab.notebook.cluster import Cluster

BUILT_IN = ("rmsnorm", "softmax", "swiglu", "cross_entropy")


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
