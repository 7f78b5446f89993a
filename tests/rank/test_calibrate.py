"""meshlab.calibrate and %mesh calibrate: what the planner assumes, measured on live ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from meshlab import Cluster
from meshlab.calibrate import (
    choose_axes,
    fit_alpha_beta,
    fit_collective,
    parse_sizes,
    summary,
)
from meshlab.calibrate.attention import SHAPES as ATTENTION_SHAPES
from meshlab.calibrate.attention import attention_flops
from meshlab.calibrate.host_costs import LAYERS, tiny_shape, wrapper_layouts
from meshlab.measure.timing import interleaved_times, median_seconds, step_times
from meshlab.notebook.calibrate import CalibrationReport, calibrate_profile
from meshlab.plan import Layout, estimate
from meshlab.plan.compute import attention_seconds
from meshlab.plan.formulas import COLLECTIVES, collective_seconds
from meshlab.plan.hardware import Link, load
from meshlab.plan.shapes import ModelShape
from meshlab.plan.stage import Stage

REPO = Path(__file__).resolve().parents[2]
SIZES = [4096, 65536, 2**20, 2**22]


def test_fit_recovers_a_known_alpha_and_beta_exactly() -> None:
    alpha, beta = 7e-4, 3e-9
    a, b, residual = fit_alpha_beta(SIZES, [alpha + beta * x for x in SIZES])
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(beta, rel=1e-9)
    assert residual == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_fit_gives_back_the_link_the_planner_used(collective: str) -> None:
    # times made by the planner's own formula from a known link come back as that link
    link, n = Link(bandwidth_gbs=0.7, latency_us=450.0), 4
    seconds = [collective_seconds(collective, n, x, latency_s=link.latency_us * 1e-6,
                                  bandwidth_bytes_s=link.bandwidth_gbs * 1e9) for x in SIZES]
    fit = fit_collective("world", n, [[0, 1, 2, 3]], collective, SIZES, seconds)
    assert fit.latency_us == pytest.approx(link.latency_us, rel=1e-9)
    assert fit.bandwidth_gbs == pytest.approx(link.bandwidth_gbs, rel=1e-9)
    assert fit.fitted() == pytest.approx(seconds, rel=1e-9) and not fit.note


def test_fit_keeps_latency_non_negative() -> None:
    # times that would extrapolate to a negative latency: the intercept is pinned at zero
    a, b, _ = fit_alpha_beta([1000, 2000, 4000], [1e-6, 3e-6, 7e-6])
    assert a == 0 and b > 0


def test_times_flat_in_size_give_a_bandwidth_floor_and_say_so() -> None:
    fit = fit_collective("tp", 2, [[0, 1]], "all_reduce", SIZES,
                         [1.2e-3, 1.1e-3, 1.0e-3, 0.9e-3])
    assert fit.bandwidth_gbs > 0 and fit.latency_us > 0
    assert "bandwidth is a floor" in fit.note


def test_parse_sizes_reads_suffixes_and_rejects_nonsense() -> None:
    assert parse_sizes("4K, 64K,1M,1MiB,4096") == [4096, 65536, 2**20]
    with pytest.raises(ValueError, match="size 'x': give bytes like 4096, 64K or 4M"):
        parse_sizes("4K,x")
    with pytest.raises(ValueError, match="at least two distinct message sizes"):
        parse_sizes("4K,4096")


def test_step_times_times_each_step_with_its_after_and_drops_the_warmup() -> None:
    calls: list[str] = []
    times = step_times(lambda: calls.append("step"), 3, warmup=2,
                       before=lambda: calls.append("before"), after=lambda: calls.append("after"))
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == ["before", "step", "after"] * 5


def test_interleaved_times_runs_every_way_once_a_round_in_a_shuffled_order() -> None:
    calls: list[str] = []
    ways = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = interleaved_times(ways, 20, warmup=2)
    assert {name: len(s) for name, s in samples.items()} == {"a": 20, "b": 20, "c": 20}
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(rounds) == 22 and all(sorted(r) == ["a", "b", "c"] for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1  # 22 rounds in one order: 1 chance in 6^21


def test_median_seconds_on_a_cpu_runs_inner_calls_per_rep_after_the_warmup() -> None:
    calls: list[str] = []
    seconds = median_seconds(lambda: calls.append("op"), torch.device("cpu"), 3, inner=4,
                             warmup=2, before=lambda: calls.append("before"))
    assert seconds >= 0
    assert calls == ["op"] * 2 + (["before"] + ["op"] * 4) * 3


def test_widest_group_inside_a_host_is_intra_and_one_across_hosts_is_inter() -> None:
    hosts = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7]}
    fits = [fit_collective(axis, len(groups[0]), groups, "all_reduce", SIZES,
                           [1e-3, 2e-3, 3e-3, 9e-3])
            for axis, groups in (("world", [list(range(8))]), ("dp_shard", [[0, 4], [1, 5]]),
                                 ("tp", [[0, 1], [2, 3], [4, 5], [6, 7]]),
                                 ("cp_tp", [[0, 1, 2, 3], [4, 5, 6, 7]]))]
    assert choose_axes(fits, hosts)[:2] == ("cp_tp", "world")
    intra, inter, notes = choose_axes(fits[2:], hosts)
    assert (intra, inter) == ("cp_tp", None) and "inter link is the intra one" in notes[0]


def test_torchrun_calibrates_without_the_notebook_stack(tmp_path: Path) -> None:
    for name in ("IPython", "ipyparallel", "ipywidgets", "altair"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} imported')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "meshlab.calibrate", "--mesh", "tp=2", "--quick", "-o", str(tmp_path / "t.toml")],
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert f"wrote {tmp_path / 't.toml'}" in done.stdout
    assert "tp                2  all_reduce" in done.stdout  # and the world, and the table
    assert load(tmp_path / "t.toml").gpus_per_node == 2


# -- on the live 4-rank cluster ----------------------------------------------------------------


@pytest.fixture(scope="module")
def report(_shared_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> CalibrationReport:
    _shared_cluster.init_mesh("dp=2 tp=2")
    path = tmp_path_factory.mktemp("calibrate") / "cpu4.toml"
    return calibrate_profile(_shared_cluster, path, quick=True)


@pytest.mark.cluster
def test_profile_file_loads_back_as_the_returned_profile(report: CalibrationReport) -> None:
    hw = load(report.path)
    assert hw == report.hardware and hw.name == "cpu4"
    assert set(hw.tflops) == {"fp32", "bf16"} and min(hw.tflops.values()) > 0
    assert hw.matmul_efficiency == 1.0 and hw.gpus_per_node == 4
    assert hw.memory_gib > 0 and hw.memory_bandwidth_gbs > 0 and hw.layer_overhead_us > 0
    assert not hw.asynchronous  # CPU ranks: dispatch, gloo and the math share the cores


@pytest.mark.cluster
def test_fsdp_and_tp_add_host_time_per_layer_and_the_planner_gives_it_back(
        report: CalibrationReport) -> None:
    hw, measured = report.hardware, report.calibration.layer_seconds
    assert set(measured) == {"plain", "fsdp", "tp"}
    # FSDP2's hooks and copies and DTensor's dispatch cost more than a plain layer, beyond
    # their collectives, on gloo ranks that share two cores
    assert hw.fsdp_overhead_us > 0 and hw.tp_overhead_us > 0
    # the profile predicts the tiny model it was measured on: per layer, per wrapper
    for wrapper, (_, _, layout) in wrapper_layouts(4).items():
        one, many = (estimate(tiny_shape(n), Layout.parse(layout, precision="fp32"), hw)
                      for n in LAYERS)
        per_layer = ((many.step_s - many.optimizer_s) - (one.step_s - one.optimizer_s)) / (
            LAYERS[1] - LAYERS[0])
        assert per_layer == pytest.approx(measured[wrapper], rel=1e-6), wrapper


@pytest.mark.cluster
def test_every_collective_has_a_positive_bandwidth_and_latency(report: CalibrationReport) -> None:
    hw = report.hardware
    assert set(hw.collectives) == set(COLLECTIVES)
    for link in (hw.intra, hw.inter, *hw.collectives.values()):
        assert link.bandwidth_gbs > 0 and link.latency_us >= 0
    # one host: intra is the world's all_reduce, and inter says it is the same
    assert hw.intra == hw.collectives["all_reduce"] == hw.inter
    assert any("inter link is the intra one" in n for n in report.calibration.notes)


@pytest.mark.cluster
def test_every_mesh_axis_and_the_world_have_a_row_per_collective(
        report: CalibrationReport) -> None:
    table = report.collectives
    assert sorted(set(zip(table["axis"], table["ranks"], strict=True))) == [
        ("dp_shard", 2), ("tp", 2), ("world", 4)]
    assert (table.groupby("axis")["collective"].apply(set) == set(COLLECTIVES)).all()
    assert (table["bandwidth_gbs"] > 0).all() and (table["latency_us"] >= 0).all()
    assert set(table.loc[table["axis"] == "world", "used_in_profile"]) == {
        "intra, inter", "collectives"}
    points = report.points
    assert len(points) == len(table) * 4  # quick: 4 message sizes
    assert (points["measured_us"] > 0).all() and (points["fitted_us"] > 0).all()
    assert report.matmul["used_in_profile"].sum() == 2  # one shape per dtype went into the profile


def test_attention_flops_are_counted_as_the_planner_counts_them() -> None:
    # one causal call of 1 x 4 heads x 512 positions x 64: QK^T and PV, 2 s^2 d flops each
    # per head, half the square masked; the fused backward 2.5 times that
    forward = 2 * (2 * 512 * 512 * 64) * 4 / 2
    assert attention_flops(1, 4, 512, 64) == forward * 3.5


@pytest.mark.cluster
def test_sdpas_fused_kernel_is_timed_and_sdpas_choice_is_named(report: CalibrationReport) -> None:
    cal = report.calibration
    # a CPU has SDPA's flash backend only (cuDNN is a GPU's), and SDPA picks it itself
    assert set(cal.attention) == {"flash2"} and cal.attention["flash2"] > 0
    assert cal.attention_default == "flash2"
    assert "flash2" in summary(cal) and "(SDPA's choice)" in summary(cal)
    # the profile keeps the rate only under the bf16 matmul's peak; which side a CPU lands on
    # is its own (a CPU without bf16 units runs bf16 matmuls slower than fused attention)
    kept = cal.attention["flash2"] <= cal.peaks()["bf16"]
    assert report.hardware.attention_default == ("flash2" if kept else "")


@pytest.mark.cluster
@pytest.mark.parametrize("times_the_peak", [0.5, 2.0])
def test_the_profile_costs_attention_at_its_rate_only_under_the_bf16_peak(
        report: CalibrationReport, times_the_peak: float) -> None:
    """Both sides of the rule on this calibration, whichever side its CPU measured."""
    peak = report.calibration.peaks()["bf16"]
    cal = replace(report.calibration, attention={"flash2": peak * times_the_peak})
    hw = cal.profile("cpu")
    batch, heads, positions, head_dim = ATTENTION_SHAPES["cpu"]
    timed = ModelShape(name="timed", layers=1, hidden=heads * head_dim, heads=heads,
                       ffn=4 * heads * head_dim, vocab=256, seq_len=positions)
    planned = attention_seconds(Stage(timed, Layout(micro_batch=batch), hw)) * (1 + 2.5)
    measured = attention_flops(*ATTENTION_SHAPES["cpu"]) / (cal.attention["flash2"] * 1e12)
    if times_the_peak <= 1:
        assert hw.attention_default == "flash2"
        assert hw.attention_efficiency["flash2"] == pytest.approx(times_the_peak, rel=1e-12)
        # the planner gives back the time of the call calibrate timed: one layer of the
        # shape, forward and the fused backward
        assert planned == pytest.approx(measured, rel=1e-9)
        assert cal.attention_notes() == []
    else:  # left out and said: the planner costs the two products as GEMMs instead
        assert hw.attention_default == "" and hw.attention_efficiency == {}
        assert planned > measured
        assert any("above the bf16 matmul's peak" in n for n in cal.attention_notes())


@contextmanager
def no_mesh(cluster: Cluster) -> Iterator[None]:
    """The cluster as it is before `%mesh init`."""
    spec, cluster.mesh_spec = cluster.mesh_spec, None
    try:
        yield
    finally:
        cluster.mesh_spec = spec


@pytest.mark.cluster
def test_magic_without_a_mesh_times_the_world_and_prints_the_path(
        shell: Any, cluster: Cluster, tmp_path: Path) -> None:
    path = tmp_path / "here.toml"
    wide = pd.option_context("display.width", 300, "display.max_columns", 20)
    with no_mesh(cluster), wide, capture_output() as cap:
        shell.run_line_magic("mesh", f"calibrate -o {path} --name mine --sizes 4K,256K,1M --quick")
    assert f"wrote {path}: mine: TFLOP/s fp32" in cap.stdout
    assert f"use it: %mesh plan MODEL --hardware {path}" in cap.stdout
    assert "no mesh: only the world group was timed" in cap.stdout
    matmul, collectives = (o.data["text/plain"] for o in cap.outputs[-2:])
    assert "tflops" in matmul and "bandwidth_gbs" in collectives
    assert "world" in collectives and "dp_shard" not in collectives
    assert load(path).name == "mine"


@pytest.mark.parametrize("line, message", [
    ("calibrate --sizes 4K,x", "size 'x': give bytes like 4096, 64K or 4M"),
    ("calibrate -o /no/such/folder/x.toml", "folder /no/such/folder does not exist"),
])
def test_magic_misuse_names_the_fix(shell: Any, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("mesh", line)
