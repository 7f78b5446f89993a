"""Published large training runs the planner is checked against: each with its source, table
and row, what its figure counts, and what the paper leaves unsaid, as explicit assumptions.

Every figure becomes the step time the run achieved, through the paper's own FLOP count
(papers differ: Megatron's counts the recomputed forward, MFU does not), so predicted and
published compare like for like whatever the convention.

Two parts, fixed by a hash of each run's name (``held_out``: one run in three), never
chosen: ``DEVELOPMENT``, the runs the model's terms are checked and mended against, and
``HELD_OUT``, the rest. A model that only learnt its examples reads worse on the held-out
part (tests/rank/test_published.py holds the gap to 5 points). The runs are grouped by
family (paper or code base) in ``a100`` and ``h100``; no constant is set per run or family.

Knobs a paper does not state (micro-batch size, interleaving depth, recomputation) are
``free``: the planner picks, among the values the paper leaves open, the fastest that fits,
as the authors tuned them (Narayanan et al. section 5.4, Korthikanti et al. section 6).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import replace
from typing import Any

from meshlab.plan.estimate import Estimate, estimate
from meshlab.plan.hardware import Hardware, hardware
from meshlab.plan.published import a100, h100
from meshlab.plan.published.a100 import GPT_175B
from meshlab.plan.published.run import (
    HARDWARE_TFLOPS,
    MODEL_TFLOPS,
    STEP,
    PublishedRun,
    megatron_flops,
)

__all__ = ["DEVELOPMENT", "FREE", "GPT_175B", "HARDWARE_TFLOPS", "HELD_OUT", "MODEL_TFLOPS",
           "RUNS", "STEP", "PublishedRun", "a100", "by_family", "error", "h100", "held_out",
           "megatron_flops", "predict"]

RUNS: list[PublishedRun] = [*a100.RUNS, *h100.RUNS]
"""Every published run the planner is checked against."""

HELD_OUT_ONE_IN = 3


def held_out(run: PublishedRun) -> bool:
    """Whether ``run`` is in the held-out part: one run in three, by a hash of its name,
    fixed before any constant was set, so no run can be moved to suit the model."""
    digest = hashlib.sha256(run.name.encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_ONE_IN == 0


DEVELOPMENT: list[PublishedRun] = [r for r in RUNS if not held_out(r)]
HELD_OUT: list[PublishedRun] = [r for r in RUNS if held_out(r)]


FREE: dict[str, tuple[Any, ...]] = {"micro_batch": (1, 2, 4, 8), "virtual": tuple(range(2, 9)),
                                    "schedule": ("1f1b", "interleaved_1f1b"),
        "recompute": ("none", "selective", "full")}
"""The values a free knob is tried at."""


def predict(run: PublishedRun, hw_override: Hardware | None = None) -> Estimate | None:
    """The planner's estimate of ``run``: its stated layout, with each free knob at the
    value the planner finds fastest among those that fit; None when none fits."""
    hw = hardware(hw_override or run.hardware)
    stated = run.stated()
    best: Estimate | None = None
    for values in itertools.product(*(FREE[k] for k in run.free)):
        knobs: dict[str, Any] = dict(zip(run.free, values, strict=True))
        if knobs.get("schedule") == "1f1b":
            if knobs.get("virtual", 2) != 2:
                continue  # one 1F1B per interleaving depth tried: keep the first
            knobs["virtual"] = 1
        mbs: int = knobs.get("micro_batch", stated.micro_batch)
        v = knobs.get("virtual", stated.virtual)
        if run.batch % (stated.dp * mbs) or (run.model.layers + run.layer_slots) % (stated.pp * v):
            continue  # equal chunks of layers (Llama 3 counts embedding and output as two)
        try:
            layout = replace(stated, **knobs, microbatches=run.batch // (stated.dp * mbs))
            e = estimate(run.model, layout, hw)
        except ValueError:
            continue  # not a layout this model takes (virtual stages, micro-batch rounds)
        if e.fits and (best is None or e.step_s < best.step_s):
            best = e
    return best


def error(run: PublishedRun, hw_override: Hardware | None = None) -> float:
    """Predicted over published step time, less one (negative: optimistic); +1.0 (100% off)
    when the planner says a run that ran does not fit."""
    e = predict(run, hw_override)
    return 1.0 if e is None else e.step_s / run.published_step_s() - 1


def by_family(errors: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per family, for each part (development, held-out, all): runs, mean absolute error and
    mean signed error (optimism below zero), from ``errors`` (run name -> signed error)."""
    out: dict[str, dict[str, float]] = {}
    for run in RUNS:
        if run.name not in errors:
            continue
        row = out.setdefault(run.family, {})
        for part in ("held-out" if held_out(run) else "development", "all"):
            e = errors[run.name]
            row[f"{part} runs"] = row.get(f"{part} runs", 0) + 1
            row[f"{part} abs"] = row.get(f"{part} abs", 0.0) + abs(e)
            row[f"{part} signed"] = row.get(f"{part} signed", 0.0) + e
    for row in out.values():
        for part in ("development", "held-out", "all"):
            n = row.get(f"{part} runs", 0)
            for kind in ("abs", "signed"):
                if n:
                    row[f"{part} {kind}"] /= n
    return out
