"""Matmul throughput per dtype and memory copy bandwidth, timed on every rank at once.

Every rank multiplies (and copies) at the same time, so ranks that share cores or a memory
bus slow each other as they do in training; each figure is the slowest rank's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshlab.measure.timing import median_seconds, slowest, windowed_seconds
from meshlab.plan.hardware import GIB

MIB = 2**20
# (m, n, k): squares, a tall-skinny one (tokens x hidden) and shallow ones (an attention
# head's depth): the profile fits the GEMM model's depth (gemm_k0) and ceiling to them all.
MATMULS = {"cpu": ((512, 512, 64), (256, 256, 256), (512, 512, 512), (2048, 256, 1024),
                   (1024, 1024, 1024)),
           "cuda": ((8192, 8192, 128), (8192, 8192, 512), (2048, 2048, 2048),
                    (4096, 4096, 4096), (16384, 2048, 8192), (8192, 8192, 8192))}
# A CPU without bf16 units runs bf16 at ~1 GFLOP/s: 1024^3 took 29 s on 4 ranks of 2 cores.
QUICK_MATMULS = {"cpu": ((512, 512, 64), (256, 256, 256), (512, 512, 512)),
                 "cuda": ((8192, 8192, 128), (4096, 4096, 4096), (8192, 8192, 8192))}
# cuBLAS's large bf16/fp16 output tile; a CPU's matmul has no waves to quantize
GPU_TILE = (256, 128)


def tiling(device: torch.device) -> tuple[int, tuple[int, int]]:
    """(multiprocessors, output tile) of the GEMM model on ``device``."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count, GPU_TILE
    return 1, (1, 1)
COPY_BYTES = {"cpu": 64 * MIB, "cuda": GIB}


@dataclass(slots=True)
class MatmulPoint:
    """One (m, n, k) matmul in one dtype, timed on every rank at once."""

    dtype: str
    m: int
    n: int
    k: int
    seconds: float
    """Median over repetitions, on the slowest rank."""
    tflops: float
    """Achieved: 2mnk / seconds."""


def dtypes_for(device: torch.device) -> list[str]:
    """Compute dtypes this device runs matmuls in (fp8 from compute capability 8.9)."""
    if device.type != "cuda":
        return ["fp32", "bf16"]
    return ["fp32", "tf32", "bf16", *(["fp8"] if _fp8_runs(device) else [])]


def _fp8_runs(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs here (Hopper and Ada GPUs, a recent enough torch)."""
    if not hasattr(torch, "float8_e4m3fn") or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        _matmul("fp8", 16, 16, 16, device)()
        return True
    except (RuntimeError, TypeError):
        return False


def _matmul(dtype: str, m: int, n: int, k: int, device: torch.device) -> Callable[[], Any]:
    a = torch.randn(m, k, device=device)
    b = torch.randn(k, n, device=device)
    if dtype == "bf16":
        a, b = a.bfloat16(), b.bfloat16()
    if dtype == "fp8":
        # _scaled_mm wants the second operand column-major: the transpose of an (n, k) tensor
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16)
    return lambda: torch.mm(a, b)


def time_matmuls(shapes: Sequence[tuple[int, int, int]], dtypes: Sequence[str],
                 device: torch.device, reps: int) -> list[MatmulPoint]:
    """Each shape in each dtype, every rank at once; seconds and TFLOP/s of the slowest."""
    before = torch.get_float32_matmul_precision()
    points, seconds = [], []
    try:
        for dtype in dtypes:
            # fp32 means IEEE fp32; tf32 is fp32 storage with TF32 tensor-core math
            torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
            for m, n, k in shapes:
                op = _matmul(dtype, m, n, k, device)
                dist.barrier()  # every rank multiplies at once: shared cores show
                points.append((dtype, m, n, k))
                if device.type == "cuda":
                    seconds.append(median_seconds(op, device, reps, warmup=3))
                    continue
                seconds.append(windowed_seconds(op, device, reps))
    finally:
        torch.set_float32_matmul_precision(before)
    return [MatmulPoint(dtype=d, m=m, n=n, k=k, seconds=s, tflops=2 * m * n * k / s / 1e12)
            for (d, m, n, k), s in zip(points, slowest(seconds, device), strict=True)]


def copy_seconds(nbytes: int, device: torch.device, reps: int) -> float:
    """Median seconds of one ``nbytes`` copy on this rank, all ranks copying together."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), device, reps, before=dist.barrier)
