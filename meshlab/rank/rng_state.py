"""Which of the process's global random generators a cell drew from: their states before and
after it, compared. torch's CPU generator, the current CUDA device's (once CUDA is up: this
never starts it) and Python's ``random``: some microseconds a cell. Not NumPy's global one
(reading its state takes ~50 us, twice a cell), nor a generator object of the cell's own.

An export leaves a failed cell out; if that cell drew, the script draws different numbers
after it than the notebook did, and the export says so. Plain Python and torch.
"""

from __future__ import annotations

import random
from typing import Any

import torch

GENERATORS = ("torch", "cuda", "random")


def snapshot() -> dict[str, Any]:
    """Every generator's state now, by its name in GENERATORS (copies: drawing changes none)."""
    states: dict[str, Any] = {"torch": torch.random.get_rng_state(),
                              "random": random.getstate()}
    if torch.cuda.is_initialized():  # asking first would initialize CUDA in a CPU cell
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def drawn(before: dict[str, Any]) -> list[str]:
    """The generators whose state differs from ``before`` (a snapshot()), in GENERATORS order."""
    after = snapshot()
    changed = []
    for name in GENERATORS:
        if name not in after:
            continue
        if name not in before:  # CUDA started in the cell: a draw moved its offset off 0
            if name == "cuda" and (after[name].numel() != 16 or after[name][8:].any()):
                changed.append(name)
            continue
        was, now = before[name], after[name]
        same = torch.equal(was, now) if isinstance(was, torch.Tensor) else was == now
        if not same:
            changed.append(name)
    return changed
