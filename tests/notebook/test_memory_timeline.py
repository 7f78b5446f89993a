"""%%mesh --memory: every rank's memory over a cell (torch's MemTracker), held to what
`%mesh memory` measures; the snapshot memory_viz reads; a rank that runs out of memory."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from meshlab.notebook.memory_snapshots import ran_out
from meshlab.notebook.output import MeshError
from meshlab.notebook.session import Session

SETUP = """
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, parallelize, build_optimizer
plan = ParallelPlan(data_parallel="zero3")
model = parallelize(Transformer(ModelConfig()), mesh, plan)
opt = build_optimizer(model, mesh, plan)
inputs, targets = local_batch(step=0, batch=8, seq=16, vocab=256, rank=rank, ranks=4)
"""
STEP = """
logits = model(inputs)
loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
del logits
loss.backward()
opt.step()
"""


def test_a_zero3_steps_memory_ends_at_what_mesh_memory_measures(session: Session,
                                                                  tmp_path: Path) -> None:
    from torch.cuda._memory_viz import trace

    from meshlab.notebook.charts import memory_timeline_chart
    from meshlab.notebook.charts.memory_timeline import peak_text

    session.init("dp=4")
    session.run(SETUP)
    result = session.run(STEP, memory_dir=tmp_path / "snapshots")
    measured = session.memory("model", "opt")
    assert sorted(result.memory) == [0, 1, 2, 3]
    for r, timeline in result.memory.items():
        end = timeline.points[-1].bytes
        row = measured.loc[str(r)] if str(r) in measured.index else measured.loc[r]
        # the step's last moment holds what %mesh memory counts, byte for byte (CPU tensors
        # take their exact size), in the same three parts
        assert (end["parameters"], end["gradients"], end["optimizer states"]) == (
            row["params"], row["grads"], row["optimizer"]), r
        peak = timeline.peak
        assert peak is not None and sum(peak.bytes.values()) >= sum(end.values())
        assert peak.bytes["activations"] + peak.bytes["temporaries"] > 0
        assert peak_text(peak).startswith(("forward of ", "backward of ", "the optimizer"))
        phases = {p.phase for p in timeline.points}
        assert {"forward", "backward", "optimizer"} <= phases
        # the snapshot torch's own reader takes, its allocations and frees summing to the end
        snapshot = pickle.loads((tmp_path / "snapshots" / f"rank{r}.pickle").read_bytes())
        events = snapshot["device_traces"][0]
        held = sum(e["size"] for e in events if e["action"] == "alloc") - sum(
            e["size"] for e in events if e["action"] == "free_completed")
        assert held == sum(end.values())
        assert f"\n{len(events)} entries\n" in trace(snapshot)  # torch's reader takes it
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == [
        f"rank{r}.pickle" for r in range(4)]
    spec = memory_timeline_chart(result.memory).spec()
    assert [panel["title"]["text"] for panel in spec["vconcat"]] == [
        f"rank {r}" for r in range(4)]


def test_a_rank_that_runs_out_of_memory_leaves_its_snapshot_and_says_where(
        session: Session) -> None:
    cell = """
import resource
used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
limit = resource.getrlimit(resource.RLIMIT_AS)
x = torch.ones(1000)
if rank == 2:
    resource.setrlimit(resource.RLIMIT_AS, (used + 2**28, limit[1]))
    try:
        big = torch.empty(2**32)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)
"""
    with pytest.raises(MeshError) as info:
        session.run(cell, on_oom=True)
    result = info.value.result
    assert ran_out(result) == [2]
    assert "can't allocate memory" in result.outputs[2].error.evalue
    text = str(info.value)
    assert "rank 2 ran out of memory: its snapshot is " in text and "rank2.pickle" in text
    # the tracker's frames in every op do not make it a process-group failure
    assert "process group failed" not in text and "mem_tracker" not in text
    path = Path(text.split("its snapshot is ", 1)[1].split(" ", 1)[0])
    assert pickle.loads(path.read_bytes())["device_traces"][0]  # x's allocation at least
    assert result.memory[2].points[-1].bytes["activations"] >= 4000
    # not out of memory: nothing written, nothing said
    with pytest.raises(MeshError) as info:
        session.run("if rank == 1:\n    raise ValueError('no')", on_oom=True)
    assert "ran out of memory" not in str(info.value)


def test_a_cell_that_allocates_nothing_shows_what_it_holds_flat(session: Session) -> None:
    from meshlab.notebook.charts.memory_timeline import peak_text

    session.run("import torch.nn as nn\nheld = nn.Linear(8, 8)")
    result = session.run("a = 1 + 1", memory=True)
    for timeline in result.memory.values():
        assert {tuple(p.bytes.values()) for p in timeline.points} == {
            tuple(timeline.points[0].bytes.values())}
        assert timeline.points[0].bytes["parameters"] >= (8 * 8 + 8) * 4  # held's, at least
        assert peak_text(timeline.peak) == "between modules"
