"""Which context-parallel implementation a layout should run: every one meshlab.parallel
offers, estimated, the fastest that fits kept, with the reason in its notes (bytes on the
wire per layer, CP time left exposed, memory, and why the others lost or were refused)."""

from __future__ import annotations

import dataclasses

from meshlab.plan.context_formulas import CONTIGUOUS_CP, context_parallel_bytes
from meshlab.plan.estimate import Estimate, estimate
from meshlab.plan.hardware import GIB, Hardware
from meshlab.plan.layout import Layout
from meshlab.plan.shapes import ModelShape

SEARCHED_CP = ("meshlab", "torch", "ulysses", "chunked")
"""The implementations a search tries (ParallelPlan's; "all_gather", Llama 3's, only when
pinned with cp_impl=all_gather)."""


@dataclasses.dataclass(frozen=True)
class CpOption:
    """One implementation tried for a layout: its estimate, or why it cannot run."""

    impl: str
    estimate: Estimate | None
    refused: str = ""

    @property
    def wire_mib(self) -> float:
        """Bytes one rank sends for one layer's CP collectives (forward and backward), MiB."""
        assert self.estimate is not None
        m, lay = self.estimate.model, self.estimate.layout
        return context_parallel_bytes(
            self.impl, batch=lay.micro_batch, seq_len=m.seq_len, heads=m.heads // lay.tp,
            kv_heads=m.n_kv_heads // lay.tp, head_dim=m.head_width, cp=lay.cp,
            dtype_bytes=lay.dtypes.activations, chunks=lay.cp_chunks)["wire"] / 2**20

    def text(self) -> str:
        """``ulysses: step 7.41 s, 14.0 MiB/layer on the wire, CP exposed 0.09 s, 38.0 GiB``."""
        if self.estimate is None:
            return f"{self.impl}: refused ({self.refused})"
        e = self.estimate
        lay = e.layout
        skew = (f", causal skew x{2 - 1 / lay.cp:.3g} (contiguous slices)"
                if lay.flash_attention and self.impl in ("meshlab", "torch") else "")
        return (f"{self.impl}: step {e.step_s:.3g} s, {self.wire_mib:.3g} MiB/layer on the "
                f"wire, CP exposed {e.exposed_by_axis.get('cp', 0.0):.3g} s{skew}, "
                f"{e.memory['total'] / GIB:.3g} GiB" + ("" if e.fits else " (does not fit)"))


def cp_options(model: ModelShape, layout: Layout, hardware: Hardware,
               impls: tuple[str, ...] = SEARCHED_CP) -> list[CpOption]:
    """``layout`` estimated with each of ``impls`` (or the reason it cannot take one)."""
    out = []
    for impl in impls:
        try:
            # head-tail slicing is a choice of the contiguous impls only; the others split
            # the work evenly already
            balanced = layout.cp_balanced and impl in CONTIGUOUS_CP
            e = estimate(model, dataclasses.replace(layout, context_parallel=impl,
                                                    cp_balanced=balanced), hardware)
        except ValueError as error:
            out.append(CpOption(impl, None, str(error)))
            continue
        out.append(CpOption(impl, e))
    return out


def best_cp(model: ModelShape, layout: Layout, hardware: Hardware,
            impls: tuple[str, ...] = SEARCHED_CP) -> Estimate | None:
    """The fastest of ``impls`` that fits (else the one needing least memory), its notes
    saying why; None when none can run. A layout without cp: its own estimate."""
    if layout.cp == 1:
        return estimate(model, layout, hardware)
    options = cp_options(model, layout, hardware, impls)
    ran = [o for o in options if o.estimate is not None]
    if not ran:
        return None

    def rank(o: CpOption) -> tuple[bool, float]:
        e = o.estimate
        assert e is not None
        return (not e.fits, e.step_s if e.fits else e.memory["total"])

    best = min(ran, key=rank)
    assert best.estimate is not None
    if len(options) == 1:
        return best.estimate
    why = "fastest that fits" if best.estimate.fits else "none fits: least memory"
    note = (f"cp_impl={best.impl} ({why}) of " + "; ".join(o.text() for o in options))
    return dataclasses.replace(best.estimate, notes=[*best.estimate.notes, note])
