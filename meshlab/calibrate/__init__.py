"""Measure on the live ranks what the planner assumes, and write it as a hardware profile.

Every rank calls ``calibrate(mesh)`` at once. Matmuls, SDPA's fused attention kernels and a
large copy run on all ranks together, so ranks that share cores or a memory bus slow each
other as they do in training (``compute``, ``attention``). Then each collective is timed on
every mesh axis (all of its groups at once) and on the whole world over a sweep of message
sizes, and fitted to the planner's alpha-beta model (``collectives``); each all-reduce
algorithm of ``meshlab.measure.allreduce`` is timed on the world at the same sizes, and where it
beats ring, measured and modelled (``algorithms``). ``Calibration.profile(name)`` is the
``meshlab.plan.hardware.Hardware`` the planner reads (``result``). Plain torch, so it runs
under torchrun:

$ torchrun --standalone --nproc_per_node=4 -m meshlab.calibrate --mesh "dp=2 tp=2" -o cpu.toml
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from meshlab import runtime
from meshlab.calibrate.algorithms import (
    AllreduceSweep,
    compare_allreduce,
    links,
    time_allreduce_algorithms,
)
from meshlab.calibrate.attention import sdpa_default, time_attention
from meshlab.calibrate.collectives import (
    BATCH,
    QUICK_SIZES,
    SIZES,
    CollectiveFit,
    fit_alpha_beta,
    fit_collective,
    parse_sizes,
    time_collectives,
)
from meshlab.calibrate.compute import (
    COPY_BYTES,
    MATMULS,
    QUICK_MATMULS,
    MatmulPoint,
    copy_seconds,
    dtypes_for,
    tiling,
    time_matmuls,
)
from meshlab.calibrate.host_costs import layer_seconds
from meshlab.calibrate.hosts import choose_axes, device_name, host_facts
from meshlab.calibrate.result import Calibration, summary, write_profile
from meshlab.measure.timing import slowest
from meshlab.plan.gemm import fit_depth

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

REPS = {"cpu": 5, "cuda": 20}  # timed repetitions per point (the median is kept)
QUICK_REPS = {"cpu": 3, "cuda": 10}

__all__ = ["BATCH", "COPY_BYTES", "MATMULS", "QUICK_MATMULS", "QUICK_REPS", "QUICK_SIZES",
           "REPS", "SIZES", "AllreduceSweep", "Calibration", "CollectiveFit", "MatmulPoint",
           "calibrate", "choose_axes", "compare_allreduce", "dtypes_for", "fit_alpha_beta",
           "fit_collective", "main", "parse_sizes", "summary", "time_allreduce_algorithms",
           "write_profile"]


def calibrate(mesh: DeviceMesh | None = None, *, sizes: Sequence[int] | None = None,
              matmuls: Sequence[tuple[int, int, int]] | None = None,
              dtypes: Sequence[str] | None = None, reps: int | None = None,
              quick: bool = False) -> Calibration:
    """Measure matmul throughput, memory bandwidth and every collective on each axis of
    ``mesh`` (a DeviceMesh; None: the world group only). Call it on every rank at once."""
    started = time.perf_counter()
    device = runtime.device()
    kind = "cuda" if device.type == "cuda" else "cpu"
    runs = dtypes_for(device)
    dtypes = list(dtypes or runs)
    unknown = [d for d in dtypes if d not in runs]
    if unknown:
        raise ValueError(f"dtypes {unknown} do not run on {kind}: choose from {runs}")
    sizes = sorted(set(sizes or (QUICK_SIZES if quick else SIZES)[kind]))
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"sizes {sizes}: give at least two distinct positive byte counts")
    reps = reps or (QUICK_REPS if quick else REPS)[kind]
    hosts, memory, reserved = host_facts(device)
    matmul = time_matmuls(matmuls or (QUICK_MATMULS if quick else MATMULS)[kind], dtypes,
                          device, reps)
    largest = max(matmul, key=lambda p: p.m * p.n * p.k)
    tflops = {p.dtype: p.tflops for p in matmul if (p.m, p.n, p.k) == (largest.m, largest.n,
                                                                         largest.k)}
    sms, tile = tiling(device)
    fits = {d: fit_depth([(p.m, p.n, p.k, p.tflops) for p in matmul if p.dtype == d], sms=sms,
                         tile=tile) for d in tflops}
    # one depth for the profile: the training dtype's (bf16 where it runs)
    k0 = fits["bf16" if "bf16" in fits else next(iter(fits))][0]
    # fused attention's kernels, in bf16 as the planner costs them (none timed without it)
    attention = time_attention(device, reps) if "bf16" in dtypes else {}
    default = sdpa_default(device) if attention else ""
    copy_bytes = COPY_BYTES[kind] // (4 if quick else 1)
    (copy_s,) = slowest([copy_seconds(copy_bytes, device, reps)], device)
    here = layer_seconds(device, reps)
    per_layer = dict(zip(here, slowest(list(here.values()), device), strict=True))
    collectives = time_collectives(mesh, sizes, device, reps)
    intra, inter, notes = choose_axes(collectives, hosts)
    # the algorithms on the world, hosts from hostnames; the model from the profile's links
    allreduce = None
    if dist.get_world_size() > 1:
        allreduce = time_allreduce_algorithms(None, sizes, device, reps)
        allreduce.predict(*links(collectives, intra, inter))
    if mesh is None:
        notes.insert(0, "no mesh: only the world group was timed (%mesh init to time each axis)")
    axes = [] if mesh is None else [f"{n}={s}" for n, s in zip(
        mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True)]
    dist.barrier()
    return Calibration(
        device=kind, device_name=device_name(device), world_size=dist.get_world_size(),
        hosts=hosts, mesh=" ".join(axes), timer="cuda events" if kind == "cuda" else
        "cpu wall clock", memory_gib=memory, reserved_gib=reserved,
        memory_bandwidth_gbs=2 * copy_bytes / copy_s / 1e9, layer_seconds=per_layer,
        matmul=matmul, tflops=tflops, sms=sms, gemm_tile=tile, gemm_k0=k0,
        attention=attention, attention_default=default,
        collectives=collectives, intra_axis=intra, inter_axis=inter,
        seconds=time.perf_counter() - started, notes=notes, allreduce=allreduce)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m meshlab.calibrate`` under torchrun: rank 0 writes the profile."""
    from meshlab.mesh import build

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-o", dest="path", default="calibrated.toml", help="profile to write")
    parser.add_argument("--name", help="profile name (default: the file's stem)")
    parser.add_argument("--mesh", help='axes to time, e.g. "dp=2 tp=2" (default: world only)')
    parser.add_argument("--sizes", type=parse_sizes, help="message sizes, e.g. 4K,64K,1M,4M")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    args = parser.parse_args(argv)
    runtime.init_from_env()
    try:
        cal = calibrate(build(args.mesh) if args.mesh else None, sizes=args.sizes,
                        quick=args.quick)
        if dist.get_rank() == 0:
            write_profile(cal, args.path, args.name)
            print(summary(cal) + f"\nwrote {os.path.abspath(args.path)}")
    finally:
        dist.destroy_process_group()
