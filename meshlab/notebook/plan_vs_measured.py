"""The planner's step time on the live mesh: each term it predicts (compute, host time,
exposed communication per mesh axis, pipeline bubble, optimizer, the step) beside the same
term measured from a profiled training step, with the ratio and, where they are more than
25% apart, why, read from the profile's own numbers.

Notebook side. Measured terms are each rank's time per step, **averaged over the ranks**: the
planner predicts one rank of a layout whose ranks do the same work (the busiest pipeline
stage's), and a slow rank shows in the others' exposed communication as waiting, which the
"why" column names. Each rank's window is shared out without overlap: the optimizer step
(torch.optim's ``Optimizer.step`` region, less the communication it waited on), compute and
copies outside it, communication that nothing hid (per axis), and host time (Python between
ops: the profile's idle). On a pipeline, a stage's exposed send/recv time is its bubble
(waiting for the neighbouring stage), the row the planner's simulated bubble stands beside.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from meshlab.measure.profiling import RankProfile
from meshlab.mesh import AXES, VIEWS, MeshSpec
from meshlab.notebook.cell_profile import CellProfile, Interval, length, overlap, union
from meshlab.notebook.tables.comms import axis_of
from meshlab.notebook.tables.table import Table, sig
from meshlab.plan.compute import ADAMW_BYTES
from meshlab.plan.differences import axis_name
from meshlab.plan.estimate import Estimate, estimate
from meshlab.plan.stage import Stage

LOW, HIGH = 0.75, 1 / 0.75
"""measured / predicted outside this range: more than 25% apart, and the row says why."""
OPTIMIZER_REGION = "Optimizer.step#"  # torch.optim's record_function around every step()
COLUMNS = ["term", "predicted (ms)", "measured (ms)", "measured/predicted", "why"]


@dataclass(slots=True)
class Term:
    """One term of the step, predicted and measured (ms per step), with the numbers its
    reason reads (``evidence``: plain floats and strings, by name)."""

    name: str
    """compute, host time, exposed <axis>, bubble, optimizer or step."""
    predicted_ms: float
    measured_ms: float
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """measured / predicted (inf where the planner predicts none of it)."""
        if self.predicted_ms > 0:
            return self.measured_ms / self.predicted_ms
        return math.inf if self.measured_ms > 0 else 1.0

    @property
    def off(self) -> bool:
        """More than 25% apart either way."""
        return not LOW <= self.ratio <= HIGH


def why(term: Term) -> str:
    """Why a term is more than 25% off, from its evidence ("" where it is not off)."""
    if not term.off:
        return ""
    kind = term.name.split(" ")[0] if term.name.startswith("exposed ") else term.name
    reason = {"compute": _compute, "host time": _host, "exposed": _exposed, "bubble": _bubble,
              "optimizer": _optimizer, "step": _step}[kind](term)
    return f"measured {_times(term)} predicted: {reason}"


def _times(term: Term) -> str:
    return "none" if term.predicted_ms == 0 else f"{term.ratio:.2g}x"


def _compute(t: Term) -> str:
    e, parts = t.evidence, []
    if e.get("achieved_tflops"):
        parts.append(f"the step's {e['flops']:.3g} FLOPs per rank ran at "
                     f"{e['achieved_tflops']:.3g} TFLOP/s, the profile's matmuls at "
                     f"{e['profile_tflops']:.3g}")
    hidden, gap = e.get("hidden_ms", 0.0), t.measured_ms - t.predicted_ms
    if gap > 0 and hidden > 0.25 * gap:
        where = (f"on {e['device'].upper()} ranks its threads compete with the math for "
                 "the same cores" if e.get("device") == "cpu" else "its kernels slow the math")
        parts.append(f"{hidden:.3g} ms of communication a step ran beside compute (comm "
                     f"hidden): {where}")
    parts += _op_overhead(t)
    if e.get("slowest_ms", 0) > HIGH * max(e.get("fastest_ms", 0), 1e-9):
        parts.append(f"ranks differ: rank {e['slowest']} computes {e['slowest_ms']:.3g} ms, "
                     f"rank {e['fastest']} {e['fastest_ms']:.3g} ms")
    return "; ".join(parts) or "the calibrated matmul rate does not hold for these shapes"


def _host(t: Term) -> str:
    e = t.evidence
    return "; ".join([
        f"{t.measured_ms:.3g} ms a step between {e['ops']:.0f} ops ({e['gap_us']:.3g} us "
        f"after each: Python, autograd, hooks), where the profile allows "
        f"{e['per_layer_us']:.3g} us per layer for {e['layers']} layers", *_op_overhead(t)])


def _op_overhead(t: Term) -> list[str]:
    """Compute and host time off in opposite directions: the op overhead the calibration
    counts as host time, the profile inside each op (or the other way round)."""
    e = t.evidence
    pair = e.get("with_other")  # (predicted, measured) of the other of the two terms
    if not pair or (t.measured_ms - t.predicted_ms) * (pair[1] - pair[0]) >= 0:
        return []
    predicted, measured = t.predicted_ms + pair[0], t.measured_ms + pair[1]
    return [f"compute and host time together: {measured:.3g} ms measured, {predicted:.3g} ms "
            f"predicted ({measured / predicted:.2g}x): the profile times each op's own "
            "dispatch as compute (small tensors), the calibration counts it as host time per "
            "layer"]


def _exposed(t: Term) -> str:
    e, parts = t.evidence, []
    axis = t.name.removeprefix("exposed ")
    if t.predicted_ms == 0:
        return (f"the planner counts no exposed communication on {axis}; the ranks issued "
                f"{e['calls']:.3g} collectives a step there ({_bytes(e['bytes'])})")
    if e.get("waited_ms", 0) > 0.25 * t.measured_ms:
        parts.append(f"{e['waited_ms']:.3g} of its {t.measured_ms:.3g} ms was waiting for a "
                     f"later rank (rank {e['last']} arrived last at {e['last_count']} of "
                     f"{e['shared']} collectives)")
    if e.get("predicted_calls") and not LOW <= e["calls"] / e["predicted_calls"] <= HIGH:
        parts.append(f"{e['calls']:.3g} collectives a step where the planner counts "
                     f"{e['predicted_calls']:.3g}")
    if e.get("predicted_bytes") and not LOW <= e["bytes"] / e["predicted_bytes"] <= HIGH:
        parts.append(f"{_bytes(e['bytes'])} a step where the planner counts "
                     f"{_bytes(e['predicted_bytes'])}")
    if t.ratio > 1 and e.get("predicted_hidden_ms", 0) > 0.25 * t.predicted_ms \
            and e.get("hidden_ms", 0) < 0.5 * e["predicted_hidden_ms"]:
        parts.append(f"the planner hid {e['predicted_hidden_ms']:.3g} ms of it behind compute, "
                     f"{e.get('hidden_ms', 0):.3g} ms hid")
    if not parts and e.get("calls"):
        per_call = t.measured_ms / e["calls"]
        fit = t.predicted_ms / e["predicted_calls"] if e.get("predicted_calls") else 0
        parts.append(f"each collective took {per_call:.3g} ms, the profile's fit "
                     f"{fit:.3g} ms: the link ran {'slower' if t.ratio > 1 else 'faster'} "
                     "than calibrated")
    return "; ".join(parts) or "no collective timings to explain it"


def _bubble(t: Term) -> str:
    e, parts = t.evidence, []
    if e.get("slowest_ms", 0) > HIGH * max(e.get("fastest_ms", 0), 1e-9):
        parts.append(f"the stages are unbalanced: rank {e['slowest']} computes "
                     f"{e['slowest_ms']:.3g} ms a step, rank {e['fastest']} "
                     f"{e['fastest_ms']:.3g} ms, and the pipeline waits for the slower")
    if e.get("waited_ms", 0) > 0.25 * t.measured_ms:
        parts.append(f"{e['waited_ms']:.3g} ms of it waiting for the neighbouring stage to "
                     "send")
    if e.get("host_ms", 0) > 0.25 * e.get("compute_ms", math.inf):
        parts.append(f"{e['host_ms']:.3g} ms of host time a step per stage, which the "
                     "simulated schedule times as compute, lengthens every slot")
    return "; ".join(parts) or (f"the schedule simulated {e.get('slots', 0):.3g} slots of "
                                "compute; the measured stages waited "
                                f"{'longer' if t.ratio > 1 else 'less'}")


def _optimizer(t: Term) -> str:
    e = t.evidence
    achieved = e["bytes"] / (t.measured_ms * 1e-3) / 1e9 if t.measured_ms else 0.0
    return (f"AdamW passes over {_bytes(e['bytes'])} a step (the planner's "
            f"{ADAMW_BYTES} bytes per parameter of the rank's shard): {achieved:.3g} GB/s, "
            f"the profile's memory bandwidth {e['profile_gbs']:.3g} GB/s")


def _step(t: Term) -> str:
    gaps = sorted(t.evidence.get("gaps", {}).items(), key=lambda kv: -abs(kv[1]))
    shown = [f"{name} {ms:+.3g} ms" for name, ms in gaps[:3] if abs(ms) > 0]
    return (f"{t.measured_ms - t.predicted_ms:+.3g} ms a step, most of it "
            + ", ".join(shown)) if shown else "the terms above"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


# -- the planner's side ------------------------------------------------------------------------

def mesh_axis(planner_axis: str, est: Estimate, spec: MeshSpec, world_size: int) -> str:
    """The name the profile gives the groups of a planner axis (``dp`` of a ``dp=4`` layout
    -> ``dp_shard``; ``dp_shard+cp`` -> ``dp_shard_cp``): reconcile's mapping to mesh axes
    (``differences.axis_name``), then the profile's own labelling of that group."""
    dims: list[str] = []
    views, axes = spec.views(), spec.mesh_axes()
    for part in axis_name(planner_axis, est.layout).split("+"):
        dims += [d for d in views.get(part, (part,)) if d in axes]
    if not dims:
        return planner_axis
    return axis_of(spec.group_of(0, tuple(dims)), spec, world_size)


_SUMS = ("exposed", "seconds", "calls", "bytes")


def _predicted(est: Estimate, spec: MeshSpec, world: int) -> dict[str, dict[str, float]]:
    """Per profile axis: the planner's exposed seconds, all its seconds, calls, bytes."""
    out: dict[str, dict[str, float]] = {}
    for axis, seconds in est.exposed_by_axis.items():
        row = out.setdefault(mesh_axis(axis, est, spec, world), dict.fromkeys(_SUMS, 0.0))
        row["exposed"] += seconds
    for c in est.collectives:
        if c.collective == "copy":
            continue
        row = out.setdefault(mesh_axis(c.axis, est, spec, world), dict.fromkeys(_SUMS, 0.0))
        row["seconds"] += c.seconds
        row["calls"] += c.calls
        row["bytes"] += c.nbytes * c.calls
    return out


# -- the profile's side ------------------------------------------------------------------------

def _optimizer_regions(profile: RankProfile) -> list[Interval]:
    return union((m.start_ns, m.end_ns) for m in profile.marks
                 if m.name.startswith(OPTIMIZER_REGION))


def _rank_terms(profile: CellProfile) -> pd.DataFrame:
    """Per rank, in ms for the whole cell: compute, host time and optimizer, the window
    shared out without overlap (exposed communication is the summary's), and ops."""
    rows = []
    for r, p in sorted(profile.ranks.items()):
        window = (p.start_ns, p.end_ns)
        busy = union((s.start_ns, s.end_ns) for s in p.spans)
        comm = union((c.issued_ns, c.done_ns or c.issued_ns) for c in p.collectives)
        either = union(busy + comm)
        opt = overlap(_optimizer_regions(p), [window])
        opt_comm_exposed = length(overlap(opt, comm)) - length(overlap(overlap(opt, comm), busy))
        rows.append({"rank": r,
                     "compute": (length(busy) - length(overlap(busy, opt))) / 1e6,
                     "host": max(0, p.end_ns - p.start_ns - length(either)
                                 - (length(opt) - length(overlap(opt, either)))) / 1e6,
                     "optimizer": (length(opt) - opt_comm_exposed) / 1e6,
                     "ops": len(p.spans)})
    return pd.DataFrame(rows).set_index("rank")


def _axis_evidence(profile: CellProfile, steps: int) -> dict[str, dict[str, Any]]:
    """Per axis: calls and bytes a step (mean over ranks), waits for later ranks (ms a step,
    mean over ranks) and the rank most often last."""
    n = len(profile.ranks)
    out: dict[str, dict[str, Any]] = {}
    for p in profile.ranks.values():
        for c in p.collectives:
            e = out.setdefault(profile.axis(c), {"calls": 0.0, "bytes": 0.0, "waited_ms": 0.0})
            e["calls"] += 1 / n / steps
            e["bytes"] += c.bytes / n / steps
    calls = profile.collectives()
    for axis, part in (calls.groupby("axis") if len(calls) else []):
        e = out[str(axis)]
        e["waited_ms"] = sum(sum(w.values()) for w in part["waits"]) / n / steps
        shared = part[part["ranks"].apply(len) > 1]
        if len(shared):
            last, count = Counter(shared["last"]).most_common(1)[0]
            e.update(last=int(last), last_count=count, shared=len(shared))
    return out


# -- the table ---------------------------------------------------------------------------------

def plan_terms(profile: CellProfile, est: Estimate, *, steps: int = 1) -> list[Term]:
    """Each term of the step, predicted by ``est`` and measured in ``profile`` (which ran
    ``steps`` training steps): ms per step, measured averaged over the ranks."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}: how many training steps the "
                         "profiled cell ran")
    spec = profile.spec or est.layout.mesh_spec
    world, lay, hw = profile.world_size, est.layout, est.hardware
    summary, mine = profile.summary(), _rank_terms(profile)
    ranks = len(mine)
    pipeline = lay.pp > 1
    pp_axis = mesh_axis("pp", est, spec, world) if pipeline else ""
    no_host = dataclasses.replace(hw, layer_overhead_us=0.0, fsdp_overhead_us=0.0,
                                  tp_overhead_us=0.0)
    math_s = estimate(est.model, lay, no_host).compute_s
    compute = mine["compute"] / steps
    slow = max(compute.index, key=lambda r: compute[r])
    fast = min(compute.index, key=lambda r: compute[r])
    spread = {"slowest": slow, "slowest_ms": float(compute[slow]), "fastest": fast,
              "fastest_ms": float(compute[fast])}
    flops = est.hardware_flops / lay.gpus  # one rank's share of a step, recompute included
    measured_compute = float(compute.mean())
    terms = [Term("compute", math_s * 1e3, measured_compute, {
        "flops": flops, "profile_tflops": hw.tflops[lay.dtypes.compute], "device": _device(
            profile), "hidden_ms": float(summary["comm hidden"].mean()) / steps,
        "achieved_tflops": flops / (measured_compute * 1e-3) / 1e12 if measured_compute
        else 0.0, **spread})]
    stage = Stage(est.model, lay, hw)
    host_ms = float(mine["host"].mean()) / steps
    host_predicted = (est.compute_s - math_s) * 1e3
    terms[0].evidence["with_other"] = (host_predicted, host_ms)
    per_layer = hw.layer_overhead_us + hw.fsdp_overhead_us * (lay.zero >= 2) \
        + hw.tp_overhead_us * (lay.tp > 1)
    ops = float(mine["ops"].mean()) / steps
    terms.append(Term("host time", host_predicted, host_ms, {
        "ops": ops, "gap_us": host_ms * 1e3 / max(ops, 1), "per_layer_us": per_layer,
        "layers": stage.layers, "with_other": (math_s * 1e3, measured_compute)}))
    predicted = _predicted(est, spec, world)
    evidence = _axis_evidence(profile, steps)
    measured_axes = [c.removeprefix("exposed ") for c in summary.columns
                     if c.startswith("exposed ")]
    for axis in sorted(set(predicted) | set(measured_axes), key=_axis_order):
        if axis == pp_axis:
            continue
        p = predicted.get(axis, dict.fromkeys(_SUMS, 0.0))
        measured = float(summary[f"exposed {axis}"].mean()) / steps \
            if axis in measured_axes else 0.0
        if p["exposed"] * 1e3 < 1e-6 and measured < 1e-6:
            continue
        e = evidence.get(axis, {"calls": 0.0, "bytes": 0.0})
        all_comm = sum(length(union((c.issued_ns, c.done_ns or c.issued_ns)
                                    for c in r.collectives if profile.axis(c) == axis))
                       for r in profile.ranks.values()) / ranks / 1e6 / steps
        terms.append(Term(f"exposed {axis}", p["exposed"] * 1e3, measured, {
            **e, "predicted_calls": p["calls"], "predicted_bytes": p["bytes"],
            "hidden_ms": all_comm - measured,
            "predicted_hidden_ms": (p["seconds"] - p["exposed"]) * 1e3}))
    if pipeline:
        e = evidence.get(pp_axis, {})
        bubble = float(summary[f"exposed {pp_axis}"].mean()) / steps \
            if f"exposed {pp_axis}" in summary else 0.0
        terms.append(Term("bubble", est.bubble_s * 1e3, bubble, {
            **spread, "waited_ms": e.get("waited_ms", 0.0), "host_ms": host_ms,
            "compute_ms": measured_compute, "slots": est.pipeline_s / max(
                est.pipeline_s - est.bubble_s, 1e-12)}))
    dense, expert = stage.params
    shard = lay.shard_group if lay.zero >= 1 else 1
    terms.append(Term("optimizer", est.optimizer_s * 1e3, float(mine["optimizer"].mean()) / steps,
                      {"bytes": (dense + expert) / shard * ADAMW_BYTES,
                       "profile_gbs": hw.memory_bandwidth_gbs}))
    window = float(summary["window"].mean()) / steps
    terms.append(Term("step", est.step_s * 1e3, window,
                      {"gaps": {t.name: t.measured_ms - t.predicted_ms for t in terms}}))
    return terms


def _axis_order(axis: str) -> tuple[int, str]:
    order = (*AXES, *VIEWS)  # the mesh's order, then its views
    return (order.index(axis) if axis in order else len(order), axis)


def _device(profile: CellProfile) -> str:
    devices = {p.device for p in profile.ranks.values()}
    return devices.pop() if len(devices) == 1 else "mixed"


def plan_vs_measured(profile: CellProfile, est: Estimate, *, steps: int = 1) -> Table:
    """The planner's terms of the step beside the same terms measured in ``profile`` (a
    ``%%mesh --profile`` of ``steps`` training steps under ``est``'s layout): predicted and
    measured ms per step, their ratio, and why where they are more than 25% apart."""
    terms = plan_terms(profile, est, steps=steps)
    frame = pd.DataFrame([{"term": t.name, "predicted (ms)": t.predicted_ms,
                           "measured (ms)": t.measured_ms, "measured/predicted": t.ratio,
                           "why": why(t)} for t in terms], columns=COLUMNS)
    three = sig(3)
    ranks = len(profile.ranks)
    return Table(frame, formats={"predicted (ms)": three, "measured (ms)": three,
                                 "measured/predicted": lambda x: "" if not math.isfinite(x)
                                 else f"{x:.2f}"},
                 caption=f"the planner on the live mesh: {est.layout.describe()}, "
                         f"{est.model.name} on {est.hardware.name}",
                 note=f"measured: ms per step over {steps} profiled step"
                      f"{'s' if steps > 1 else ''}, the mean of the {ranks} ranks; each "
                      "rank's window shared out without overlap (exposed: communication "
                      "nothing hid; host time: between ops). why: where measured/predicted "
                      f"is outside {LOW:.2f}-{HIGH:.2f}")
