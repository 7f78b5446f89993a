"""One published training run as the planner reads it: its source, layout, figure and what
the paper leaves unsaid; and the FLOP counts that turn a figure into a step time."""

from __future__ import annotations

from dataclasses import dataclass

from meshlab.plan.compute import flops_per_token
from meshlab.plan.hardware import Hardware
from meshlab.plan.layout import Layout
from meshlab.plan.shapes import ModelShape

# what a published figure is
STEP = "step s"  # iteration time, as printed
HARDWARE_TFLOPS = "hardware TFLOP/s per GPU (Megatron eq. 3: recomputed forward counted)"
MODEL_TFLOPS = "model TFLOP/s per GPU (MFU: 6N + attention, no recompute)"
MEGATRON_CORE_TFLOPS = ("model TFLOP/s per GPU (Megatron-Core's logged count: 72 B s l h^2 "
                        "(1 + s/6h + V/12lh), attention unmasked, no recompute)")
TOKENS_PER_GPU = "tokens/s per GPU"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    """Paper, table and row."""
    model: ModelShape
    hardware: str | Hardware
    """A built-in profile's name, or the run's own (hardware the presets do not describe)."""
    layout: str
    """What the paper states, as ``Layout.parse`` reads it (micro-batches follow from the
    batch and the micro-batch size)."""
    batch: int
    """Global batch, sequences."""
    figure: float
    unit: str
    free: tuple[str, ...] = ()
    """Layout knobs the paper does not state: the planner's choice among their values."""
    assumed: tuple[str, ...] = ()
    """Everything else taken as given that the paper does not say."""
    family: str = ""
    layer_slots: int = 0
    """Stage slots beyond the layers when splitting the pipeline (Llama 3: the embedding
    and the output, one each)."""

    @property
    def gpus(self) -> int:
        return self.stated().gpus

    def stated(self) -> Layout:
        """The layout as the paper states it (a free interleaving depth at 2 for now)."""
        return Layout.parse(self.layout + (" v=2" if "virtual" in self.free else ""))

    def published_step_s(self) -> float:
        """The run's step time: printed, or its figure through the source's own count."""
        m, tokens = self.model, self.batch * self.model.seq_len
        if self.unit == STEP:
            return self.figure
        if self.unit == TOKENS_PER_GPU:
            return tokens / (self.figure * self.gpus)
        flops = {HARDWARE_TFLOPS: lambda: megatron_flops(m, self.batch),
                 MEGATRON_CORE_TFLOPS: lambda: megatron_core_flops(m, self.batch),
                 # PaLM's 6N + attention: the MFU count
                 MODEL_TFLOPS: lambda: flops_per_token(m, "none", m.layers)[0] * tokens,
                 }[self.unit]()
        return flops / (self.figure * 1e12 * self.gpus)


def megatron_flops(m: ModelShape, batch: int) -> float:
    """Narayanan et al. 2021, eq. 3: F = 96 B s l h^2 (1 + s/6h + V/16lh) per iteration, a
    GPT layer (4h MLP) with its forward recomputed; the logits are not recomputed."""
    s, h, ell, v = m.seq_len, m.hidden, m.layers, m.vocab
    return 96 * batch * s * ell * h**2 * (1 + s / (6 * h) + v / (16 * ell * h))




def megatron_core_flops(m: ModelShape, batch: int) -> float:
    """What Megatron-Core (r0.8) logs per iteration for a GPT with a 4h MLP and full attention
    heads: 72 B s l h^2 (1 + s/6h + V/12lh), forward and backward, the attention square
    counted whole, no recompute (megatron/training/training.py,
    num_floating_point_operations)."""
    s, h, ell, v = m.seq_len, m.hidden, m.layers, m.vocab
    return 72 * batch * s * ell * h**2 * (1 + s / (6 * h) + v / (12 * ell * h))
