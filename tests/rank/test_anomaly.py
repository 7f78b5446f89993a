"""A non-finite or jumping loss re-run from the state before its step (meshlab.verify.anomaly)
on real ranks under TP+SP: a transient fault on one rank is re-run by every rank and training
goes on exactly as a run without it; a fault that repeats stops before the optimizer steps,
naming the module that made the first non-finite value and its rank."""

from __future__ import annotations

import pytest

from meshlab.notebook.cluster import Cluster

pytestmark = pytest.mark.cluster

CELL = """
import torch, meshlab.mesh
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.anomaly import AnomalyError, RerunOnAnomaly
from meshlab.verify.compare import data_rank, train
from meshlab.verify.comparison import full_parameters

mesh = meshlab.mesh.build("dp=2 tp=2")
cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64)
dp_rank, dp_ranks = data_rank(mesh)
batches = [local_batch(step=s, batch=8, seq=16, vocab=64, rank=dp_rank, ranks=dp_ranks)
           for s in range(5)]

def run(fault=None, steps=5, where="layers.1.feed_forward", **guard):
    torch.manual_seed(0)
    model = parallelize(Transformer(cfg), mesh, ParallelPlan())
    optimizer = build_optimizer(model, mesh, ParallelPlan(), lr=1e-2)
    if fault:
        model.get_submodule(where).register_forward_hook(fault)
    on = RerunOnAnomaly(**guard)
    try:
        losses = train(model, optimizer, batches[:steps], average_over=mesh["dp"].get_group(),
                       on_anomaly=on)
    except AnomalyError as e:
        losses = str(e)
    return losses, [str(a) for a in on.anomalies], full_parameters(model)

forwards = {{"n": 0}}
def counted(kind, call, only):  # a fault on one rank, at one forward (or every one from it)
    def hook(module, args, out):
        forwards["n"] += 1
        hit = forwards["n"] == call or (kind == "every" and forwards["n"] >= call)
        return out * float("nan") if hit and rank == only else out
    return hook

def spiked(module, args, out):  # step 3's logits scaled up on rank 1: the loss jumps, once
    forwards["n"] += 1
    return out * 30.0 if forwards["n"] == 4 and rank == 1 else out

clean, _, clean_params = run()
before_step_3 = run(steps=3)[2]
forwards["n"] = 0
transient = run(counted("once", 3, only=2))  # step 2's first forward on rank 2
forwards["n"] = 0
repeating = run(counted("every", 4, only=1))  # from step 3 on, on rank 1
forwards["n"] = 0
spike = run(spiked, where="output", spike=3.0)
same = lambda a, b: all(torch.equal(a[n], b[n]) for n in a)
(clean, transient[:2], same(transient[2], clean_params), repeating[:2],
 same(repeating[2], before_step_3), spike[:2], same(spike[2], clean_params))
"""


def test_a_transient_fault_is_re_run_and_one_that_repeats_stops_before_the_step(
        cluster: Cluster) -> None:
    (clean, (losses, said), same, (stopped, said_repeating), kept, (spiked, said_spike),
     same_after_spike) = cluster.run(CELL.format(), keep_values=True, timeout=240).values[0]
    # a NaN on rank 2 at step 2: every rank re-ran it, and training went on as without it
    assert losses == clean and same, (losses, clean)
    (only,) = said
    assert only.startswith("step 2: rank 2's loss nan (non-finite); re-run from the state "
                           "before it: ")
    assert "it does not repeat: a transient fault" in only
    assert "no module made a non-finite value" in only
    # NaN from step 3 on, on rank 1: it repeats, and nothing stepped
    # rank 1's NaN reaches its tp peer's loss too: the report gives the lowest such rank
    assert isinstance(stopped, str) and stopped.startswith(
        "step 3: rank 0's loss nan (non-finite)")
    assert "it repeats" in stopped
    assert "first non-finite value: forward of layers.1.feed_forward (rank 1)" in stopped
    assert stopped.endswith("the model holds the state before step 3") and kept
    assert len(said_repeating) == 1
    # a jump on rank 1's rows at step 3: re-run, and the run is the clean one
    assert spiked == clean and same_after_spike
    (jump,) = said_spike
    assert jump.startswith("step 3: rank 1's loss ") and "(a jump: " in jump, jump
    assert "does not repeat" in jump
