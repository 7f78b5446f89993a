"""What a dry run reports, as plain data (it travels between processes and into JSON): the
run, each representative rank's step, and its collectives by mesh axis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class Traffic:
    """One kind of collective on one mesh axis in the step, as this rank issued it."""

    axis: str
    """The group it ran on, named by the mesh axes it spans (tp, dp_shard+cp, ...), or ep,
    world, other."""
    op: str
    calls: int
    bytes: int
    """Payload summed over the calls (the larger of what goes in and comes out)."""
    wire_bytes: int
    """What this rank sends with ring algorithms, summed (an estimate, not a measure)."""


@dataclass(kw_only=True, slots=True)
class RankRun:
    """One representative rank's step."""

    rank: int
    coordinates: dict[str, int]
    role: str
    stages: list[int]
    """The pipeline stages it holds, of ``DryRun.stages`` ([0] without a pipeline)."""
    params: int
    """Parameter elements this rank holds (its shards)."""
    memory: dict[str, int]
    """Bytes at the step's peak, in the planner's categories: params, grads, optimizer,
    activations, buffers, total (and host, what offloading keeps off the device)."""
    peaks: dict[str, int]
    """Each of those categories' own peak over the step (their sum bounds the peak)."""
    raw: dict[str, int]
    """torch's tracker's own categories at the step's peak."""
    collectives: list[Traffic]
    fits: bool | None
    """Whether the peak fits the hardware's usable memory (None: no hardware given)."""
    seconds: float


@dataclass(kw_only=True, slots=True)
class DryRun:
    """A dry run of one layout: what each representative rank allocates and sends."""

    layout: str
    """As given."""
    planned: str
    """The layout the run stands for, in the planner's words (``Layout.parse`` takes it)."""
    world_size: int
    model: str
    family: str
    """meshlab (its Transformer), transformers, or other: whose code ran."""
    shape: dict[str, Any] | None
    """The model's ``ModelShape`` fields (None: a model the planner cannot describe)."""
    batch: int
    """Sequences per data-parallel rank per step."""
    seq: int
    stages: int
    """Pipeline stages of the schedule (1 without a pipeline)."""
    hardware: str | None
    ranks: list[RankRun]
    seconds: float
    notes: list[str] = field(default_factory=list)
    tp_whole: list[str] = field(default_factory=list)
    """What the model's TP plan leaves whole on every tp rank ("attention"), beside the
    planner's split."""
    qk_norm: bool = False
    """Whether its attention normalizes queries and keys per head (Qwen3's), keeping the
    projections' outputs beside the planner's count."""
    kernels: str = "fused"
    """Whose memory the activations are: "fused" kernels' (meshlab.dry_run.fused_memory) or the
    code's op by op ("eager")."""
