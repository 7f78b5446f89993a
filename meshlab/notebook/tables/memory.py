"""Measured bytes per rank beside the ZeRO paper's formula for the same run."""

from __future__ import annotations

from typing import Any

import pandas as pd

from meshlab.measure.memory import gathered_note, zero_bytes
from meshlab.notebook.tables.table import Table, in_byte_unit
from meshlab.plan.formulas import sharded_state_bytes

PARTS = ("params", "grads", "optimizer")


def memory_frame(reports: dict[int, Any], *, params: int, dp: int, stage: int | None,
                 tp: int = 1, activations: dict[int, tuple[int, int]] | None = None,
                 param_bytes: int = 4, grad_bytes: int = 4, optimizer_bytes: int = 8
                 ) -> pd.DataFrame:
    """One row per rank (measured) and, with a stage, one row of the formula; ``host``: the
    bytes offloading keeps in host memory, ``device`` the rest (the formula offloads none).
    ``activations``: ``{rank: (device, host)}`` bytes one forward saves for backward.

    The defaults are fp32 training with AdamW: 4-byte parameters and gradients, 8 bytes of
    optimizer state per parameter (exp_avg and exp_avg_sq; no separate master copy). Reports
    that name their optimizer's kind (``meshlab.measure.memory.measure`` of a build_optimizer
    optimizer) get that optimizer's state bytes instead, from the parameters' shapes
    (``meshlab.plan.formulas.sharded_state_bytes`` of one tp rank's shapes: the mean per
    rank).

    ``params`` is the model's parameter count, or what one tensor-parallel rank holds
    (``meshlab.measure.memory.tp_rank_params``: TP leaves norms, and often the embedding and head,
    whole); ``tp`` > 1 instead takes every parameter as split ``tp`` ways, an estimate.
    ZeRO then divides by ``dp``.
    """
    if tp < 1:
        raise ValueError(f"tp (tensor-parallel degree) must be >= 1, got {tp}")
    activations = activations or {}
    rows = [{"rank": str(r), **{p: getattr(m, p) for p in PARTS}, "source": "measured",
             "host": m.host + activations.get(r, (0, 0))[1]}
            for r, m in sorted(reports.items())]
    if stage is not None:
        formula = zero_bytes(params // tp, dp=dp, stage=stage, param_bytes=param_bytes,
                             grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
        first: Any = next(iter(reports.values()), None)
        kind = getattr(first, "optimizer_kind", "")
        if kind:  # the measured optimizer's own states, from the shapes it steps
            formula["optimizer"] = sharded_state_bytes(
                kind, list(first.shapes), dp=dp, stage=stage, param_bytes=first.element_bytes)
        rows.append({"rank": f"ZeRO-{stage} formula", **{p: formula[p] for p in PARTS},
                     "source": "formula", "host": 0})
    frame = pd.DataFrame(rows)
    parts = list(PARTS)
    if activations:  # measured only: bytes saved for backward by one forward
        frame["activations"] = [sum(activations.get(int(r), (0, 0))) if r.isdigit() else 0
                                for r in frame["rank"]]
        parts.append("activations")
    frame["total"] = frame[parts].sum(axis=1)
    frame["device"] = frame["total"] - frame["host"]
    host = frame.pop("host")
    frame["host"] = host  # after device: total = device + host
    frame = frame.set_index("rank")
    frame.attrs["resharded"] = sorted({n for m in reports.values()
                                       for n in getattr(m, "resharded", ())})
    frame.attrs["reset"] = any(getattr(m, "reset", False) for m in reports.values())
    return frame


def memory_table(frame: pd.DataFrame) -> Table:
    """``memory_frame`` as ``%mesh memory`` shows it: the bytes in its chart's unit."""
    columns = [c for c in (*PARTS, "activations", "total", "device", "host") if c in frame]
    shown = in_byte_unit(frame.reset_index()[["rank", *columns]], columns)
    formula = "; the last row: the ZeRO paper's formula" if (frame["source"] == "formula").any() \
        else ""
    notes = ["host: offloaded to host memory; total = device + host"] \
        if frame["host"].any() else []
    notes += [n for n in [gathered_note(frame.attrs.get("resharded", []),
                                        frame.attrs.get("reset", False))] if n]
    return Table(shown.frame, formats=shown.formats,
                 caption=f"memory per rank ({shown.unit}){formula}", note="; ".join(notes))
