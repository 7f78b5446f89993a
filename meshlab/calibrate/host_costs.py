"""Host time per transformer layer, plain and under FSDP2 and DTensor tensor parallelism.

The planner counts a layer's math, memory traffic and collectives; what it cannot derive is
the fixed cost each layer pays on the host: operator dispatch and autograd, plus FSDP2's
hooks, copies into and out of its flat buffers and resharding, and DTensor's sharding
propagation and redistribution on every operator. On a GPU that time hides behind big
layers; on CPU ranks (and for small layers anywhere) it is most of the step. It is measured
here as the slope of a tiny model's forward and backward between 1 and 5 layers, so the
embedding, the loss and everything paid once per step cancel. Engine side: call it on every
rank at once, like ``meshlab.calibrate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshlab.measure.timing import windowed_seconds
from meshlab.plan.shapes import ModelShape

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Tiny enough that the math is a few microseconds and the host time is what is left.
TINY: dict[str, int] = dict(dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64,
                            max_seq_len=16)
TINY_BATCH = 2  # sequences per rank
LAYERS = (1, 5)


def tiny_shape(layers: int) -> ModelShape:
    """The tiny model as the planner sees it."""
    from meshlab.models import ModelConfig

    return ModelShape.from_config(ModelConfig(n_layers=layers, **TINY), name="tiny")


def wrapper_layouts(world: int) -> dict[str, tuple[str, str, str]]:
    """Per wrapper: meshlab mesh, ParallelPlan.data_parallel, and the planner's layout."""
    out = {"plain": (f"dp={world}", "none", f"zero=0 mbs={TINY_BATCH} m=1")}
    if world > 1:
        out["fsdp"] = (f"dp={world}", "zero3", f"dp={world} zero=3 mbs={TINY_BATCH} m=1")
    if world % 2 == 0:  # tp=2 inside dp groups of the rest; the heads split in two
        out["tp"] = (f"dp={world // 2} tp=2", "none", f"tp=2 zero=0 mbs={TINY_BATCH} m=1")
    return out


def layer_seconds(device: torch.device, reps: int) -> dict[str, float]:
    """Forward + backward seconds per layer of the tiny model, per wrapper, on this rank."""
    from meshlab.mesh import build

    out = {}
    for wrapper, (spec, data_parallel, _) in wrapper_layouts(dist.get_world_size()).items():
        mesh = build(spec)
        # host time: the wall clock up to a synchronize, even on a GPU
        seconds = [windowed_seconds(_step(layers, mesh, data_parallel, device), device, reps,
                                    wall_clock=True) for layers in LAYERS]
        out[wrapper] = (seconds[1] - seconds[0]) / (LAYERS[1] - LAYERS[0])
    return out


def _step(layers: int, mesh: DeviceMesh, data_parallel: str, device: torch.device
          ) -> Callable[[], None]:
    from meshlab.mesh import axis_size
    from meshlab.models import ModelConfig, Transformer, local_batch
    from meshlab.models.llama import loss_fn
    from meshlab.parallel import ParallelPlan, apply_tp, parallelize
    from meshlab.verify.compare import data_rank

    cfg = ModelConfig(n_layers=layers, **TINY)
    plan = ParallelPlan(data_parallel=data_parallel, seq_len=cfg.max_seq_len)
    with torch.device(device):
        model: torch.nn.Module = Transformer(cfg)
        # no data-parallel wrapper: the host time of the model alone (or under TP), not a
        # training run (parallelize refuses dp ranks that sum no gradients)
        model = (parallelize(model, mesh, plan) if data_parallel != "none" else
                 apply_tp(model, mesh) if axis_size(mesh, "tp") > 1 else model)
    r, n = data_rank(mesh)
    x, y = (t.to(device) for t in local_batch(step=0, batch=TINY_BATCH * n, seq=cfg.max_seq_len,
                                              vocab=cfg.vocab_size, rank=r, ranks=n))

    def step() -> None:
        loss_fn(model(x), y).backward()  # gradients accumulate: the cost is the same
    return step
