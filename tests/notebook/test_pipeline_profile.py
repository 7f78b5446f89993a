"""`%mesh step --profile`: every rank's trace of the stepped slots in one file, each pipeline
action a named span; a whole profiled step's bubble and exposed communication beside the
schedule simulator's."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from IPython.utils.capture import capture_output

from meshlab import Cluster
from meshlab.notebook.pipeline_bubbles import compare_bubbles
from meshlab.notebook.stepping import SteppedPipeline
from meshlab.schedules import Costs, Schedule, build

SETUP = """%%mesh
from meshlab.models import ModelConfig, Transformer, global_batch
cfg = ModelConfig(n_layers=4)
model = Transformer(cfg).double()
batch = global_batch(step=0, batch=8, seq=16, vocab=cfg.vocab_size)
"""

COMPARED = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)]


def ideal_records(schedule: Schedule, costs: Costs) -> list[dict[str, Any]]:
    """What an executor records if every action takes exactly what ``costs`` say: each rank
    reaches an action when its previous one ends and waits there for its input."""
    records: list[dict[str, Any]] = []
    free: dict[int, float] = {}
    for t in sorted(schedule.simulate(costs).timed, key=lambda t: t.start):
        ready = free.get(t.rank, 0.0)
        records.append({"rank": t.rank, "global_rank": t.rank, "stage": t.action.stage,
                        "kind": t.action.kind, "microbatch": t.action.microbatch,
                        "action": str(t.action), "begin_ns": round(ready * 1e6),
                        "wait": (t.start - ready) / 1e3, "end_ns": round(t.end * 1e6)})
        free[t.rank] = t.end
    return records


@pytest.mark.parametrize("name, virtual", [*COMPARED, ("zb_h1", 1)])
def test_an_ideal_steps_measured_bubble_is_the_simulators(name: str, virtual: int) -> None:
    schedule = build(name, ranks=4, microbatches=8, virtual=virtual)
    costs = Costs(forward=1, backward_input=1, backward_weight=1, comm=0.25) \
        if name == "zb_h1" else Costs(forward=1, backward=2, comm=0.25)
    table = compare_bubbles(ideal_records(schedule, costs), schedule, {})
    timeline = schedule.simulate(costs)
    total = table.loc["total"]
    assert total["bubble ratio"] == pytest.approx(1) and total["exposed ratio"] == pytest.approx(1)
    assert total["exposed comm"] > 0  # the hops were measured, and some were exposed
    # busy, bubble and exposed communication fill every rank's whole step
    idle = (total["bubble"] + total["exposed comm"]) / (schedule.ranks * timeline.makespan)
    assert idle == pytest.approx(timeline.bubble_fraction)
    assert table.attrs["costs"].comm == pytest.approx(0.25)


@pytest.mark.cluster
def test_profiled_step_writes_one_trace_of_every_rank_with_each_action_named(
        shell: Any, tmp_path: Path) -> None:
    shell.run_line_magic("mesh", "init pp=2 dp=2")
    assert shell.run_cell(SETUP).success
    with capture_output():
        shell.run_line_magic("mesh", "pipeline model --schedule 1f1b --microbatches 4")
    with capture_output() as cap:
        shell.run_line_magic("mesh", f"step 3 --profile-dir {tmp_path}")
    [path] = tmp_path.glob("step-*.json")
    assert f"wrote {path}" in cap.stdout
    events = json.loads(path.read_text())["traceEvents"]
    named = {(e["pid"], e["name"]) for e in events if e.get("ph") == "X"}
    # slots 0-2 of 1F1B on 2 pp ranks (global ranks 0-1 are pp rank 0 of two pipelines)
    for rank in range(4):
        pp = rank // 2
        assert {(rank, "0F0"), (rank, "0SEND_F0"), (rank, "0F1")} <= named if pp == 0 else \
            {(rank, "1RECV_F0"), (rank, "1F0"), (rank, "1B0"), (rank, "wait for input")} <= named
    with capture_output() as cap:  # the rest, profiled apart: no whole step to compare
        shell.run_line_magic("mesh", "step --all --profile")
    assert "step complete" in cap.stdout and not _compared(cap.outputs)
    with capture_output():
        shell.run_line_magic("mesh", "pipeline model --schedule 1f1b --microbatches 4")
    with capture_output() as cap:
        shell.run_line_magic("mesh", "step --all --profile")
    assert _compared(cap.outputs)
    # the chart re-simulates the step with the costs the table's caption states (one source)
    shown = " ".join(str(o.data) for o in cap.outputs)
    in_chart = re.findall(r"simulated with measured costs: (F [\d.]+, B [\d.]+) ms, hop "
                          r"([\d.]+) ms", shown)
    in_table = re.findall(r"simulated with the measured costs \((F [\d.]+, B [\d.]+) ms, hop "
                          r"([\d.]+) ms\)", shown)
    assert in_chart and in_table and set(in_chart) == set(in_table), (in_chart, in_table)


def _compared(outputs: list[Any]) -> bool:
    return any("simulated with the measured costs" in str(o.data) for o in outputs)


@pytest.mark.cluster
@pytest.mark.parametrize("name, virtual", COMPARED)
def test_a_whole_profiled_step_agrees_with_the_simulator_replaying_it(
        cluster: Cluster, name: str, virtual: int) -> None:
    spec = cluster.init_mesh("pp=2 dp=2")
    cluster.run(SETUP.removeprefix("%%mesh\n"))
    schedule = build(name, ranks=spec.pp, microbatches=4, virtual=virtual)
    pipeline = SteppedPipeline(cluster, schedule, model="model")
    pipeline.step(None, profile=True)
    table = pipeline.bubble_table()
    total, replayed = table.loc["total"], table.attrs["replayed"]
    print(f"{name}: measured bubble {total['bubble']:.2f} exposed {total['exposed comm']:.2f}; "
          f"replayed {replayed['bubble']:.2f} {replayed['exposed comm']:.2f}; with the "
          f"median costs {total['bubble simulated']:.2f} {total['exposed comm simulated']:.2f}")
    assert replayed["bubble"] == pytest.approx(total["bubble"], rel=0.1)
    assert replayed["exposed comm"] == pytest.approx(total["exposed comm"], rel=0.1, abs=0.05)
    assert replayed["makespan"] == pytest.approx(table.attrs["makespan"], rel=0.1)
    window = table.attrs["makespan"] * spec.pp
    assert total["busy"] + total["bubble"] + total["exposed comm"] == pytest.approx(window)
