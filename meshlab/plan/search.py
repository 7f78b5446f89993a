"""Enumerate the layouts of a model on a number of GPUs, keep those that fit, rank them."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from meshlab.mesh import AXES, MeshSpec
from meshlab.plan.context import SEARCHED_CP, best_cp
from meshlab.plan.estimate import Estimate, estimate
from meshlab.plan.hardware import Hardware
from meshlab.plan.layout import ALIASES, DEFAULT_SCHEDULE, Layout
from meshlab.plan.shapes import ModelShape
from meshlab.schedules import TAKES_VIRTUAL

if TYPE_CHECKING:
    import pandas as pd

# what the search varies, and the values it tries unless pinned: every mesh axis but
# dp_shard, which takes the GPUs the others leave
SEARCHED = (*(a for a in AXES if a != "dp_shard"), "ep", "zero", "micro_batch", "recompute",
            "schedule", "virtual")
# the schedules production trainers run by default (Megatron, torchtitan); any other is
# tried when pinned (schedule=zbv)
SEARCHED_SCHEDULES = (DEFAULT_SCHEDULE, "interleaved_1f1b")
KEPT = ("offload_params", "offload_activations", "replica_sync", "sync_every", "staleness",
        "context_parallel", "cp_chunks", "cp_offload", "cp_balanced", "attention_kernel",
        "optimizer", "qat")
"""Options a search does not try on its own (offloading trades speed for memory; the
replica modes change the training), kept for every candidate when a constraint names them
(context_parallel pinned: the search tries that one, else each of context.SEARCHED_CP)."""
_OPS = {"=": lambda a, b: a == b, "<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b,
        "<": lambda a, b: a < b, ">": lambda a, b: a > b}


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def parse_constraints(text: str) -> dict[str, Any]:
    """``"tp<=8 pp=16 zero=1"`` -> {"tp": ("<=", 8), ...} (dp means dp_shard)."""
    out: dict[str, Any] = {}
    for token in text.replace(",", " ").split():
        match = re.fullmatch(r"([a-z_][a-z0-9_]*)(<=|>=|=|<|>)(\S+)", token)
        if not match:
            raise ValueError(f"constraint {token!r}: write NAME=VALUE, NAME<=VALUE or "
                             f"NAME>=VALUE, NAME one of {', '.join(SEARCHED)}")
        name, op, value = match.groups()
        name = ALIASES.get(name, name)
        if name in KEPT:
            if op != "=":
                raise ValueError(f"constraint {token!r}: {name} takes = only")
            out[name] = ("=", Layout.stated(f"{name}={value}")[name])
            continue
        # candidates() reads only these: any other name would be silently ignored
        if name not in (*SEARCHED, "dp_shard"):
            raise ValueError(f"constraint {token!r}: {name} is not searched; choose from "
                             f"{', '.join((*SEARCHED, *KEPT))} (precision is search's own "
                             "option)")
        number = value.lstrip("-").isdigit()
        if name in ("recompute", "schedule"):
            if op != "=":
                raise ValueError(f"constraint {token!r}: {name} takes = only")
        elif not number:  # compared with the searched degrees: a string would raise later
            raise ValueError(f"constraint {token!r}: {name} takes a whole number")
        out[name] = (op, int(value) if number else value)
    return out


def candidates(model: ModelShape, gpus: int, hardware: Hardware, *, global_batch: int,
               constraints: dict[str, Any] | None = None,
               precision: str = "bf16", settings: dict[str, Any] | None = None
               ) -> Iterator[Layout]:
    """Every layout of ``gpus`` GPUs with ``global_batch`` sequences per step that the model
    can take (divisibility) and that meets the constraints; ``settings`` are Layout fields
    every candidate keeps (the software a run has: ``flash_attention=False``, ...)."""
    cons = dict(constraints or {})
    # the options every candidate keeps: a setting, and where the layout needs them
    kept = {**(settings or {}), **{k: cons.pop(k)[1] for k in KEPT if k in cons}}
    replicas = kept.get("replica_sync", "every_step") != "every_step"

    def allowed(name: str, values: Iterable[Any]) -> list[Any]:
        if name not in cons:
            return list(values)
        op, bound = cons[name]
        if op == "=":
            return [bound]  # pinned: tried even where the default list would not go
        return [v for v in values if _OPS[op](v, bound)]

    tps = allowed("tp", [t for t in _powers_of_two(hardware.gpus_per_node)
                         if model.n_kv_heads % t == 0 and model.ffn % t == 0])
    # any pipeline depth that divides the GPUs (12 and 35 ran at scale, not only powers of 2)
    pps = allowed("pp", [p for p in range(1, min(gpus, model.layers) + 1) if gpus % p == 0]
                  if not replicas else [1])
    cps = allowed("cp", [c for c in _powers_of_two(16) if model.seq_len % (2 * c) == 0]
                  if model.seq_len >= 16384 else [1])
    eps = allowed("ep", [e for e in _powers_of_two(model.experts) if model.experts % e == 0]
                  if model.experts and not replicas else [1])
    zeros = allowed("zero", [2, 3] if kept.get("offload_params") else [0, 1, 2, 3])
    mbss = allowed("micro_batch", list(range(1, 9)))
    recomputes = allowed("recompute", ["none", "selective", "full"])
    schedules = allowed("schedule", SEARCHED_SCHEDULES)
    for tp, pp, cp, ep, zero, mbs, recompute, schedule in itertools.product(
            tps, pps, cps, eps, zeros, mbss, recomputes, schedules):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        if global_batch % (dp * mbs):
            continue
        microbatches = global_batch // (dp * mbs)
        if pp == 1 and schedule != DEFAULT_SCHEDULE:
            continue
        virtuals = [1]
        if schedule in TAKES_VIRTUAL:
            # equal chunks of layers, or of layers with the embedding and the output
            # counted as one each (Megatron's --account-for-embedding/loss-in-pipeline-split,
            # as Llama 3 split 126 layers into 16 x 4 chunks, section 3.3.2)
            virtuals = [v for v in allowed("virtual", range(2, 9))
                        if microbatches % pp == 0 and (model.layers % (pp * v) == 0
                                                       or (model.layers + 2) % (pp * v) == 0)]
        if pp > 1 and microbatches < pp:
            continue  # the pipeline would never fill
        # HSDP: shard inside a node's worth of data ranks, replicate across
        reps = {1, max(1, dp // max(1, hardware.gpus_per_node // (tp * cp)))}
        for dp_replicate in allowed("dp_replicate", sorted(reps)):
            if dp % dp_replicate or (replicas and dp_replicate == 1):
                continue
            dp_shard = dp // dp_replicate
            if "dp_shard" in cons and not _OPS[cons["dp_shard"][0]](dp_shard,
                                                                     cons["dp_shard"][1]):
                continue
            try:  # meshlab.mesh's rules decide, e.g. ep divides dp_shard x cp
                MeshSpec(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp,
                         ep=ep)
            except ValueError:
                continue
            if dp_shard * cp == 1 and zero > 1:
                continue  # nothing to shard over: ZeRO 2 and 3 would repeat ZeRO 1
            for virtual in virtuals:
                yield Layout(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp,
                             tp=tp, ep=ep, zero=zero, micro_batch=mbs,
                             microbatches=microbatches, recompute=recompute,
                             schedule=schedule, virtual=virtual, precision=precision,
                             **kept)


def search(model: ModelShape, *, gpus: int, hardware: Hardware, global_batch: int,
           constraints: dict[str, Any] | str | None = None, precision: str = "bf16",
           top: int | None = 20, include_unfit: bool = False,
           settings: dict[str, Any] | None = None) -> pd.DataFrame:
    """Layouts that fit, fastest first: one row per layout (``Estimate.summary()``) with the
    Estimate itself in column ``estimate``. ``settings``: Layout fields every candidate keeps
    (e.g. ``{"flash_attention": False}`` for a run without it)."""
    import pandas as pd

    if isinstance(constraints, str):
        constraints = parse_constraints(constraints)
    pinned = {**(settings or {}), **{k: v[1] for k, v in (constraints or {}).items()}}
    impls = ((pinned["context_parallel"],) if "context_parallel" in pinned else SEARCHED_CP)
    rows, smallest = [], None
    for layout in candidates(model, gpus, hardware, global_batch=global_batch,
                             constraints=constraints, precision=precision, settings=settings):
        try:  # with cp: each implementation, the best kept (its notes say why)
            found = best_cp(model, layout, hardware, impls) if layout.cp > 1 else \
                estimate(model, layout, hardware)
        except ValueError:
            continue  # the model cannot take this layout (checked in detail by check())
        if found is None:
            continue
        result: Estimate = found
        if result.fits or include_unfit:
            rows.append({**result.summary(), "estimate": result})
        if smallest is None or result.memory["total"] < smallest.memory["total"]:
            smallest = result
    if not rows:
        raise ValueError(_why_empty(model, gpus, hardware, global_batch, smallest))
    # fastest first; of equally fast layouts, the one that needs less memory
    frame = pd.DataFrame(rows).sort_values(["tokens_per_s", "memory_gib"],
                                           ascending=[False, True])
    frame = frame.reset_index(drop=True)
    return frame.head(top) if top else frame


def _why_empty(model: ModelShape, gpus: int, hardware: Hardware, global_batch: int,
               smallest: Estimate | None) -> str:
    """Why a search found nothing, and the change that would find something."""
    where = f"{model.name} on {gpus} {hardware.name} GPUs with a global batch of {global_batch}"
    if smallest is None:
        return (f"no layout of {where} splits the batch: it must be a multiple of the "
                f"data-parallel degree x the micro-batch size for some layout the constraints "
                f"allow; try a batch that is a multiple of {gpus}, or fewer constraints")
    need, usable = smallest.memory["total"] / 2**30, hardware.usable_bytes / 2**30
    return (f"no layout of {where} fits in memory: the smallest, "
            f"{smallest.layout.describe()}, needs {need:.1f} GiB of {usable:.0f} GiB usable; "
            "add GPUs, allow more sharding or recompute (fewer constraints), or a smaller "
            "micro-batch")
