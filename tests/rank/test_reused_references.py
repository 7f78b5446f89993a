"""One reference for many comparisons (meshlab.verify.reused_references): reused only where
the one-process run would be the same, and then with the same verdicts and numbers exactly.

The loss is counted: every one-process step calls it, so a reference trained again shows
in the count, and a reused one does not."""

from __future__ import annotations

import ast

import pytest

from meshlab import Cluster

pytestmark = pytest.mark.cluster

CELL = '''
from meshlab.models import ModelConfig, Transformer
from meshlab.parallel import ParallelPlan
from meshlab.verify.reused_references import reusing_references
from meshlab.verify.compare import compare_with_single_process, next_token_loss
import meshlab.mesh

calls = [0]
def counted(model, batch):
    calls[0] += 1
    return next_token_loss(model, batch)

TINY = ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=64, vocab_size=128)
SCALE = [1.0]
def scaled():  # reads a global: the same factory builds another model once it changes
    model = Transformer(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(SCALE[0])
    return model

def compare(model, mesh, **plan):
    before = calls[0]
    r = compare_with_single_process(model, meshlab.mesh.build(mesh), ParallelPlan(**plan),
                                    steps=2, dtype=torch.float64, loss=counted)
    return (r.ok, r.losses, r.reference_losses, r.max_loss_error, r.max_param_error,
            r.loss_rtol, r.param_rtol, r.notes), calls[0] - before

def compare_fp16(dp):
    before = calls[0]
    r = compare_with_single_process(TINY, meshlab.mesh.build("dp=4"),
                                    ParallelPlan(data_parallel=dp, mixed_precision="fp16"),
                                    steps=2, dtype=torch.float32, optimizer="sgd", loss=counted)
    return r.ok, calls[0] - before

alone = {
    "zero3": compare(TINY, "dp=4", data_parallel="zero3"),
    "ddp": compare(TINY, "dp=4", data_parallel="ddp"),
    "tp": compare(TINY, "dp=2 tp=2", data_parallel="zero2", offload_activations=True),
    "clip": compare(TINY, "dp=4", data_parallel="ddp", max_grad_norm=0.5),
    "local_sgd": compare(TINY, "dp_replicate=2 dp=2", replica_sync="local_sgd", sync_every=2),
}
with reusing_references():
    reused = {
        "zero3": compare(TINY, "dp=4", data_parallel="zero3"),
        "ddp": compare(TINY, "dp=4", data_parallel="ddp"),
        "tp": compare(TINY, "dp=2 tp=2", data_parallel="zero2", offload_activations=True),
        "tp+sp": compare(TINY, "dp=2 tp=2", data_parallel="zero2", sequence_parallel=True),
        "clip": compare(TINY, "dp=4", data_parallel="ddp", max_grad_norm=0.5),
        "local_sgd": compare(TINY, "dp_replicate=2 dp=2", replica_sync="local_sgd",
                             sync_every=2),
        "local_sgd again": compare(TINY, "dp_replicate=2 dp=2", data_parallel="ddp",
                                   replica_sync="local_sgd", sync_every=2),
    }
    # mixed precision's one-process recipe follows the data parallelism (FSDP2 casts the
    # parameters, DDP autocasts): ZeRO-2 reuses ZeRO-3's, DDP trains its own
    recipes = {dp: compare_fp16(dp) for dp in ("zero3", "ddp", "zero2")}
    changed = [compare(scaled, "dp=4", data_parallel="zero3")]
    SCALE[0] = 0.5
    changed.append(compare(scaled, "dp=4", data_parallel="ddp"))
(alone, reused, changed, recipes)
'''


def test_a_reference_is_reused_only_where_one_process_would_train_the_same(
        cluster: Cluster) -> None:
    out = cluster.run(CELL, timeout=300).outputs
    runs = {rank: ast.literal_eval(o.result) for rank, o in out.items()}
    alone, reused, changed, recipes = runs[0]
    # the same verdicts and numbers, reused or not
    for case, (result, _) in alone.items():
        assert reused[case][0] == result, case
    assert all(alone[case][0][0] for case in alone), alone
    calls = {case: n for case, (_, n) in reused.items()}
    # trained: the first of its kind, and where a setting the reference reads differs
    # (clipping, the replicas' sync, the data ranks' chunks its floor accumulates); reused:
    # where only the parallel layout differs
    for case in ("zero3", "clip", "local_sgd", "tp"):
        assert calls[case] == alone[case][1], case
    for case, like in (("ddp", "ddp"), ("tp+sp", "tp"), ("local_sgd again", "local_sgd")):
        assert calls[case] < alone[like][1], (case, calls[case], alone[like][1])
    assert all(ok for ok, _ in recipes.values()), recipes
    assert recipes["ddp"][1] == recipes["zero3"][1] > recipes["zero2"][1], recipes
    # the same factory building another model is trained again, and matches
    (first, n_first), (second, n_second) = changed
    assert first[0] and second[0], changed
    assert n_second == n_first
    assert second[2] != first[2]  # another reference, not the stored one
    assert {str(r) for r in runs.values()} == {str(runs[0])}, "ranks disagree"
