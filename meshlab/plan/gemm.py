"""How fast one GEMM runs: the share of peak a matmul of shape (M, N, K) reaches.

A GPU computes a GEMM in output tiles, one per streaming multiprocessor at a time, so:

- **waves**: ceil(M/tm) x ceil(N/tn) tiles run in waves of ``sms``; a last wave that is
  partly empty wastes the rest (wave quantization: NVIDIA's "Matrix Multiplication
  Background" guide, sections on tile and wave quantization);
- **depth**: each tile loops over K; filling and draining its pipeline costs about as much
  as ``gemm_k0`` more of K, so efficiency grows as K / (K + k0) (a 128-deep head_dim
  matmul runs far below a 12,288-deep one);
- **split-K**: a GEMM with fewer tiles than multiprocessors (a small weight's gradient over
  many tokens) has its K shared out over the idle ones, in slices of at least SPLIT_K_MIN;
- **bandwidth**: a GEMM cannot run faster than reading A and B and writing C once
  (a roofline at the memory bandwidth: skinny GEMMs are memory-bound);
- and a large square GEMM's ceiling, ``matmul_efficiency``.

The four come from the hardware profile (``%mesh calibrate`` fits them on a sweep of shapes).
Plain Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshlab.plan.hardware import Hardware


@dataclass(frozen=True)
class Gemm:
    """``count`` matmuls of (M x K) @ (K x N) in one forward of one layer on one GPU, run
    as one batch."""

    what: str
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


def efficiency(hw: Hardware, m: int, n: int, k: int, count: int = 1) -> float:
    """Share of the dtype's peak that ``count`` (M, N, K) GEMMs run as one batch (their
    tiles share the waves, as a batched GEMM's do) reach on ``hw``."""
    return hw.matmul_efficiency * shape_factor(m, n, k, count, sms=hw.sms, tile=hw.gemm_tile,
                                               k0=hw.gemm_k0)


def shape_factor(m: int, n: int, k: int, count: int = 1, *, sms: int, tile: tuple[int, int],
                 k0: float) -> float:
    """What a GEMM's shape keeps of the ceiling: useful tiles x filled waves x depth."""
    if min(m, n, k, count) < 1:
        raise ValueError(f"a GEMM needs M, N, K and a count >= 1, got ({m}, {n}, {k}) "
                         f"x {count}")
    tm, tn = tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    # the tiles' useful share (edge tiles are partly empty), then the waves' filled share
    useful = m * n / (tiles * tm * tn)
    tiles *= count
    depth = float(k)
    if tiles < sms:  # split-K: too few tiles to fill the GPU share K out over the idle ones
        splits = max(1, min(sms // tiles, k // SPLIT_K_MIN))
        tiles, depth = tiles * splits, depth / splits
    waves = tiles / (math.ceil(tiles / sms) * sms)
    return useful * waves * depth / (depth + k0)


SPLIT_K_MIN = 256  # the shallowest slice of K cuBLAS hands one multiprocessor when it splits
K0_GRID = (0, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def fit_depth(points: list[tuple[int, int, int, float]], *, sms: int,
              tile: tuple[int, int]) -> tuple[float, float]:
    """``(gemm_k0, ceiling)``: the pipeline-fill depth and the ceiling (in the points' unit)
    that best explain measured ``(M, N, K, rate)`` points, least squares on the log of the
    rate (a ratio error counts the same at any size), k0 from a grid."""
    if len(points) < 2:
        raise ValueError(f"fitting a GEMM's depth needs 2 or more shapes, got {len(points)}")
    best: tuple[float, float, float] | None = None
    for k0 in K0_GRID:
        logs = [math.log(rate / shape_factor(m, n, k, sms=sms, tile=tile, k0=k0))
                for m, n, k, rate in points]
        mean = sum(logs) / len(logs)
        error = sum((x - mean) ** 2 for x in logs)
        if best is None or error < best[0] - 1e-12:
            best = (error, float(k0), math.exp(mean))
    assert best is not None
    return best[1], best[2]


def seconds(hw: Hardware, gemm: Gemm, dtype: str, dtype_bytes: int) -> float:
    """Time of ``gemm`` (all its ``count``): compute at its efficiency, or reading and
    writing its matrices, whichever is longer."""
    g = gemm
    traffic = dtype_bytes * (g.m * g.k + g.k * g.n + g.m * g.n) * g.count
    return max(compute_seconds(hw, g, dtype), traffic / (hw.memory_bandwidth_gbs * 1e9))


def compute_seconds(hw: Hardware, gemm: Gemm, dtype: str) -> float:
    """Time of ``gemm``'s arithmetic alone, at the efficiency its shape allows: a fused
    kernel's products whose M x N result never reaches memory (FlashAttention's scores)."""
    g = gemm
    return g.flops / (hw.tflops_peak(dtype) * 1e12 * hw.ceiling(dtype)
                      * shape_factor(g.m, g.n, g.k, g.count, sms=hw.sms, tile=hw.gemm_tile,
                                     k0=hw.gemm_k0))


def training_seconds(hw: Hardware, gemm: Gemm, dtype: str, dtype_bytes: int) -> float:
    """Forward and backward of ``gemm``: the backward's two GEMMs (the input's gradient,
    M x K from M x N @ N x K; the weight's, K x N from K x M @ M x N) at their own shapes."""
    g = gemm
    return sum(seconds(hw, Gemm(g.what, m, n, k, g.count), dtype, dtype_bytes)
               for m, n, k in ((g.m, g.n, g.k), (g.m, g.k, g.n), (g.k, g.n, g.m)))
