"""What a GPU (or a CPU rank) can do, as the planner needs it: built-in profiles and TOML.

Peak numbers are the vendors' dense (no sparsity) figures per GPU; ``matmul_efficiency`` is
the share of peak a large GEMM reaches in practice, and the links are bus bandwidths (what
nccl-tests calls busBw: one rank's share of a ring), not the marketing bidirectional totals.
``%mesh calibrate`` measures all of these on a live mesh and writes a profile like these.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib

from meshlab.plan.allreduce_formulas import ALLREDUCE_ALGORITHMS, allreduce_seconds
from meshlab.plan.formulas import COLLECTIVES

GB = 1e9
GIB = 2**30
DTYPES = ("fp32", "tf32", "bf16", "fp8")
ATTENTION_KERNELS = ("flash2", "cudnn")
"""Fused attention kernels a profile can hold a measured rate for: FlashAttention-2 (torch
SDPA's flash backend) and cuDNN's (SDPA's cudnn backend, Transformer Engine's fused
attention)."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of connection between ranks, for the alpha-beta model."""

    bandwidth_gbs: float
    """Bus bandwidth per rank, GB/s (1e9 bytes)."""
    latency_us: float
    """Time of one message hop, microseconds."""

    def __post_init__(self) -> None:
        if not (self.bandwidth_gbs > 0 and self.latency_us >= 0):
            raise ValueError(f"a link needs bandwidth_gbs > 0 and latency_us >= 0, got {self}")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator and the links between accelerators."""

    name: str
    tflops: dict[str, float]
    """Peak dense TFLOP/s by compute dtype (fp32, tf32, bf16, fp8); a missing one is not
    supported (fp8 on an A100)."""
    matmul_efficiency: float = 0.75
    """Share of peak a large square GEMM reaches; smaller and skinnier ones reach less
    (``meshlab.plan.gemm``: tiles, waves, depth)."""
    fp8_efficiency: float = 0.0
    """Share of the fp8 peak a large GEMM reaches in float8 training, the scaling casts and
    amax passes included (torchao's dynamic float8 Linear); 0: ``matmul_efficiency``."""
    attention_efficiency: dict[str, float] = field(default_factory=dict)
    """Share of the 16-bit peak a fused attention kernel reaches, by kernel
    (``ATTENTION_KERNELS``), where measured. Without a figure, attention_kernel=auto costs
    attention's two products at the GEMM model's rates, and a kernel named is refused."""
    attention_default: str = ""
    """The kernel SDPA picks by itself here, which attention_kernel=auto costs (``%mesh
    calibrate`` asks SDPA); "": cudnn where the profile has its rate, else flash2."""
    sms: int = 1
    """Streaming multiprocessors: tiles of a GEMM run in waves of this many (1: no waves)."""
    gemm_tile: tuple[int, int] = (1, 1)
    """Output tile (M, N) one multiprocessor computes at a time ((1, 1): no tiling loss)."""
    gemm_k0: float = 0.0
    """The depth K at which a GEMM's pipeline fill costs as much as its work: efficiency
    grows as K / (K + gemm_k0)."""
    overlap_cost: float = 0.0
    """Share of the communication that runs behind compute which still slows it: NCCL's
    kernels take multiprocessors and memory bandwidth from the math."""
    memory_gib: float
    """Device memory, GiB."""
    reserved_gib: float = 0.0
    """Memory the planner does not hand out: CUDA context, NCCL buffers, fragmentation."""
    memory_bandwidth_gbs: float
    """Device memory bandwidth, GB/s: the speed of the memory-bound (non-matmul) work."""
    host_memory_gib: float = 256.0
    """Host (CPU) memory per GPU, GiB: the node's RAM shared out; what offloading fills."""
    host_memory_bandwidth_gbs: float = 75.0
    """Host memory bandwidth per GPU, GB/s: the speed of an optimizer stepping on the CPU."""
    pcie_gbs: float = 50.0
    """Copies between device and host memory per GPU, GB/s, each way (PCIe)."""
    gpus_per_node: int
    """Ranks that share the fast link."""
    intra: Link
    """Between ranks of one node (NVLink, or the loopback a CPU cluster uses)."""
    inter: Link
    """Between nodes, per rank (InfiniBand / RoCE NIC)."""
    layer_overhead_us: float = 0.0
    """Host time of one layer's forward and backward that does not grow with its size:
    operator dispatch, autograd, kernel launches (eager PyTorch: a few hundred operators per
    layer). ``%mesh calibrate`` measures it on a tiny model (``meshlab.calibrate.host_costs``)."""
    fsdp_overhead_us: float = 0.0
    """What FSDP2 (ZeRO-2/3) adds to each layer's host time beyond its collectives: hooks,
    copies into and out of its flat buffers, resharding. Measured by ``%mesh calibrate``;
    the GPU presets leave it to ``layer_overhead_us``."""
    tp_overhead_us: float = 0.0
    """What DTensor tensor parallelism adds to each layer's host time beyond its collectives:
    sharding propagation and redistribution around every operator. Measured like
    ``fsdp_overhead_us``."""
    asynchronous: bool = True
    """The device computes while the host queues more work and while collectives run on
    their own engines (GPUs: launch overhead and overlapped communication hide behind the
    math). False for CPU ranks: dispatch, gloo's threads and the math share the cores, so
    they add up."""
    collectives: dict[str, Link] = field(default_factory=dict)
    """Measured links per collective, inside a node (from ``%mesh calibrate``); they
    override ``intra`` for that collective."""
    allreduce_crossover_bytes: dict[str, float] = field(default_factory=dict)
    """Per all-reduce algorithm of ``meshlab.measure.allreduce``, the message size (bytes)
    below which ``%mesh calibrate`` measured it beating ring; the planner costs smaller
    all-reduces with that algorithm's model (``allreduce_choice``). Empty: ring at every size."""

    def __post_init__(self) -> None:
        unknown = set(self.tflops) - set(DTYPES)
        if unknown or not self.tflops:
            raise ValueError(f"{self.name}: tflops takes {', '.join(DTYPES)}, got "
                             f"{sorted(self.tflops)}")
        if self.gpus_per_node < 1 or min(self.memory_gib, self.memory_bandwidth_gbs,
                                         self.host_memory_gib, self.host_memory_bandwidth_gbs,
                                         self.pcie_gbs) <= 0:
            raise ValueError(f"{self.name}: gpus_per_node, memory_gib, memory_bandwidth_gbs, "
                             "host_memory_gib, host_memory_bandwidth_gbs and pcie_gbs must be "
                             "positive")
        if min(self.layer_overhead_us, self.fsdp_overhead_us, self.tp_overhead_us) < 0:
            raise ValueError(f"{self.name}: host overheads cannot be negative")
        if not 0 < self.matmul_efficiency <= 1 or not 0 <= self.fp8_efficiency <= 1:
            raise ValueError(f"{self.name}: matmul_efficiency must be in (0, 1] and "
                             "fp8_efficiency in [0, 1] (0: matmul_efficiency's)")
        if self.sms < 1 or min(self.gemm_tile) < 1 or len(self.gemm_tile) != 2:
            raise ValueError(f"{self.name}: sms and both gemm_tile sizes must be >= 1, got "
                             f"sms={self.sms}, gemm_tile={self.gemm_tile}")
        shares = self.attention_efficiency
        if set(shares) - set(ATTENTION_KERNELS) or not all(0 < v <= 1 for v in shares.values()):
            raise ValueError(f"{self.name}: attention_efficiency takes shares in (0, 1] for "
                             f"{', '.join(ATTENTION_KERNELS)}, got {shares}")
        if self.attention_default and self.attention_default not in shares:
            raise ValueError(f"{self.name}: attention_default={self.attention_default!r} has no "
                             f"rate in attention_efficiency ({', '.join(shares) or 'none'}); "
                             "give its rate or leave attention_default empty")
        if self.gemm_k0 < 0 or not 0 <= self.overlap_cost <= 1:
            raise ValueError(f"{self.name}: gemm_k0 must be >= 0 and overlap_cost in [0, 1]")
        unknown = set(self.collectives) - set(COLLECTIVES)
        if unknown:
            raise ValueError(f"{self.name}: unknown collectives {sorted(unknown)}; "
                             f"choose from {', '.join(COLLECTIVES)}")
        crossovers = self.allreduce_crossover_bytes
        unknown = set(crossovers) - set(ALLREDUCE_ALGORITHMS[1:])
        if unknown or min(crossovers.values(), default=1) <= 0:
            raise ValueError(f"{self.name}: allreduce_crossover_bytes {crossovers} names unknown "
                             f"all-reduce algorithms {sorted(unknown)} or a size <= 0; give "
                             f"sizes > 0 for {', '.join(ALLREDUCE_ALGORITHMS[1:])}")

    def tflops_peak(self, dtype: str) -> float:
        """Dense peak TFLOP/s in ``dtype``."""
        if dtype not in self.tflops:
            raise ValueError(f"{self.name} has no {dtype} peak (it has "
                             f"{', '.join(self.tflops)}): choose another precision")
        return self.tflops[dtype]

    def ceiling(self, dtype: str) -> float:
        """Share of ``dtype``'s peak a large square GEMM reaches."""
        return self.fp8_efficiency if dtype == "fp8" and self.fp8_efficiency else \
            self.matmul_efficiency

    def flops_per_s(self, dtype: str) -> float:
        """FLOP/s of a large square matmul in ``dtype``."""
        return self.tflops_peak(dtype) * 1e12 * self.ceiling(dtype)

    def link(self, collective: str, *, inter_node: bool) -> Link:
        """The link a collective runs on: measured for it, else the node's or the network's."""
        if inter_node:
            return self.inter
        return self.collectives.get(collective, self.intra)

    def allreduce_choice(self, ranks: int, ranks_per_host: int, nbytes: float
                         ) -> tuple[str, float] | None:
        """(algorithm, seconds) of an all-reduce of ``nbytes`` among ``ranks`` ranks, hosts of
        ``ranks_per_host``, when the profile measured an algorithm beating ring at that size
        (the one the model finds fastest if several did); None: ring, as the planner's
        ``collective_seconds`` costs it. The inter link stands for a host's link, shared by
        the transfers that leave it (as a ring over the hosts measures it)."""
        below = [a for a, size in self.allreduce_crossover_bytes.items() if nbytes < size
                 and (a != "hierarchical" or ranks % min(ranks_per_host, ranks) == 0)]
        if ranks <= 1 or not below:
            return None
        intra = self.link("all_reduce", inter_node=False)
        seconds = {a: allreduce_seconds(
            a, ranks, nbytes, latency_s=intra.latency_us * 1e-6,
            bandwidth_bytes_s=intra.bandwidth_gbs * 1e9, ranks_per_host=ranks_per_host,
            inter_latency_s=self.inter.latency_us * 1e-6,
            inter_bandwidth_bytes_s=self.inter.bandwidth_gbs * 1e9) for a in below}
        best = min(below, key=lambda a: seconds[a])
        return best, seconds[best]

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserved_gib) * GIB


def _gpu(name: str, *, tflops: dict[str, float], memory_gib: float, memory_tbs: float,
         nvlink_gbs: float, nic_gbs: float, efficiency: float, sms: int, host_gib: float,
         host_gbs: float, pcie_gbs: float, fp8_efficiency: float = 0.0,
         attention: dict[str, float] | None = None) -> Hardware:
    # NVLink/NCCL ring latency ~ a few us per hop inside a node, ~ 10 us across an IB fabric
    # an eager layer's forward and backward launch ~100 kernels at ~4 us each
    # cuBLAS's large bf16 tiles are 256 x 128; a tile's main loop steps 64 deep in K with a
    # pipeline a few steps long (gemm_k0 = 128); NCCL's ring kernels occupy up to 16
    # multiprocessors and their memory traffic while they run (overlap_cost)
    return Hardware(name=name, tflops=tflops, matmul_efficiency=efficiency, sms=sms,
                    fp8_efficiency=fp8_efficiency, attention_efficiency=dict(attention or {}),
                    gemm_tile=(256, 128), gemm_k0=128.0, overlap_cost=16 / sms,
                    memory_gib=memory_gib, reserved_gib=4.0, layer_overhead_us=400.0,
                    memory_bandwidth_gbs=memory_tbs * 1000, host_memory_gib=host_gib,
                    host_memory_bandwidth_gbs=host_gbs, pcie_gbs=pcie_gbs, gpus_per_node=8,
                    intra=Link(bandwidth_gbs=nvlink_gbs, latency_us=5.0),
                    inter=Link(bandwidth_gbs=nic_gbs, latency_us=10.0))


# Sources: NVIDIA A100 datasheet (2021), H100 datasheet (SXM5), H200 product brief, DGX B200
# datasheet. Bus bandwidth inside a node: measured NCCL all-reduce busBw on DGX systems
# (~230 GB/s A100 NVLink3, ~370 GB/s H100/H200 NVLink4, ~700 GB/s B200 NVLink5). Between nodes:
# one 200 Gb/s (A100) or 400 Gb/s (H100, H200, B200) NIC per GPU, ~90% of line rate.
# Efficiency: large bf16 GEMMs reach ~80% of peak on A100 and ~70% on B200; H100 and H200
# as measured below.
# The host: DGX A100 and DGX H100/H200 hold 2 TB of RAM for 8 GPUs, DGX B200 4 TB; their two
# CPUs' memory channels (8 x DDR4-3200 each on A100's EPYC 7742, 8 x DDR5-4800 on H100's
# Xeon 8480C, DDR5-5600 on B200's 8570) shared by 8 GPUs: ~50, ~75 and ~90 GB/s each. PCIe
# Gen4 x16 (A100) moves ~25 GB/s each way in practice, Gen5 (H100 on) ~50.
# H100 and H200 (one GH100 die, 132 SMs, 700 W) measured by this project's GPU pass
# (docs/guides/gpu.md): held for two minutes, an 8192^3 bf16 matmul runs at 664 TFLOP/s at the
# 700 W cap (the clocks fall from 1,980 to ~1,440 MHz within the first seconds; a short burst
# reaches 779), fp8 (torch._scaled_mm) at 1,203; a training step keeps its GPUs this busy, so
# the sustained rates are the ceilings. Float8 training's casts and amax passes (torchao,
# compiled) kept 1,059 of the 1,410 TFLOP/s the same burst's raw fp8 matmul reached. B200 is
# not measured: the presets' 0.7, and the H100's fp8 share.
GH100_SUSTAINED = 664 / 989.5
FP8_TRAINING_EFFICIENCY = 1203 / 1979 * 1059 / 1410
# Fused attention on an H100 SXM, bf16, batch 1 x 24 heads x 4,608 positions x head_dim 128,
# forward, as Tritonbench measured it on torch 2.6.0.dev20241204 (pytorch/pytorch#142132):
# SDPA's flash backend (FlashAttention-2, torch's default then: cuDNN was opt-in after
# #138522) 329.5 TFLOP/s, cuDNN's 631.3 (FlashAttention-3: 631.8). FlashAttention-3's paper
# (Shah et al. 2024, arXiv 2407.08608) puts FlashAttention-2 at 35% of the H100's peak too.
# The backward is taken at the same share of its FLOPs (not measured here). Both are short
# runs, like the matmul's 779-TFLOP/s burst; a training step holds the chip at its power cap,
# which runs every kernel at the clocks that held the matmul at 664: the same ratio applies.
GH100_HELD_OVER_BURST = 664 / 779
GH100_ATTENTION = {"flash2": 329.483 / 989.5 * GH100_HELD_OVER_BURST,
                   "cudnn": 631.338 / 989.5 * GH100_HELD_OVER_BURST}
HARDWARE: dict[str, Hardware] = {
    "a100-80gb": _gpu("a100-80gb", tflops={"fp32": 19.5, "tf32": 156, "bf16": 312},
                      memory_gib=80, memory_tbs=2.039, nvlink_gbs=230, nic_gbs=22.5,
                      efficiency=0.8, sms=108, host_gib=232, host_gbs=50, pcie_gbs=25),
    "h100-sxm": _gpu("h100-sxm", tflops={"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp8": 1979},
                     memory_gib=80, memory_tbs=3.35, nvlink_gbs=370, nic_gbs=45,
                     efficiency=GH100_SUSTAINED, sms=132, host_gib=232, host_gbs=75,
                     pcie_gbs=50, fp8_efficiency=FP8_TRAINING_EFFICIENCY,
                     attention=GH100_ATTENTION),
    "h200": _gpu("h200", tflops={"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp8": 1979},
                 memory_gib=141, memory_tbs=4.8, nvlink_gbs=370, nic_gbs=45,
                 efficiency=GH100_SUSTAINED, sms=132, host_gib=232, host_gbs=75, pcie_gbs=50,
                 fp8_efficiency=FP8_TRAINING_EFFICIENCY, attention=GH100_ATTENTION),
    "b200": _gpu("b200", tflops={"fp32": 75, "tf32": 1100, "bf16": 2250, "fp8": 4500},
                 memory_gib=180, memory_tbs=8.0, nvlink_gbs=700, nic_gbs=45, efficiency=0.7,
                 sms=148, host_gib=465, host_gbs=90, pcie_gbs=50,
                 fp8_efficiency=FP8_TRAINING_EFFICIENCY),
    # 4 gloo ranks on this project's 2-core CI machine, as `%mesh calibrate` measured them
    # (benchmarks/plan_vs_measured.py); calibrate your own machine rather than trust these.
    "cpu": Hardware(name="cpu", tflops={"fp32": 0.08, "bf16": 0.56}, matmul_efficiency=1.0,
                    memory_gib=5.9, memory_bandwidth_gbs=9, host_memory_gib=5.9,
                    host_memory_bandwidth_gbs=9, pcie_gbs=9, gpus_per_node=4,
                    layer_overhead_us=1400.0, fsdp_overhead_us=7000.0,
                    tp_overhead_us=24000.0, asynchronous=False,
                    intra=Link(bandwidth_gbs=0.8, latency_us=600.0),
                    inter=Link(bandwidth_gbs=0.1, latency_us=1000.0)),
}


def hardware(name_or_path: str | Path | Hardware) -> Hardware:
    """A built-in profile by name (any case, '-' or '_'), or one read from a TOML file."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    key = str(name_or_path).strip().lower().replace("_", "-")
    if key in HARDWARE:
        return HARDWARE[key]
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return load(path)
    raise ValueError(f"unknown hardware {name_or_path!r}: choose one of "
                     f"{', '.join(HARDWARE)} or give a .toml file (%mesh calibrate writes one)")


def with_nodes_of(name_or_path: str | Path | Hardware, host_of: list[str]) -> Hardware:
    """A profile whose nodes hold as many GPUs as a live cluster's hosts hold ranks."""
    hw = hardware(name_or_path)
    per_node = max(host_of.count(h) for h in set(host_of))
    if per_node == hw.gpus_per_node:
        return hw
    return replace(hw, name=f"{hw.name}, {per_node}/node as this cluster",
                   gpus_per_node=per_node)


def load(path: str | Path) -> Hardware:
    """Read a hardware profile written by ``save`` (or by hand)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no hardware profile at {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    for key, value in _numbers(data):  # NaN or inf read "MFU nan%" later; nothing is negative
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{path}: {key} = {value} is not a finite number >= 0: measure "
                             "it again (%mesh calibrate) or take it from a built-in profile")
    known = {f.name for f in fields(Hardware)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; a profile has "
                         f"{', '.join(sorted(known))}")
    try:
        data.setdefault("name", path.stem)
        for key in ("intra", "inter"):
            data[key] = Link(**data[key])
        data["collectives"] = {k: Link(**v) for k, v in data.get("collectives", {}).items()}
        data["allreduce_crossover_bytes"] = {  # older profiles have none: ring everywhere
            k: float(v) for k, v in data.get("allreduce_crossover_bytes", {}).items()}
        data["attention_efficiency"] = {
            k: float(v) for k, v in data.get("attention_efficiency", {}).items()}
        if "gemm_tile" in data:  # TOML has arrays, the profile a pair
            data["gemm_tile"] = tuple(data["gemm_tile"])
        return Hardware(**data)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: incomplete profile ({e}); see meshlab.plan.HARDWARE for "
                         "the fields") from None


def _numbers(data: Any, at: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a TOML table, by its dotted key."""
    items = data.items() if isinstance(data, dict) else enumerate(data) \
        if isinstance(data, list) else ()
    for key, value in items:
        where = f"{at}.{key}" if at else str(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield where, float(value)
        else:
            yield from _numbers(value, where)


def save(hw: Hardware, path: str | Path) -> Path:
    """Write ``hw`` as TOML that ``load`` reads back to an equal profile."""
    data = asdict(hw)
    lines = [f"# meshlab hardware profile: meshlab.plan.hardware({str(path)!r})"]
    sections: dict[str, dict[str, Any]] = {}
    for key, value in data.items():
        if key in ("tflops", "intra", "inter"):
            sections[key] = value
        elif key in ("allreduce_crossover_bytes", "attention_efficiency"):
            if value:  # a profile without them reads as before
                sections[key] = value
        elif key == "collectives":
            sections.update({f"collectives.{k}": v for k, v in value.items()})
        else:
            lines.append(f"{key} = {_toml(value)}")
    for name, values in sections.items():
        lines += ["", f"[{name}]", *(f"{k} = {_toml(v)}" for k, v in values.items())]
    path = Path(path)
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):  # before int: repr(True) is not TOML
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else "0.0"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)

