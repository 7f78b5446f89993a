"""``plan(...)``: one layout estimated, or the best layouts searched, as tables to show."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshlab.mesh import AXES
from meshlab.plan.context import SEARCHED_CP, best_cp
from meshlab.plan.estimate import Estimate, estimate
from meshlab.plan.formulas import ZERO_STAGES
from meshlab.plan.hardware import GIB, Hardware, hardware
from meshlab.plan.layout import IMPLEMENTATIONS, Layout
from meshlab.plan.layout_check import check
from meshlab.plan.search import search
from meshlab.plan.shapes import ModelShape, model_shape

if TYPE_CHECKING:  # pandas only when a table is asked for: ranks import the planner
    import pandas as pd

# the settings that decide whose code a plan's memory counts (reduce_fp32 is also Megatron's)
COUNTED = ("sp_regather", "loss_parallel", "pipeline_grads_unsharded")

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
COMM_COLUMNS = ("axis", "what", "collective", "ranks", "link", "calls", "mib_each", "seconds",
                "overlapped")
STEP_TOKENS = 4 * 2**20  # default batch: ~4M tokens per step, as Llama 3 began with
NODE = 8  # GPUs a tensor-parallel group fills (one node): one sequence each, at least


@dataclass
class Plan:
    """Estimates of one model on ``gpus`` GPUs of ``hardware``, best first."""

    model: ModelShape
    gpus: int
    hardware: Hardware
    estimates: list[Estimate]
    tokens: float | None = None
    """Training tokens, for days and GPU-hours."""
    notes: list[str] = field(default_factory=list)
    """What ``plan`` assumed that the caller did not say (e.g. the ZeRO stage)."""
    implementation: str = "meshlab"
    """Whose code the memory is counted for (``IMPLEMENTATIONS``), as the best layout's
    settings say: "mixed" where they are some of each."""
    verified: list[Any] = field(default_factory=list)
    """Dry runs (meshlab.dry_run.run.DryRun) of the best layouts, where asked for: what torch
    allocates and sends for them, beside these estimates."""

    @property
    def best(self) -> Estimate:
        return self.estimates[0]

    def rows(self) -> list[dict[str, Any]]:
        """One dict per layout, as ``table`` shows them (plain Python values)."""
        rows = []
        offloads = any(e.memory["host"] for e in self.estimates)
        for e in self.estimates:
            row = {"layout": e.layout.describe(), "fits": e.fits,
                   "memory_gib": _sig(e.memory["total"] / GIB),
                   **({"host_gib": _sig(e.memory["host"] / GIB)} if offloads else {}),
                   "step_s": _sig(e.step_s),
                   "bubble": round(e.bubble_fraction, 3),
                   "exposed_comm_s": _sig(e.exposed_comm_s),
                   "tokens_per_s": _whole(e.tokens_per_s),
                   "tflops_per_gpu": _sig(e.tflops_per_gpu), "mfu": _sig(e.mfu),
                   "hw_tflops_per_gpu": _sig(e.hw_tflops_per_gpu), "hfu": _sig(e.hfu)}
            if self.tokens:
                row["days"] = round(e.train_days(self.tokens), 1)
                row["gpu_hours"] = round(e.gpu_hours(self.tokens))
            rows.append(row)
        return rows

    def table(self) -> pd.DataFrame:
        """One row per layout: memory, step time, throughput, MFU (and days to train)."""
        import pandas as pd

        return pd.DataFrame(self.rows())

    def memory_frame(self) -> pd.DataFrame:
        """Long format for a stacked bar per layout: layout, part, gib (plus usable_gib)."""
        import pandas as pd

        rows = [{"layout": e.layout.describe(), "part": part, "gib": e.memory[part] / GIB,
                 "usable_gib": self.hardware.usable_bytes / GIB}
                for e in self.estimates for part in MEMORY_PARTS]
        return pd.DataFrame(rows)

    def comm_rows(self, index: int = 0) -> list[dict[str, Any]]:
        """The collectives of one layout (the best by default), slowest first, as dicts."""
        rows = [{"axis": c.axis, "what": c.what, "collective": c.collective, "ranks": c.ranks,
                 "link": "PCIe" if c.collective == "copy" else
                 "inter-node" if c.inter_node else "intra-node", "calls": c.calls,
                 "mib_each": round(c.nbytes / 2**20, 2), "seconds": c.seconds,
                 "overlapped": c.overlapped} for c in self.estimates[index].collectives]
        return sorted(rows, key=lambda row: -row["seconds"])

    def comm_frame(self, index: int = 0) -> pd.DataFrame:
        """The collectives of one layout (the best by default), slowest axis first."""
        import pandas as pd

        return pd.DataFrame(self.comm_rows(index), columns=COMM_COLUMNS)

    def as_dict(self) -> dict[str, Any]:
        """Everything ``text``, ``table`` and ``comm_frame`` show, as plain values for JSON:
        model, gpus, hardware, global batch, the best layout and its numbers (unrounded),
        every layout, the best one's collectives and the notes."""
        e = self.best
        best = {"layout": e.layout.describe(), "settings": dataclasses.asdict(e.layout),
                "fits": e.fits,
                "memory_gib": {part: e.memory[part] / GIB
                               for part in (*MEMORY_PARTS, "total", "host")},
                "step_s": e.step_s, "compute_s": e.compute_s, "pipeline_s": e.pipeline_s,
                "bubble": e.bubble_fraction, "exposed_comm_s": e.exposed_comm_s,
                "optimizer_s": e.optimizer_s, "tokens_per_step": e.tokens_per_step,
                "tokens_per_s": e.tokens_per_s, "tflops_per_gpu": e.tflops_per_gpu,
                "mfu": e.mfu, "hw_tflops_per_gpu": e.hw_tflops_per_gpu, "hfu": e.hfu,
                "days": e.train_days(self.tokens) if self.tokens else None,
                "gpu_hours": e.gpu_hours(self.tokens) if self.tokens else None}
        return {"model": {**dataclasses.asdict(self.model), "params": self.model.params},
                "gpus": self.gpus, "hardware": self.hardware.name,
                "implementation": self.implementation,
                "usable_gib": self.hardware.usable_bytes / GIB,
                "global_batch": e.layout.global_batch, "seq_len": self.model.seq_len,
                "tokens": self.tokens, "best": best,
                "layouts": [{**row, "days": row.get("days"), "gpu_hours": row.get("gpu_hours")}
                            for row in self.rows()],
                "collectives": self.comm_rows(), "notes": [*self.notes, *e.notes]}

    def text(self) -> str:
        """A few lines on the best layout."""
        e = self.best
        host = e.memory["host"]
        ffn = "gated 3-matrix" if self.model.gated_ffn else "plain 2-matrix"
        lines = [f"{self.model.name} ({count_text(self.model.params)} parameters, {ffn} FFN) on "
                 f"{self.gpus} x {self.hardware.name}, global batch {e.layout.global_batch} "
                 f"x {self.model.seq_len} tokens ({e.tokens_per_step / 2**20:.1f}M)",
                 f"{e.layout.describe()}: {e.memory['total'] / GIB:.3g} GiB per GPU"
                 + (f" + {e.memory['host'] / GIB:.3g} GiB of host memory" if host else "")
                 + (f" as {self.implementation}'s code holds it"
                    if self.implementation in IMPLEMENTATIONS else " as its settings count it")
                 + f" ({'fits' if e.fits else 'does NOT fit'} in "
                 f"{self.hardware.usable_bytes / GIB:.0f} GiB"
                 + (f" + {self.hardware.host_memory_gib:.0f} GiB" if host else "")
                 + f"), step {e.step_s:.3g} s, "
                 f"{e.tokens_per_s:,.0f} tokens/s, per GPU {e.tflops_per_gpu:.3g} model / "
                 f"{e.hw_tflops_per_gpu:.3g} hardware TFLOP/s (recompute counted), MFU "
                 f"{_percent(e.mfu)}, HFU {_percent(e.hfu)}, bubble {e.bubble_fraction:.0%}"]
        if self.tokens:
            lines.append(f"{self.tokens:.3g} tokens: {e.train_days(self.tokens):.1f} days, "
                         f"{e.gpu_hours(self.tokens):,.0f} GPU-hours")
        lines += [*self.notes, *e.notes]
        return "\n".join(lines)


def default_batch(model: ModelShape, gpus: int) -> int:
    """Sequences per step: a power of two near 4M tokens, and at least one per node of 8
    GPUs (a data-parallel rank of a layout with tp=8): Llama 3 405B's 16M tokens on 16,384
    GPUs (Dubey et al. 2024, section 3.4.1), its 8B's 4M on fewer."""
    return 2 ** math.ceil(math.log2(max(STEP_TOKENS / model.seq_len, gpus / NODE, 1)))


def plan(model: str | ModelShape, *, gpus: int, hardware_profile: str | Hardware = "h100-sxm",
         layout: str | Layout | None = None, constraints: str | None = None,
         global_batch: int | None = None, precision: str = "bf16", top: int = 10,
         tokens: float | None = None, implementation: str = "meshlab") -> Plan:
    """Estimate ``layout`` (its degrees must multiply to ``gpus``; ``global_batch`` sets its
    micro-batches where it states none), or search the best ``top`` layouts meeting
    ``constraints`` (e.g. "tp<=8 pp=16"), counting memory as ``implementation``'s code holds
    it (``IMPLEMENTATIONS``: meshlab's, what a dry run measures, or Megatron-LM's)."""
    shape, hw = model_shape(model), hardware(hardware_profile)
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: expected one of "
                         f"{', '.join(IMPLEMENTATIONS)}")
    code = IMPLEMENTATIONS[implementation]
    if layout is not None:
        notes = []
        stated = {f.name for f in dataclasses.fields(Layout)}  # a Layout states everything
        if isinstance(layout, str):
            given = Layout.stated(layout)
            layout, stated = Layout(**{"precision": precision, **code, **given}), set(given)
        if "zero" not in stated:
            notes.append(f"zero not given: zero={layout.zero} assumed (FSDP: parameters, "
                         "gradients and optimizer states sharded); pass "
                         f"zero={min(ZERO_STAGES)}..{max(ZERO_STAGES)} in the layout to "
                         "choose")
        if layout.gpus != gpus:
            raise ValueError(f"the layout {layout.describe()} uses {layout.gpus} GPUs, not "
                             f"{gpus}: make {' x '.join(AXES)} = {gpus}")
        if global_batch is not None:
            layout = with_batch(layout, global_batch, fixed="microbatches" in stated)
        if layout.cp > 1 and "context_parallel" not in stated:
            # check() first: a layout the model cannot take says why, whatever the impl
            check(shape, dataclasses.replace(layout, context_parallel="meshlab"))
            notes.append("cp_impl not given: each of " + ", ".join(SEARCHED_CP) + " tried, "
                         "the fastest that fits kept; pass cp_impl=NAME in the layout to "
                         "choose")
            best = best_cp(shape, layout, hw)
            if best is None:
                raise ValueError(f"no context-parallel implementation runs "
                                 f"{layout.describe()} on {hw.name}: see cp_impl's options")
            return Plan(shape, gpus, hw, [best], tokens, notes, whose(best.layout))
        return Plan(shape, gpus, hw, [estimate(shape, layout, hw)], tokens, notes,
                    whose(layout))
    batch = global_batch or default_batch(shape, gpus)
    found: Any = search(shape, gpus=gpus, hardware=hw, global_batch=batch,
                        constraints=constraints, precision=precision, top=top, settings=code)
    notes = [] if global_batch else [
        f"global batch not given: {batch:,} sequences of {shape.seq_len:,} tokens "
        f"({batch * shape.seq_len / 2**20:.0f}M tokens), ~4M tokens or one sequence per "
        f"{NODE} GPUs where that is more (Llama 3 405B: 16M on 16,384); --batch sets it"]
    return Plan(shape, gpus, hw, list(found["estimate"]), tokens, notes, implementation)


def whose(layout: Layout) -> str:
    """The implementation whose memory ``layout``'s settings count, or "mixed"."""
    for name, settings in IMPLEMENTATIONS.items():
        if all(getattr(layout, key) == settings.get(key, Layout.__dataclass_fields__[key].default)
               for key in COUNTED):
            return name
    return "mixed"


def with_batch(layout: Layout, global_batch: int, *, fixed: bool) -> Layout:
    """``layout`` with ``global_batch`` sequences per step: its micro-batches set from it, or,
    where they are ``fixed`` (stated), checked against it."""
    mbs, m, dp = layout.micro_batch, layout.microbatches, layout.dp
    if global_batch == layout.global_batch:
        return layout
    if fixed:
        raise ValueError(f"--batch {global_batch} disagrees with the layout's mbs={mbs} x "
                         f"m={m} x dp={dp} = {layout.global_batch} sequences: pass --batch "
                         f"{layout.global_batch}, or drop m= from the layout to have it set "
                         "from --batch")
    if global_batch < 1 or global_batch % (mbs * dp):
        lower = max(mbs * dp, global_batch - global_batch % (mbs * dp))
        raise ValueError(f"--batch {global_batch} is not a multiple of the layout's mbs={mbs} "
                         f"x dp={dp} = {mbs * dp} sequences: pass --batch {lower}, or change "
                         "mbs or dp")
    return dataclasses.replace(layout, microbatches=global_batch // (mbs * dp))


def _sig(x: float) -> float:
    """Three significant figures: tiny models' numbers do not round to 0."""
    return float(f"{x:.3g}")


def _whole(x: float) -> float | int:
    """Three significant figures, as an int from 100 up: 311000, not 311000.0."""
    return round(_sig(x)) if abs(x) >= 100 else _sig(x)


def count_text(n: int) -> str:
    """405.9B, 70.6B, 106.8K parameters."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _percent(fraction: float) -> str:
    """A fraction as a percentage to two figures: 0.52 -> '52%', 1.77e-05 -> '0.0018%'."""
    return f"{float(f'{fraction * 100:.2g}'):g}%"
