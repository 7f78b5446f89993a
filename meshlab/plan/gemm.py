"""How fast one GEMM runs: the share of peak a matmul of shape (M, N, K) reaches.

A GPU computes a GEMM in output tiles, one per streaming multiprocessor at a time, so:

- **waves**: ceil(M/tm) x ceil(N/tn) tiles run in waves of ``sms``; a last wave that is
  partly empty wastes the rest (wave quantization: NVIDIA's "Matrix Multiplication
  Background" guide, sections on tile and wave quantization);
- **depth**: each tile loops over K; filling and draining its pipeline costs about as much
  as ``gemm_k0`` more of K, so efficiency grows as K / (K + k0) (a 128-deep head_dim
  matmul runs far below a 12,288-deep one);
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
    if min(m, n, k, count) < 1:
        raise ValueError(f"a GEMM needs M, N, K and a count >= 1, got ({m}, {n}, {k}) "
                         f"x {count}")
    tm, tn = hw.gemm_tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    # the tiles' useful share (edge tiles are partly empty), then the waves' filled share
    useful = m * n / (tiles * tm * tn)
    tiles *= count
    waves = tiles / (math.ceil(tiles / hw.sms) * hw.sms)
    depth = k / (k + hw.gemm_k0)
    return hw.matmul_efficiency * useful * waves * depth


def seconds(hw: Hardware, gemm: Gemm, dtype: str, dtype_bytes: int) -> float:
    """Time of ``gemm`` (all its ``count``): compute at its efficiency, or reading and
    writing its matrices, whichever is longer."""
    g = gemm
    compute = g.flops / (hw.tflops_peak(dtype) * 1e12 * efficiency(hw, g.m, g.n, g.k, g.count))
    traffic = dtype_bytes * (g.m * g.k + g.k * g.n + g.m * g.n) * g.count
    return max(compute, traffic / (hw.memory_bandwidth_gbs * 1e9))


def training_seconds(hw: Hardware, gemm: Gemm, dtype: str, dtype_bytes: int) -> float:
    """Forward and backward of ``gemm``: the backward's two GEMMs (the input's gradient,
    M x K from M x N @ N x K; the weight's, K x N from K x M @ M x N) at their own shapes."""
    g = gemm
    return sum(seconds(hw, Gemm(g.what, m, n, k, g.count), dtype, dtype_bytes)
               for m, n, k in ((g.m, g.n, g.k), (g.m, g.k, g.n), (g.k, g.n, g.m)))
