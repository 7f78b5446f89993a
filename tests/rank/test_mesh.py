"""Mesh specs (pure) and the named DeviceMesh they build on real ranks."""

from __future__ import annotations

from typing import Any

import pytest

from meshlab import Cluster
from meshlab.mesh import MeshSpec, coordinates
from meshlab.notebook.widgets import MeshView


def test_parse_takes_sizes_in_any_order_and_dp_means_dp_shard() -> None:
    spec = MeshSpec.parse("tp=2, dp=2")
    assert (spec.dp_shard, spec.tp, spec.size) == (2, 2, 4)
    assert list(spec.axes()) == ["dp_shard", "tp"]  # torchtitan's order, size-1 axes omitted
    assert str(spec) == "dp_shard=2 tp=2"


def test_axes_named_at_size_one_stay_on_the_mesh() -> None:
    assert list(MeshSpec.parse("pp=1 dp=2 tp=2").axes()) == ["pp", "dp_shard", "tp"]


@pytest.mark.parametrize("text, world, message", [
    ("dp=2 tp=3", 4, r"dp_shard=2 x tp=3 = 6, but the cluster has 4 ranks"),
    ("dp=2 mp=2", 4, r"unknown mesh axis 'mp=2'.*pp, dp_replicate, dp_shard, cp, tp"),
    ("dp=0 tp=4", 4, r"dp_shard=0: every degree must be a positive integer"),
    ("dp=-2", 4, r"dp_shard=-2: every degree must be a positive integer"),
    ("dp=x", 4, r"the size of dp_shard must be an integer"),
    ("tp", 4, r"unknown mesh axis 'tp'"),
    ("dp=2 dp_shard=2", 4, r"axis 'dp_shard' given twice"),
    ("dp=4 ep=3", 4, r"ep=3 must divide dp_shard x cp = 4 x 1 = 4"),
    ("dp=2 cp=4 ep=2", 8, r"ep=2 must divide .* and be a multiple of cp=4"),
    ("", 4, r"an empty mesh"),
])
def test_bad_specs_show_the_numbers_and_the_fix(text: str, world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MeshSpec.parse(text).check(world)


def test_groups_of_a_1d_mesh() -> None:
    assert MeshSpec.parse("dp=4").groups()["dp_shard"] == [[0, 1, 2, 3]]


def test_groups_of_a_2d_mesh_put_tp_neighbours_together() -> None:
    groups = MeshSpec.parse("dp=2 tp=2").groups()
    assert groups["tp"] == [[0, 1], [2, 3]]
    assert groups["dp_shard"] == groups["dp"] == [[0, 2], [1, 3]]


def test_groups_of_a_3d_mesh_and_its_flattened_views() -> None:
    groups = MeshSpec.parse("pp=2 dp_replicate=2 dp_shard=2 tp=2").groups()
    assert groups["pp"][0] == [0, 8]
    assert groups["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert groups["tp"][:2] == [[0, 1], [2, 3]]
    cp = MeshSpec.parse("dp=2 cp=2 tp=2").groups()
    assert cp["dp_shard_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_ep_is_carved_out_of_dp_shard_like_torchtitan() -> None:
    spec = MeshSpec.parse("dp=4 ep=2")
    assert spec.mesh_axes() == {"dp_shard_mod_ep": 2, "dp_shard_in_ep": 2}
    groups = spec.groups()
    assert groups["ep"] == [[0, 1], [2, 3]]
    assert groups["dp_shard"] == [[0, 1, 2, 3]]


def test_coordinates_are_row_major() -> None:
    assert coordinates(MeshSpec.parse("dp=2 tp=2"))[2] == {"dp_shard": 1, "tp": 0}


def test_mesh_view_draws_every_rank_with_its_coordinates() -> None:
    html = MeshView(MeshSpec.parse("pp=2 dp=2 tp=2"))._repr_html_()
    assert html.count('class="meshlab-rank"') == 8
    assert 'data-rank="6"' in html and "pp=1 dp_shard=1 tp=0" in html
    assert "<caption style='text-align:left'>pp=1</caption>" in html


CHECK_GROUPS = """
import meshlab.mesh
_spec = meshlab.mesh.MeshSpec.parse(SPEC)
_mine = {name: next(g for g in groups if rank in g) for name, groups in _spec.groups().items()}
_built = {name: sorted(mesh[name].mesh.flatten().tolist()) for name in _mine}
# the degrees a plan is checked against without ranks (MeshSpec.size_of) are the built ones
_sizes = {n: (_spec.size_of(n), meshlab.mesh.axis_size(mesh, n))
          for n in meshlab.mesh.AXES + meshlab.mesh.VIEWS}
(_built == _mine and all(a == b for a, b in _sizes.values())) or (_built, _mine, _sizes)
"""


@pytest.mark.cluster
@pytest.mark.parametrize("text", ["dp=4", "dp=2 tp=2", "dp_replicate=1 dp=2 tp=2",
                                  "dp_replicate=2 dp=2", "dp=4 ep=2", "dp=2 cp=2 ep=4"])
def test_built_mesh_matches_the_computed_groups_on_every_rank(cluster: Cluster,
                                                              text: str) -> None:
    cluster.init_mesh(text)
    cluster.push({"SPEC": text})
    result = cluster.run(CHECK_GROUPS)
    assert result.results() == "Out[ranks 0-3]: True", result.results()


def test_a_view_is_shown_by_the_axes_it_spans_that_have_ranks() -> None:
    assert MeshSpec.parse("dp=4").shown_name("dp_shard_cp") == "dp_shard"
    assert MeshSpec.parse("dp=2 cp=2").shown_name("dp_shard_cp") == "dp_shard+cp"
    assert MeshSpec.parse("dp_replicate=2 dp=2 cp=2").shown_name("dp_cp") == \
        "dp_replicate+dp_shard+cp"
    assert MeshSpec.parse("dp_replicate=2 dp=2").shown_name("dp") == "dp"  # as one says it
    assert MeshSpec.parse("dp=4 ep=2").shown_name("dp_shard") == "dp_shard"  # an axis by name
    assert MeshSpec.parse("dp=2 tp=2").shown_name("tp") == "tp"


@pytest.mark.cluster
def test_an_fsdp_parameter_is_inspected_on_the_axis_the_mesh_table_names(
        cluster: Cluster) -> None:
    """``%mesh init dp=4``: the table says dp_shard, and so does the sharding view, though
    FSDP shards over the flattened view dp_shard_cp (cp of 1)."""
    cluster.init_mesh("dp=4")
    cluster.run("from meshlab.parallel import ParallelPlan, parallelize\n"
                "from meshlab.models import ModelConfig, Transformer\n"
                "sharded = parallelize(Transformer(ModelConfig(n_layers=1, dim=16, n_heads=2, "
                "n_kv_heads=2, ffn_hidden=32, vocab_size=32)), mesh, "
                "ParallelPlan(data_parallel='zero3'))")
    report = cluster.inspect("sharded")
    assert {a for t in report.tensors for a in t.mesh_axes} == {"dp_shard"}


@pytest.mark.cluster
def test_init_refuses_a_mesh_that_does_not_fit(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match="dp_shard=2 x tp=3 = 6, but the cluster has 4 ranks"):
        cluster.init_mesh("dp=2 tp=3")


@pytest.mark.cluster
def test_mesh_magic_shows_the_group_table_and_grid(shell: Any) -> None:
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        shell.run_line_magic("mesh", "init dp=2 tp=2")
    table, grid = cap.outputs
    assert "tp" in table.data["text/plain"] and "[0-1]  [2-3]" in table.data["text/plain"]
    assert "rank 3: dp_shard=1 tp=1" in grid.data["text/plain"]
    assert shell.run_cell("%%mesh\nmesh['tp'].size()").success


@pytest.mark.cluster
def test_init_without_axes_shows_the_current_mesh_or_says_how_to_make_one(shell: Any,
                                                                           cluster: Cluster
                                                                           ) -> None:
    from IPython.utils.capture import capture_output

    cluster.init_mesh("dp=4")
    with capture_output() as cap:
        shell.run_line_magic("mesh", "init")
    assert "rank 3: dp_shard=3" in cap.outputs[-1].data["text/plain"]
    spec, cluster.mesh_spec = cluster.mesh_spec, None
    try:
        with capture_output() as cap:
            result = shell.run_cell("%mesh init")
    finally:
        cluster.mesh_spec = spec
    assert not result.success and "no mesh yet: %mesh init dp=2 tp=2" in cap.stderr


@pytest.mark.cluster
def test_a_bad_spec_from_the_magic_is_a_usage_error_with_the_numbers(shell: Any) -> None:
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        result = shell.run_cell("%mesh init dp=3 tp=2")
    assert not result.success
    assert "dp_shard=3 x tp=2 = 6, but the cluster has 4 ranks" in cap.stderr


def test_a_misspelled_axis_is_an_error_naming_the_valid_ones() -> None:
    from meshlab.mesh import axis_size

    with pytest.raises(ValueError, match=r"unknown mesh axis 'tpp': ask for one of pp, "
                                         r"dp_replicate, dp_shard, cp, tp, dp, "):
        axis_size(None, "tpp")  # type: ignore[arg-type]  # refused before the mesh is read
