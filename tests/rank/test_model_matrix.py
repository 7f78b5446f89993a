"""The model matrix: every pair of plan options, and every option on every model family,
trained on 4 ranks beside one process, or refused before training naming the option.

The cases are generated (tests/rank/pairwise.py), not listed: a covering array over the
plan's options with the family as one more factor, so each pair of options runs together at
least once and each option runs on each family. Which cases exist is meshlab's own say (its
pure refusals); a pair no valid case holds must be refused, naming it. Families are
transformers models from tiny configs and a GPT written in a cell (tests/rank/families.py).

Each case is compare_with_single_process: 2 steps (the second takes the optimizer state the
first made; fp16 3, as its first may be skipped on overflow), float64 (AdamW or SGD with
momentum), bf16 and fp16 against the same recipe in one process with SGD, at the
tolerances meshlab.verify.compare derives.

The table in docs/guides/combinations.md is this test's output: ``MESHLAB_WRITE_MATRIX=1
python -m pytest tests/rank/test_model_matrix.py`` rewrites it; otherwise the test fails when
they differ.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from meshlab import Cluster
from tests.rank.families import FAMILIES_SOURCE, FAMILY_NAMES
from tests.rank.pairwise import OPTIONS, Case, compare_of, generate, mentions, mesh_of, plan_of

pytest.importorskip("transformers", reason="transformers is a test dependency")

EP_PLAN = {"Mixtral", "Qwen3-MoE", "OLMoE", "DeepSeek-V3", "Qwen2-MoE", "GPT-OSS", "Jamba"}
PIPELINES = ("1f1b", "interleaved_1f1b", "zb_h1")
CPS = ("meshlab", "ulysses", "chunked")
# What a family cannot do, whatever else the plan says: (families, {factor: levels}, what the
# refusal says). The pairs of plan options are meshlab's own pure refusals (pairwise.py); this
# is knowledge about the models, and a refusal that is not listed here fails the test.
FAMILY_REFUSALS: list[tuple[set[str], dict[str, tuple[Any, ...]], str]] = [
    (set(FAMILY_NAMES) - EP_PLAN, {"ep": ("on",)}, "expert parallel (ep=2) is applied to"),
    ({"Falcon", "StableLM"}, {"tp": ("tp", "tp+sp")}, "ships no tensor-parallel plan"),
    ({"Mixtral", "Qwen3-MoE", "OLMoE", "DeepSeek-V3", "Qwen2-MoE", "Jamba", "Llama4"},
     {"tp": ("tp+sp",)}, "has no sequence-parallel form"),
    ({"GPT-2", "GPT-OSS", "Bamba"}, {"tp": ("tp+sp",)}, "the TP plan has no SequenceParallel"),
    (set(FAMILY_NAMES), {"tp": ("tp+sp",), "pp": PIPELINES},
     "sequence_parallel=True with pp=2 is applied to meshlab's Transformer only"),
    ({"Falcon", "GPT in a cell"}, {"cp": CPS}, "context parallel (cp=2) is applied to"),
    ({"Jamba"}, {"cp": CPS}, "state-space layers"),
    ({"Bamba"}, {"cp": CPS}, "also has linear_attention layers"),
    ({"Llama4"}, {"cp": CPS}, "attention temperature on its layers without RoPE"),
    ({"GPT-OSS"}, {"cp": ("ulysses", "chunked")}, "has parameters its attention function"),
    ({"Jamba"}, {"precision": ("fp16",)}, "whose state-space layers"),
]


def family_refuses(case: Mapping[str, Any]) -> str | None:
    for families, conditions, said in FAMILY_REFUSALS:
        if case["family"] in families and all(case[f] in levels
                                               for f, levels in conditions.items()):
            return said
    return None


CASES, REFUSED = generate({"family": FAMILY_NAMES, **OPTIONS}, family_refuses)

CELL = '''
import meshlab.mesh
from meshlab.parallel import ParallelPlan
from meshlab.verify.reused_references import reusing_references
from meshlab.verify.compare import compare_with_single_process
from meshlab.schedules import ScheduleError

def _case(mesh, plan, how):
    try:
        r = compare_with_single_process(FAMILIES[FAMILY], meshlab.mesh.build(mesh),
                                        ParallelPlan(**plan), **how)
    except (ValueError, ScheduleError) as e:
        return ("refused", str(e))
    except Exception as e:
        return ("error", f"{type(e).__name__}: {e}")
    return ("ok" if r.ok else "DIFFERS", r.max_loss_error, r.max_param_error, r.worst_param,
            r.param_rtol, r.notes)

with reusing_references():  # one family's cases share their one-process runs
    _verdicts = [_case(mesh, plan, {**how, "dtype": getattr(torch, how["dtype"])})
                 for mesh, plan, how in RUNS]
_verdicts
'''


def runnable(case: Case) -> tuple[str, dict[str, Any], dict[str, Any]]:
    plan = plan_of(case)
    if case["family"] == "GPT in a cell" and case["tp"] != "off":
        plan["tp_plan"] = "CELL_TP_PLAN"  # replaced by the plan on the rank
    mesh = mesh_of(case)
    assert mesh is not None
    return mesh, plan, compare_of(case)


def cases_of(family: str) -> list[tuple[Case, str | None]]:
    """The family's cases, then the refused pairs it shows: (case, the refusal expected)."""
    runs: list[tuple[Case, str | None]] = [(c, None) for c in CASES if c["family"] == family]
    for _, (case, said) in sorted(REFUSED.items(), key=repr):
        if case["family"] == family:
            runs.append((case, said))
    return runs


RESULTS: dict[str, list[tuple[Case, tuple[Any, ...]]]] = {}


KNOWN = {
    # Found 2026-11-30 on a new machine of this kind, and at the commit CI passed on the last
    # one (8bcf2be): one process and the layout agree on the losses to 2.1e-12 but AdamW
    # leaves this expert weight 5.2e-8 apart, above float64's 1e-8. Open (the session's note
    # says so): not yet known whether reduction order amplified by AdamW on near-zero expert
    # gradients, or a fault of TP + 1F1B + full recomputation on OLMoE's fused experts.
    repr({"family": "OLMoE", "tp": "tp", "pp": "1f1b", "ac": "full", "optimizer": "adamw"}):
        "model.layers.0.mlp.experts.gate_up_proj",
}
"""Cases known to part from one process on some machines, by what the test shows of them:
the parameter they part at. Such a case parting elsewhere, or failing, fails the test; the
guide's matrix shows it as parting wherever it ran."""


def overflowed(verdict: tuple[Any, ...]) -> bool:
    """fp16's loss scaler skipped a step on overflow and trained the others: fp16 ran (only
    fp16 gradients overflow), however closely its losses then agree with one process's (a
    run of two trained steps agreed to 5.7e-8 on Qwen3, on this kind of machine)."""
    found = [re.match(r"fp16 loss scaling: (\d+) of (\d+) steps skipped", n)
             for n in verdict[5]]
    return any(m is not None and 0 < int(m[1]) < int(m[2]) for m in found)


@pytest.mark.cluster
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_pair_of_options_matches_one_process_or_is_refused_naming_it(
        cluster: Cluster, family: str) -> None:
    runs = cases_of(family)
    setup = (f"{FAMILIES_SOURCE}\nFAMILY = {family!r}\n"
             f"RUNS = {[runnable(c) for c, _ in runs]!r}\n").replace(
                 "'tp_plan': 'CELL_TP_PLAN'", "'tp_plan': CELL_TP_PLAN")
    result = cluster.run(setup + CELL, keep_values=True, timeout=240)
    verdicts = result.values[0]
    RESULTS[family] = [(c, v) for (c, _), v in zip(runs, verdicts, strict=True)]
    faults = []
    for (case, expected), verdict in zip(runs, verdicts, strict=True):
        shown = shown_of(case)
        if expected is not None:
            pair = [(f, level) for f, level in shown.items() if f != "family"]
            named = any(mentions(verdict[1], f, level) for f, level in pair) if pair else True
            if verdict[0] != "refused" or not named:
                faults.append(f"{shown}: expected a refusal like {expected[:90]!r}, got "
                              f"{verdict}")
        elif repr(shown) in KNOWN:  # parting elsewhere, or failing, is a fault
            # it parts on some machines of this kind and matches on others (2026-12-01:
            # 2.1e-16 apart): either, but nothing else
            if verdict[0] != "ok" and (verdict[0] != "DIFFERS"
                                       or verdict[3] != KNOWN[repr(shown)]):
                faults.append(f"{shown} was known to differ at {KNOWN[repr(shown)]}; now "
                              f"{verdict}")
        elif verdict[0] != "ok":
            faults.append(f"{shown}: {verdict}")
        elif case["precision"] != "fp64" and verdict[1] < 1e-7 and not overflowed(verdict):
            faults.append(f"{shown}: losses agree to {verdict[1]:.1e}: "
                          f"{case['precision']} did not run ({verdict[5]})")
    for rank, theirs in result.values.items():  # every rank reaches the same verdicts
        if [v[0] for v in theirs] != [v[0] for v in verdicts]:
            faults.append(f"rank {rank} disagrees: {theirs}")
    assert not faults, f"{family}:\n" + "\n".join(faults)


MATRIX_PAGE = Path(__file__).parents[2] / "docs" / "guides" / "combinations.md"
START, END = "<!-- model matrix: written by tests/rank/test_model_matrix.py -->", "<!-- end -->"
COLUMNS = [(f, level) for f, levels in OPTIONS.items() for level in levels[1:]]


def shown_of(case: Case) -> dict[str, Any]:
    """The case as the test names it: its family and the options it does not leave at
    their first level."""
    return {k: v for k, v in case.items() if k == "family" or v != OPTIONS[k][0]}


def table(results: Mapping[str, list[tuple[Case, tuple[Any, ...]]]]) -> str:
    """Family by option: every case of that family with that option matched one process
    (✓), or it is refused (a numbered reason)."""
    notes: dict[str, int] = {}

    def cell(family: str, factor: str, level: Any) -> str:
        mine = [v for c, v in results[family] if c[factor] == level]
        refused = [v[1] for v in mine if v[0] == "refused"]
        if mine and len(refused) == len(mine):  # the reason most of them give
            reason = max(sorted(set(refused)), key=refused.count)
            reason = re.sub(r"(pp|cp|ep|tp)=\d+", r"\1=N", reason)
            reason = re.sub(r"not yet to \w+", "not yet to this model", reason)
            return f"refused ({notes.setdefault(reason, len(notes) + 1)})"
        ran = [(c, v) for c, v in results[family] if c[factor] == level and v[0] != "refused"]
        if not ran:
            return "·"
        # a case KNOWN to part on some machines shows as parting on every one
        return (f"✓{len(ran)}" if all(v[0] == "ok" and repr(shown_of(c)) not in KNOWN
                                      for c, v in ran) else "✗")

    lines = ["| family | " + " | ".join(f"{f}={level}" for f, level in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for family in results:
        lines.append(f"| {family} | " + " | ".join(cell(family, f, level)
                                                   for f, level in COLUMNS) + " |")
    lines.append("")
    lines.append(f"{len(CASES)} cases cover every pair of options that can run together "
                 f"({len(REFUSED)} pairs cannot: each is refused, naming it). ✓n: n cases "
                 "with that option on that family matched one process (float64 losses and "
                 "parameters within the tolerance meshlab.verify.compare derives; bf16 and "
                 "fp16 against the same recipe in one process, with SGD); · none "
                 "generated.  ")
    lines += [f"({n}) {reason}  " for reason, n in notes.items()]
    return "\n".join(lines)


@pytest.mark.cluster
def test_the_guide_shows_the_matrix_as_the_test_found_it() -> None:
    if set(RESULTS) != set(FAMILY_NAMES):
        pytest.skip("the matrix test did not run for every family in this session")
    text = MATRIX_PAGE.read_text()
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    written = f"{START}\n{table(RESULTS)}\n{END}"
    if os.environ.get("MESHLAB_WRITE_MATRIX"):
        MATRIX_PAGE.write_text(before + written + after)
    assert START + rest.split(END, 1)[0] + END == written, (
        "the model matrix in docs/guides/combinations.md differs from what the test found: "
        "rerun with MESHLAB_WRITE_MATRIX=1 to write it\n" + table(RESULTS))


def test_every_pair_is_run_or_refused() -> None:
    from tests.rank.pairwise import pairs_of

    names = ["family", *OPTIONS]
    covered = set().union(*(pairs_of(c, names) for c in CASES))
    every = pairs_of({f: None for f in names}, names)
    assert len(every) == len(names) * (len(names) - 1) // 2
    total = sum(len(OPTIONS.get(a, FAMILY_NAMES)) * len(OPTIONS.get(b, FAMILY_NAMES))
                for (a, _), (b, _) in every)
    assert len(covered) + len(REFUSED) == total and not covered & set(REFUSED)
