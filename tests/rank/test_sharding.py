"""Sharding reports: checked against torch's own local-shape/offset computation."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from meshlab.measure.sharding import describe, local_shape_and_offsets


def torch_says(shape: list[int], mesh: list[int], coord: list[int],
               placements: list) -> tuple[list[int], list[int]]:
    local, offsets = _compute_local_shape_and_global_offset(shape, mesh, coord, placements)
    return list(local), list(offsets)


def every_coordinate(mesh: list[int]) -> list[list[int]]:
    return [list(c) for c in itertools.product(*[range(n) for n in mesh])]


@pytest.mark.parametrize("shape, mesh, placements", [
    ([10, 4], [4], [Shard(0)]),  # uneven: 3, 3, 3, 1
    ([5, 3], [4], [Shard(0)]),  # the last rank gets nothing
    ([8, 6], [2, 2], [Shard(0), Shard(1)]),
    ([10, 6], [2, 2], [Shard(0), Shard(0)]),  # nested split of one dim
    ([7, 5], [2, 3], [Shard(1), Shard(0)]),
    ([8, 8], [2, 2], [Replicate(), Shard(1)]),
    ([8, 8], [2, 2], [Partial(), Shard(0)]),
    ([3, 4, 5], [2, 2], [Shard(2), Shard(1)]),
    ([4, 2], [2, 2], [Shard(1), Shard(1)]),  # found by hypothesis: an empty nested piece
])
def test_known_layouts_match_torch(shape: list[int], mesh: list[int], placements: list) -> None:
    for coord in every_coordinate(mesh):
        assert local_shape_and_offsets(shape, mesh, coord, placements) == \
            torch_says(shape, mesh, coord, placements), coord


placement = st.one_of(st.builds(Shard, st.integers(0, 2)), st.just(Replicate()),
                      st.just(Partial()))


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(0, 13), min_size=3, max_size=3),
       mesh=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data())
def test_any_layout_matches_torch(shape: list[int], mesh: list[int], data: st.DataObject) -> None:
    placements = data.draw(st.lists(placement, min_size=len(mesh), max_size=len(mesh)))
    for coord in every_coordinate(mesh):
        assert local_shape_and_offsets(shape, mesh, coord, placements) == \
            torch_says(shape, mesh, coord, placements)


def test_plain_tensor_is_held_whole_by_its_rank() -> None:
    report = describe(torch.zeros(3, 4, dtype=torch.float16), "x")
    assert (report.kind, report.global_shape, report.dtype) == ("tensor", [3, 4], "float16")
    (shard,) = report.shards
    assert (shard.local_shape, shard.offsets, shard.bytes) == ([3, 4], [0, 0], 24)


def test_module_report_lists_parameters_and_buffers_with_totals() -> None:
    module = torch.nn.BatchNorm1d(4)
    report = describe(module)
    names = [t.name for t in report.tensors]
    assert names[:2] == ["weight", "bias"] and "running_mean" in report.buffers
    assert report.bytes_per_rank() == {0: sum(t.numel() * t.element_size()
                                              for t in [*module.parameters(), *module.buffers()])}


def test_describe_refuses_what_it_cannot_draw() -> None:
    with pytest.raises(TypeError, match="cannot describe a list"):
        describe([1, 2])


def test_strided_shard_is_said_in_words() -> None:
    # TP + FSDP2 gives torch's internal _StridedShard, printed as "_S(0, 2)"
    from torch.distributed.tensor.placement_types import _StridedShard

    from meshlab.measure.sharding import ShardingReport, _placement
    from meshlab.notebook.widgets.sharding_layout import default_dims

    text = _placement(_StridedShard(0, split_factor=2))
    assert text == "strided shard on dim 0 (FSDP over TP, split 2 ways)"
    assert "_S(" not in text
    assert _placement(Shard(1)) == "Shard(1)"
    report = ShardingReport("w", "DTensor", [4, 6, 8], "float32", [2, 2], ["dp", "tp"],
                            [text, "Shard(2)"])
    assert default_dims(report) == (0, 2)  # the strided dim counts as sharded


LAYOUTS = """
from torch.distributed.tensor import distribute_tensor, Shard, Replicate, Partial, DTensor
from torch.distributed.device_mesh import init_device_mesh
m1 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
m2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
uneven = distribute_tensor(torch.arange(40.).reshape(10, 4), m1, [Shard(0)])
grid = distribute_tensor(torch.ones(8, 6), m2, [Shard(0), Shard(1)])
nested = distribute_tensor(torch.ones(10, 6), m2, [Shard(0), Shard(0)])
mixed = distribute_tensor(torch.ones(8, 6), m2, [Replicate(), Shard(1)])
partial = DTensor.from_local(torch.ones(4, 4), m2, [Partial(), Replicate()])
on_tp = distribute_tensor(torch.ones(6, 4), m2["tp"], [Shard(0)])
cube = distribute_tensor(torch.ones(2, 6, 8), m2, [Shard(2), Shard(1)])
local = {n: list(t.to_local().shape) for n, t in [("uneven", uneven), ("grid", grid),
         ("nested", nested), ("mixed", mixed), ("partial", partial), ("on_tp", on_tp),
         ("cube", cube)]}
"""


@pytest.fixture(scope="module")
def layouts(_shared_cluster):  # type: ignore[no-untyped-def]
    _shared_cluster.run(LAYOUTS)
    return _shared_cluster.pull("local")


@pytest.mark.cluster
@pytest.mark.parametrize("name", ["uneven", "grid", "nested", "mixed", "partial", "on_tp",
                                  "cube"])
def test_every_rank_holds_what_the_report_says(cluster, layouts, name: str) -> None:  # type: ignore[no-untyped-def]
    report = cluster.inspect(name)
    assert sorted(s.rank for s in report.shards) == [0, 1, 2, 3]
    for shard in report.shards:
        assert shard.local_shape == layouts[shard.rank][name], (shard.rank, name)


@pytest.mark.cluster
def test_uneven_shards_report_offsets_and_bytes(cluster, layouts) -> None:  # type: ignore[no-untyped-def]
    report = cluster.inspect("uneven")
    assert report.placements == ["Shard(0)"] and report.mesh_axes == ["dp"]
    assert [(s.local_shape[0], s.offsets[0], s.bytes) for s in report.shards] == [
        (3, 0, 48), (3, 3, 48), (3, 6, 48), (1, 9, 16)]


@pytest.mark.cluster
def test_a_module_reports_every_parameter_per_rank(cluster) -> None:  # type: ignore[no-untyped-def]
    cluster.run("net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))")
    report = cluster.inspect("net")
    assert [t.name for t in report.tensors] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert report.bytes_per_rank() == {r: (32 + 8 + 16 + 2) * 4 for r in range(4)}


@pytest.mark.cluster
def test_inspect_of_something_missing_names_the_ranks(cluster) -> None:  # type: ignore[no-untyped-def]
    from meshlab import ClusterError

    with pytest.raises(ClusterError,
                       match=r"cannot inspect 'nothing_here':\n  \[ranks 0-3\] NameError"):
        cluster.inspect("nothing_here")


@pytest.mark.cluster
def test_widget_draws_the_uneven_blocks_and_the_module_table(cluster, layouts) -> None:  # type: ignore[no-untyped-def]
    from meshlab.notebook.widgets import ShardingView

    view = ShardingView(cluster.inspect("uneven"))
    assert [(b["r0"], b["r1"], b["ranks"]) for b in view.tensor["blocks"]] == [
        (0, 3, [0]), (3, 6, [1]), (6, 9, [2]), (9, 10, [3])]
    mixed = ShardingView(cluster.inspect("mixed")).tensor["blocks"]
    assert [(b["c0"], b["c1"], b["ranks"], b["replicated"]) for b in mixed] == [
        (0, 3, [0, 2], True), (3, 6, [1, 3], True)]
    assert all(b["partial"] for b in ShardingView(cluster.inspect("partial")).tensor["blocks"])
    cube = ShardingView(cluster.inspect("cube"))
    assert cube.tensor["dims"] == [1, 2]  # the sharded dims are drawn first
    cube.dims = [0, 2]
    assert cube.tensor["dims"] == [0, 2] and len(cube.tensor["blocks"]) == 2
    cluster.run("net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))")
    net = ShardingView(cluster.inspect("net"))  # its own net: the test runs alone too
    assert [r["name"] for r in net.rows] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    net.selected = 2
    assert net.tensor["name"] == "1.weight"
    assert "class='meshlab-block'" in net._repr_html_() and "total" in net._repr_html_()
