"""What a calibration measured, the hardware profile it makes, and its file and summary.

``Calibration.profile(name)`` is the ``meshlab.plan.hardware.Hardware`` the planner reads;
``write_profile`` saves it as TOML with where and how it was measured as comments.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshlab.calibrate.algorithms import AllreduceSweep
from meshlab.calibrate.collectives import CollectiveFit
from meshlab.calibrate.compute import MatmulPoint
from meshlab.calibrate.host_costs import LAYERS, tiny_shape, wrapper_layouts
from meshlab.plan.estimate import estimate
from meshlab.plan.gemm import shape_factor
from meshlab.plan.hardware import Hardware, save
from meshlab.plan.layout import Layout


@dataclass(slots=True)
class Calibration:
    """Everything ``calibrate`` measured; the same on every rank."""

    device: str
    """"cpu" or "cuda"."""
    device_name: str
    world_size: int
    hosts: dict[str, list[int]]
    """Host name -> its ranks."""
    mesh: str
    """The mesh's axes as "dp_shard=2 tp=2", or "" when only the world group was timed."""
    timer: str
    memory_gib: float
    """Memory per rank: the device's, or a CPU host's total shared by its ranks (smallest)."""
    reserved_gib: float
    """GPU memory already taken outside torch's allocator (CUDA context, NCCL buffers)."""
    memory_bandwidth_gbs: float
    """A large copy, read + write bytes per second, on the slowest rank."""
    layer_seconds: dict[str, float]
    """Forward + backward seconds per layer of a tiny model, plain and under each wrapper
    (fsdp, tp), on the slowest rank (``meshlab.calibrate.host_costs``)."""
    matmul: list[MatmulPoint]
    tflops: dict[str, float]
    """Achieved TFLOP/s per dtype at the largest matmul."""
    sms: int
    gemm_tile: tuple[int, int]
    """The GEMM model's multiprocessors and output tile on this device (``plan.gemm``)."""
    gemm_k0: float
    """The GEMM model's depth, fitted to every matmul measured (``plan.gemm.fit_depth``)."""
    attention: dict[str, float]
    """Achieved TFLOP/s of each fused attention kernel that runs here (bf16, causal, forward
    and backward as the planner counts them: ``calibrate.attention``), by kernel."""
    attention_default: str
    """The kernel SDPA picks by itself here ("": one the planner has no name for)."""
    collectives: list[CollectiveFit]
    intra_axis: str | None
    """Axis whose fits became the profile's intra link and collectives."""
    inter_axis: str | None
    """Axis whose all_reduce became the inter link (None: no group spans hosts)."""
    seconds: float
    """How long the calibration took."""
    notes: list[str] = field(default_factory=list)
    allreduce: AllreduceSweep | None = None
    """Each all-reduce algorithm timed on the world group, with the model's crossovers from
    this calibration's intra and inter links (None: not timed)."""

    def fit(self, axis: str, collective: str) -> CollectiveFit:
        """The fit of ``collective`` on ``axis``."""
        for f in self.collectives:
            if f.axis == axis and f.collective == collective:
                return f
        axes = sorted({f.axis for f in self.collectives})
        raise KeyError(f"no {collective} measured on {axis!r}; measured axes: {axes}")

    @property
    def gpus_per_node(self) -> int:
        return max(len(r) for r in self.hosts.values())

    def profile(self, name: str) -> Hardware:
        """The planner's hardware profile: achieved numbers, so matmul_efficiency is 1 and
        the GEMM curve is the fitted one."""
        if self.intra_axis is None and self.inter_axis is None:
            raise ValueError(f"no collective was timed on {self.world_size} rank(s): calibrate "
                             "a cluster of at least 2 ranks")
        inter = self.fit(self.inter_axis or str(self.intra_axis), "all_reduce").link()
        intra_axis = self.intra_axis or str(self.inter_axis)
        collectives = {f.collective: f.link() for f in self.collectives if f.axis == intra_axis}
        peaks = self.peaks()
        # CPU ranks: the host is the device; a GPU keeps the class defaults (copies over
        # PCIe are not measured yet)
        host: dict[str, Any] = {} if self.device == "cuda" else {
            "host_memory_gib": self.memory_gib,
            "host_memory_bandwidth_gbs": self.memory_bandwidth_gbs,
            "pcie_gbs": self.memory_bandwidth_gbs}
        hw = Hardware(name=name, tflops=peaks, matmul_efficiency=1.0,
                      **self.attention_fields(), sms=self.sms, gemm_tile=self.gemm_tile,
                      gemm_k0=self.gemm_k0,
                      memory_gib=self.memory_gib, reserved_gib=self.reserved_gib,
                      memory_bandwidth_gbs=self.memory_bandwidth_gbs,
                      **host,
                      # a GPU computes while its host queues work and NCCL runs beside it;
                      # CPU ranks share their cores among dispatch, gloo and the math
                      asynchronous=self.device == "cuda",
                      gpus_per_node=self.gpus_per_node, intra=collectives["all_reduce"],
                      inter=inter, collectives=collectives,
                      allreduce_crossover_bytes=self.allreduce.profile_crossovers()
                      if self.allreduce else {})
        return self._with_host_costs(hw)

    def peaks(self) -> dict[str, float]:
        """The profile's TFLOP/s per dtype: the largest matmul's achieved rate over what its
        shape keeps of the ceiling, so the profile reproduces that matmul exactly and the
        smaller ones by the fitted curve."""
        largest = max(self.matmul, key=lambda p: p.m * p.n * p.k)
        keeps = shape_factor(largest.m, largest.n, largest.k, sms=self.sms,
                             tile=self.gemm_tile, k0=self.gemm_k0)
        return {d: t / keeps for d, t in self.tflops.items()}

    def attention_shares(self) -> dict[str, float]:
        """Each kernel's rate as a share of the profile's bf16 peak (what the planner reads);
        a kernel faster than that peak (a CPU whose matmuls lack bf16 units) is left out,
        its rate in ``attention_notes``."""
        peak = self.peaks().get("bf16")
        if not peak:
            return {}
        return {k: t / peak for k, t in self.attention.items() if t / peak <= 1}

    def attention_fields(self) -> dict[str, Any]:
        """The profile's ``attention_efficiency`` and ``attention_default`` (SDPA's choice,
        where its rate is kept)."""
        shares = self.attention_shares()
        default = self.attention_default if self.attention_default in shares else ""
        return {"attention_efficiency": shares, "attention_default": default}

    def attention_notes(self) -> list[str]:
        """What the profile makes of attention, where it is not each kernel's measured rate."""
        shares = self.attention_shares()
        if not self.attention:
            return ["no fused attention kernel was timed (none runs here, or no bf16): the "
                    "profile costs attention as two GEMMs"]
        notes = [f"attention: {k} ran at {t:.4g} TFLOP/s, above the bf16 matmul's peak: "
                 "left out of the profile (a kernel without a rate is costed as two GEMMs)"
                 for k, t in self.attention.items() if k not in shares]
        if shares and not self.attention_default:
            notes.append("SDPA picks a kernel the planner has no rate for here (math or "
                         "memory-efficient), or could not be asked: attention_kernel=auto costs "
                         f"{'cudnn' if 'cudnn' in shares else 'flash2'}'s rate; name the "
                         "kernel your model runs")
        return notes

    def _with_host_costs(self, hw: Hardware) -> Hardware:
        """Each host cost is what the tiny model's measured time per layer leaves over once
        the planner has counted everything else it knows (math, memory, collectives, and for
        a wrapper the plain layer's host time): in the planner's own terms by construction."""
        layouts = wrapper_layouts(self.world_size)
        for wrapper, overhead in (("plain", "layer_overhead_us"), ("fsdp", "fsdp_overhead_us"),
                                  ("tp", "tp_overhead_us")):
            if wrapper not in self.layer_seconds:
                continue
            layout = Layout.parse(layouts[wrapper][2], precision="fp32")
            times = []
            for layers in LAYERS:
                e = estimate(tiny_shape(layers), layout, hw)
                times.append(e.step_s - e.optimizer_s)  # the measured steps have no optimizer
            predicted = (times[1] - times[0]) / (LAYERS[1] - LAYERS[0])
            left = max(0.0, self.layer_seconds[wrapper] - predicted)
            changes: dict[str, Any] = {overhead: left * 1e6}
            hw = dataclasses.replace(hw, **changes)
        return hw


def write_profile(calibration: Calibration, path: str | Path, name: str | None = None
                  ) -> Hardware:
    """Save ``calibration.profile(name)`` as TOML (``meshlab.plan.hardware.load`` reads it)
    with where and how it was measured as comments."""
    path = Path(path)
    hw = calibration.profile(name or path.stem)
    save(hw, path)
    c = calibration
    when = datetime.datetime.now().isoformat(timespec="seconds")
    lines = [f"# measured by %mesh calibrate on {when}: {c.world_size} ranks on "
             f"{len(c.hosts)} host(s), {c.device_name} ({c.device}, {c.timer})",
             f"# mesh {c.mesh or '(none: world group only)'}; intra = {c.intra_axis}, "
             f"inter = {c.inter_axis or c.intra_axis}; tflops at the largest matmul"]
    lines += [f"# note: {n}" for n in c.notes + c.attention_notes()]
    if c.allreduce is not None:
        lines += [f"# all-reduce on the world group: {line}" for line in c.allreduce.lines()]
        if hw.allreduce_crossover_bytes:
            lines.append("# allreduce_crossover_bytes: each measured crossover; where an "
                         "algorithm beat ring at every size measured, the largest size")
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")
    return hw


def summary(calibration: Calibration) -> str:
    """Plain-text tables of a calibration (what the torchrun entry point prints)."""
    c = calibration
    out = [f"{c.world_size} ranks, {c.device_name}, mesh {c.mesh or '(world only)'}, "
           f"{c.seconds:.1f} s",
           "matmul TFLOP/s (largest size): " + ", ".join(f"{d} {t:.4g}"
                                                         for d, t in c.tflops.items()),
           "attention TFLOP/s (bf16, causal, forward + backward): " + (", ".join(
               f"{k} {t:.4g}" + (" (SDPA's choice)" if k == c.attention_default else "")
               for k, t in c.attention.items()) or "no fused kernel runs here"),
           f"memory {c.memory_gib:.1f} GiB/rank, copy {c.memory_bandwidth_gbs:.3g} GB/s, "
           "tiny layer, forward + backward: " + ", ".join(
               f"{w} {t * 1e6:.0f} us" for w, t in c.layer_seconds.items()),
           f"{'axis':<14}{'ranks':>5}  {'collective':<15}{'latency_us':>11}"
           f"{'bandwidth_gbs':>14}{'residual':>9}"]
    out += [f"{f.axis:<14}{f.ranks:>5}  {f.collective:<15}{f.latency_us:>11.1f}"
            f"{f.bandwidth_gbs:>14.4g}{f.residual:>9.2f}" for f in c.collectives]
    if c.allreduce is not None:
        out += allreduce_table(c.allreduce)
    return "\n".join(out + [f"note: {n}" for n in c.notes + c.attention_notes()])


def allreduce_table(sweep: AllreduceSweep) -> list[str]:
    """Plain-text lines: each algorithm's time per size (ms), the fastest, the crossovers."""
    names = list(sweep.seconds)
    out = [f"all-reduce on {sweep.ranks} ranks ({len(set(sweep.hosts))} host(s)), ms on the "
           "slowest rank", f"{'bytes':>10}" + "".join(f"{n:>18}" for n in names) + "  fastest"]
    for i, (size, best) in enumerate(zip(sweep.nbytes, sweep.fastest(), strict=True)):
        out.append(f"{size:>10}" + "".join(f"{sweep.seconds[n][i] * 1e3:>18.3g}" for n in names)
                   + f"  {best}")
    return out + sweep.lines() + [f"note: {n}" for n in sweep.notes]
