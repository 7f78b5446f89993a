"""The sharding widget merges only true replicas: reports from the real rank side on the
shared cluster, drawn by blocks()/tensor_state(). Pipeline stages, expert slices and plain
tensors are drawn per holder; the ranks of one DTensor that hold the same piece share one
block, labelled "replicated"."""

from __future__ import annotations

from typing import Any

import pytest

from meshlab.measure.sharding import RankShard, ShardingReport, merge
from meshlab.notebook.widgets.sharding import render_html
from meshlab.notebook.widgets.sharding_layout import blocks, tensor_state, text_form

# pp=2 x dp=2: stage 0 on ranks 0-1, stage 1 on ranks 2-3, each sharded by FSDP over dp
STAGES = """
from meshlab.models import ModelConfig, Transformer
from meshlab.parallel import ParallelPlan, parallelize
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
stage = parallelize(Transformer(ModelConfig(dim=16, n_heads=2, n_kv_heads=1, ffn_hidden=8,
                                            vocab_size=32, max_seq_len=8)),
                    mesh, ParallelPlan(data_parallel="zero3", pipeline_schedule="1f1b"))
mine = torch.full((2, 3), float(rank))
everywhere = distribute_tensor(torch.ones(4, 6), mesh, [Replicate(), Replicate()])
halves = distribute_tensor(torch.ones(4, 6), mesh, [Replicate(), Shard(1)])
"""

# dp=4 ep=4: each rank keeps one of the 4 experts of every MoE layer
EXPERTS = """
from meshlab.models import ModelConfig, Transformer
from meshlab.parallel import ParallelPlan, parallelize
moe_model = parallelize(Transformer(ModelConfig(dim=16, n_heads=2, n_kv_heads=1, ffn_hidden=8,
                                                vocab_size=32, max_seq_len=8, n_experts=4,
                                                n_layers=1)),
                        mesh, ParallelPlan(data_parallel="none"))
moe = moe_model.layers["0"].feed_forward
"""


@pytest.fixture(scope="module")
def held(module_cluster: Any) -> dict[str, Any]:
    """Every report the tests draw, from two meshes built once."""
    cluster = module_cluster
    cluster.init_mesh("pp=2 dp=2")
    cluster.run(STAGES)
    reports = {name: cluster.inspect(expr) for name, expr in [
        ("first_layer", "stage.layers[list(stage.layers)[0]].feed_forward.w1.weight"),
        ("stage", "stage"), ("mine", "mine"), ("everywhere", "everywhere"),
        ("halves", "halves")]}
    cluster.init_mesh("dp=4 ep=4")
    cluster.run(EXPERTS)
    reports["experts"] = cluster.inspect("moe.w1")
    return reports


def own(rank: int, fqn: str, mesh_ranks: list[int], offsets: tuple[int, int] = (0, 0),
        kind: str = "dtensor") -> ShardingReport:
    """What one rank reports of a [4, 4] tensor it holds whole (plain data, no ranks)."""
    return ShardingReport(
        name="w", kind=kind, global_shape=[4, 4], dtype="float32",
        mesh_shape=[len(mesh_ranks)] if mesh_ranks else [], mesh_axes=["dp"] if mesh_ranks else [],
        placements=["Replicate()"] if mesh_ranks else [], fqn=fqn, mesh_ranks=mesh_ranks,
        shards=[RankShard(rank=rank, coordinate=[mesh_ranks.index(rank)] if mesh_ranks else [],
                          local_shape=[4, 4], offsets=list(offsets), bytes=64)])


def test_merge_keeps_one_report_for_the_ranks_of_one_dtensor() -> None:
    merged = merge({r: own(r, "layers.0.w", [0, 1, 2, 3]) for r in range(4)})
    assert merged.parts == [] and [s.rank for s in merged.shards] == [0, 1, 2, 3]
    (block,) = blocks(merged)
    assert block["ranks"] == [0, 1, 2, 3] and block["replicated"]


def test_merge_keeps_other_names_and_other_meshes_apart() -> None:
    stages = merge({0: own(0, "layers.0.w", [0, 1]), 1: own(1, "layers.0.w", [0, 1]),
                    2: own(2, "layers.2.w", [2, 3]), 3: own(3, "layers.2.w", [2, 3])})
    assert [[s.rank for s in p.shards] for p in stages.distinct()] == [[0, 1], [2, 3]]
    # one name, two meshes: a tp-only DTensor in each data-parallel group
    groups = merge({0: own(0, "w", [0, 1]), 1: own(1, "w", [0, 1]),
                    2: own(2, "w", [2, 3]), 3: own(3, "w", [2, 3])})
    assert [b["ranks"] for b in blocks(groups)] == [[0, 1], [2, 3]]
    assert [b["part"] for b in blocks(groups)] == [0, 1]


def test_merge_never_takes_plain_tensors_for_replicas() -> None:
    merged = merge({r: own(r, "w", [], kind="tensor") for r in range(3)})
    assert [b["ranks"] for b in blocks(merged)] == [[0], [1], [2]]
    assert not any(b["replicated"] for b in blocks(merged))


def holders(drawn: list[dict[str, Any]]) -> list[list[int]]:
    """The ranks of each block, in order."""
    return [b["ranks"] for b in drawn]


@pytest.mark.cluster
def test_two_pipeline_stages_first_layers_are_not_merged(held: dict[str, Any]) -> None:
    report = held["first_layer"]
    parts = report.distinct()
    assert [p.fqn for p in parts] == ["layers.0.feed_forward.w1.weight",
                                      "layers.1.feed_forward.w1.weight"]
    assert [p.mesh_ranks for p in parts] == [[0, 1], [2, 3]]
    drawn = blocks(report)
    assert holders(drawn) == [[0], [1], [2], [3]]  # FSDP rows, never "[ranks 0,2]"
    assert [b["part"] for b in drawn] == [0, 0, 1, 1] and not any(b["replicated"] for b in drawn)
    state = tensor_state(report)
    assert [(p["holder"], p["holds"].split(" ")[0]) for p in state["parts"]] == [
        ("ranks 0-1 (pp 0)", "layers.0.feed_forward.w1.weight"),
        ("ranks 2-3 (pp 1)", "layers.1.feed_forward.w1.weight")]
    assert "2 different tensors, drawn per holder" in text_form(state)


@pytest.mark.cluster
def test_a_stage_module_lists_only_what_each_stage_holds(held: dict[str, Any]) -> None:
    rows = {t.name: sorted(t.bytes_per_rank()) for t in held["stage"].tensors}
    assert rows["tok_embeddings.weight"] == [0, 1] and rows["output.weight"] == [2, 3]
    assert rows["layers.0.attention.wq.weight"] == [0, 1]
    assert rows["layers.1.attention.wq.weight"] == [2, 3]


@pytest.mark.cluster
def test_each_expert_parallel_rank_is_drawn_with_the_experts_it_holds(
        held: dict[str, Any]) -> None:
    report = held["experts"]
    assert [(p.fqn, p.experts, p.n_experts) for p in report.distinct()] == [
        ("layers.0.feed_forward.w1", [r], 4) for r in range(4)]
    drawn = blocks(report)
    assert holders(drawn) == [[0], [1], [2], [3]]
    assert [b["part"] for b in drawn] == [0, 1, 2, 3]
    state = tensor_state(report)
    assert [p["holder"] for p in state["parts"]] == [f"rank {r} (dp_shard {r}, ep {r})"
                                                     for r in range(4)]
    assert state["parts"][2]["holds"].endswith("local tensor of rank 2 · experts 2 of 4")


@pytest.mark.cluster
def test_a_plain_tensor_is_drawn_once_per_rank_that_holds_it(held: dict[str, Any]) -> None:
    report = held["mine"]
    assert report.kind == "tensor" and len(report.distinct()) == 4
    drawn = blocks(report)
    assert holders(drawn) == [[0], [1], [2], [3]] and not any(b["replicated"] for b in drawn)
    state = tensor_state(report)
    assert state["parts"][3]["holder"] == "rank 3 (pp 1, dp_shard 1)"
    assert "a plain tensor is its rank's own, never a replica" in text_form(state)
    html = render_html(state, [], {})
    assert html.count("class='meshlab-part'") == 4 and "rank 3 (pp 1, dp_shard 1)" in html


@pytest.mark.cluster
def test_replicas_of_one_dtensor_are_one_block_labelled_replicated(
        held: dict[str, Any]) -> None:
    (block,) = blocks(held["everywhere"])
    assert block["ranks"] == [0, 1, 2, 3] and block["replicated"]
    assert [line["text"] for line in block["lines"]] == ["[ranks 0-3]", "rows 0-3 · cols 0-5",
                                                         "replicated"]
    assert len(block["band"]) == 4  # each holder's colour along the top edge
    halves = blocks(held["halves"])  # Replicate() over pp, Shard(1) over dp
    assert [(b["c0"], b["c1"], b["ranks"], b["replicated"]) for b in halves] == [
        (0, 3, [0, 2], True), (3, 6, [1, 3], True)]
    assert "rows 0-3 · cols 0-2: ranks 0,2 · local [4, 3], 48 B each · replicated" in \
        text_form(tensor_state(held["halves"]))
