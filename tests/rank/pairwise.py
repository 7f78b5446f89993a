"""Every pair of plan options, generated: a covering array over the model matrix's factors
(the model family one of them), and the pairs no case can hold.

A case gives each factor a level. It is *valid* when meshlab's own refusals (the pure ones:
``MeshSpec``, ``ParallelPlan``, ``combinations.check``, ``verify.check_comparable``) and the
family's expected refusals let it run; ``generate`` finds, for every pair of (factor, level),
a valid case holding it, then packs the pairs greedily into few cases (each pair at least
once: AETG's greedy idea, deterministic here). A pair no valid case holds is *refused*: the
test runs it and expects meshlab to refuse it, naming the option. Nothing here lists cases
by hand.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

from meshlab.mesh import MeshSpec
from meshlab.parallel import ParallelPlan
from meshlab.parallel.combinations import check
from meshlab.verify.compare import check_comparable

# factor -> levels; the first level is the default (a plain ZeRO-3 run on dp=4)
OPTIONS: dict[str, tuple[Any, ...]] = {
    "data_parallel": ("zero3", "none", "ddp", "zero1", "zero2"),
    "tp": ("off", "tp", "tp+sp"),
    "pp": ("off", "1f1b", "interleaved_1f1b", "zb_h1"),
    "cp": ("off", "meshlab", "ulysses", "chunked"),
    "ep": ("off", "on"),
    "dp_replicate": ("off", "on"),
    "ac": ("none", "selective", "full"),
    "grad_accum": (1, 2),
    "clip": ("off", "on"),
    "precision": ("fp64", "bf16", "fp16"),
    "offload": ("off", "params", "activations"),
    "replica_sync": ("every_step", "local_sgd", "diloco"),
    "optimizer": ("sgd", "adamw"),
    "init": ("cpu", "meta"),
}

Case = dict[str, Any]
Pair = tuple[tuple[str, Any], tuple[str, Any]]
RANKS = 4

# how meshlab's refusals name each option (a regex per level that is not the default)
NAMED: dict[str, Callable[[Any], str]] = {
    "data_parallel": lambda level: f"data_parallel='{level}'",
    "tp": lambda level: "tp=2|tensor.parallel|tp_plan|TP plan|sequence.parallel|SequenceParallel",
    "pp": lambda level: "pp=2|pipeline",
    "cp": lambda level: f"cp=2|context.parallel|context_parallel|{level}",
    "ep": lambda level: "ep=2|expert.parallel",
    "dp_replicate": lambda level: "dp_replicate",
    "ac": lambda level: "activation_checkpoint",
    "grad_accum": lambda level: f"grad_accum={level}",
    "clip": lambda level: "max_grad_norm",
    "precision": lambda level: f"{level}",
    "offload": lambda level: f"offload_{level}",
    "replica_sync": lambda level: f"replica_sync='{level}'",
    "optimizer": lambda level: f"{level}",
    "init": lambda level: "meta",
}


def mentions(message: str, factor: str, level: Any) -> bool:
    """Does a refusal name this option? (A family is named by the caller.)"""
    import re

    return factor in NAMED and re.search(NAMED[factor](level), message) is not None


def mesh_of(case: Mapping[str, Any]) -> str | None:
    """The 4-rank mesh a case runs on (each parallel option an axis of 2, data parallel the
    rest); None where its axes need more ranks than 4."""
    replicas = case["dp_replicate"] == "on" or case["replica_sync"] != "every_step"
    axes = [axis for axis, on in (("pp", case["pp"] != "off"), ("dp_replicate", replicas),
                                  ("cp", case["cp"] != "off"), ("tp", case["tp"] != "off")) if on]
    if 2 ** len(axes) > RANKS:
        return None
    rest = RANKS // 2 ** len(axes)
    parts = [f"{axis}=2" for axis in axes] + ([f"dp={rest}"] if rest > 1 else [])
    return " ".join(parts + (["ep=2"] if case["ep"] == "on" else []))


def plan_of(case: Mapping[str, Any]) -> dict[str, Any]:
    """ParallelPlan's arguments for a case."""
    plan: dict[str, Any] = {"data_parallel": case["data_parallel"]}
    if case["tp"] != "off":
        plan["sequence_parallel"] = case["tp"] == "tp+sp"
    if case["pp"] != "off":
        plan |= {"pipeline_schedule": case["pp"], "microbatches": 4}
        if case["pp"] == "interleaved_1f1b":
            plan["virtual"] = 2
    if case["cp"] != "off":
        plan["context_parallel"] = case["cp"]
    if case["ac"] != "none":
        plan["activation_checkpoint"] = case["ac"]
    if case["grad_accum"] != 1:
        plan["grad_accum"] = case["grad_accum"]
    if case["clip"] == "on":
        plan["max_grad_norm"] = 0.5
    if case["precision"] != "fp64":
        plan["mixed_precision"] = case["precision"]
    if case["precision"] == "fp16":  # 2**8: no step of these tiny models overflows and skips
        plan["loss_scale"] = 2.0 ** 8
    if case["offload"] != "off":
        plan[f"offload_{case['offload']}"] = True
    if case["replica_sync"] != "every_step":
        plan |= {"replica_sync": case["replica_sync"], "sync_every": 2}
    return plan


def compare_of(case: Mapping[str, Any]) -> dict[str, Any]:
    """compare_with_single_process's arguments for a case (float64; mixed precision's
    weights in float32, held against the same recipe in one process). 2 steps (the second
    takes the optimizer state the first made); fp16 3, as its first may be skipped on
    overflow."""
    return {"dtype": "float64" if case["precision"] == "fp64" else "float32",
            "optimizer": case["optimizer"], "on_meta": case["init"] == "meta",
            "steps": 3 if case["precision"] == "fp16" else 2}


def refusal(case: Mapping[str, Any], family_refuses: Callable[[Mapping[str, Any]], str | None]
            ) -> str | None:
    """Why meshlab refuses the case (its own words), or None when it runs it; a case whose
    axes need more than 4 ranks is refused by this harness, not by meshlab."""
    return _refusal(tuple(sorted(case.items())), family_refuses)


@cache
def _refusal(items: tuple[tuple[str, Any], ...], family_refuses: Any) -> str | None:
    case = dict(items)
    mesh = mesh_of(case)
    if mesh is None:
        return "(needs more than 4 ranks)"
    try:
        spec = MeshSpec.parse(mesh)
        plan = ParallelPlan(**plan_of(case))
        check(plan, spec.size_of)
        check_comparable(plan, case["optimizer"])
    except ValueError as e:
        return str(e)
    return family_refuses(case)


def pairs_of(case: Mapping[str, Any], names: Sequence[str]) -> set[Pair]:
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(names, 2)}


def generate(factors: Mapping[str, Sequence[Any]],
             family_refuses: Callable[[Mapping[str, Any]], str | None]
             ) -> tuple[list[Case], dict[Pair, tuple[Case, str]]]:
    """(cases that together hold every pair some valid case can hold, {every other pair:
    (a case holding it, why meshlab refuses that case)})."""
    names = list(factors)
    default = {f: levels[0] for f, levels in factors.items()}

    def runs(case: Case) -> bool:
        return refusal(case, family_refuses) is None

    def complete(pair: Pair) -> Case | None:
        """A valid case holding ``pair``: the defaults, else one or two factors changed."""
        base = {**default, **dict(pair)}
        fixed = {pair[0][0], pair[1][0]}
        free = [f for f in names if f not in fixed]
        for depth in (0, 1, 2):
            for chosen in itertools.combinations(free, depth):
                for levels in itertools.product(*(factors[f][1:] for f in chosen)):
                    case = {**base, **dict(zip(chosen, levels, strict=True))}
                    if runs(case):
                        return case
        return None

    def explain(pair: Pair) -> tuple[Case, str]:
        """The case to show a refused pair with, and meshlab's words for it: the defaults
        with the pair (a family's own refusal), or one other factor changed where that
        refusal names both sides."""
        base = {**default, **dict(pair)}
        if "family" in dict(pair) and (words := family_refuses(base)):
            return base, words  # the family's own refusal of the option, shown alone
        free = [f for f in names if f not in (pair[0][0], pair[1][0])]
        tries = [base] + [{**base, f: level} for f in free for level in factors[f][1:]]
        said = [(case, why) for case in tries
                if (why := refusal(case, family_refuses)) and not why.startswith("(needs")]
        both = [(case, why) for case, why in said
                if all(mentions(why, f, level) for f, level in pair if f != "family")]
        return (both or said or [(base, "(no valid case)")])[0]

    every = sorted(pairs_of({f: None for f in names}, names))  # factor pairs, in order
    completions: dict[Pair, Case | None] = {}
    for (a, _), (b, _) in every:
        for x, y in itertools.product(factors[a], factors[b]):
            pair = ((a, x), (b, y))
            completions[pair] = complete(pair)
    refused = {pair: explain(pair) for pair, case in completions.items() if case is None}
    uncovered = {pair for pair, case in completions.items() if case is not None}
    cases: list[Case] = []
    while uncovered:
        seed = min(uncovered, key=repr)
        case = dict(completions[seed] or {})
        for f in names:
            if f in (seed[0][0], seed[1][0]):
                continue
            best, gain = case[f], len(pairs_of(case, names) & uncovered)
            for level in factors[f]:
                trial = {**case, f: level}
                if level != case[f] and runs(trial):
                    more = len(pairs_of(trial, names) & uncovered)
                    if more > gain:
                        best, gain = level, more
            case[f] = best
        cases.append(case)
        uncovered -= pairs_of(case, names)
    return cases, refused
