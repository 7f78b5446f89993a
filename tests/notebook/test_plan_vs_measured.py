"""The planner's terms beside a profiled step: the reasons read from constructed numbers, and a
real ZeRO-3 x TP step profiled on the shared cluster."""

from __future__ import annotations

import math
import re

import pytest

from meshlab import Cluster
from meshlab.notebook.cell_profile import CellProfile
from meshlab.notebook.plan_vs_measured import HIGH, LOW, Term, plan_vs_measured, why
from meshlab.plan import Layout, ModelShape, estimate
from meshlab.plan.hardware import HARDWARE


def test_a_term_within_25_percent_has_no_reason() -> None:
    assert why(Term("compute", 10.0, 12.9)) == ""
    assert why(Term("compute", 10.0, 7.6)) == ""


def test_exposed_communication_mostly_waiting_names_the_straggler() -> None:
    term = Term("exposed dp_shard", 2.0, 8.0, {
        "calls": 12, "bytes": 4e6, "waited_ms": 5.0, "last": 3, "last_count": 11,
        "shared": 12, "predicted_calls": 12, "predicted_bytes": 4e6})
    text = why(term)
    assert text.startswith("measured 4x predicted:")
    assert "5 of its 8 ms was waiting for a later rank (rank 3 arrived last at 11 of 12" in text
    assert "planner counts" not in text  # calls and bytes agree: not a reason


def test_exposed_communication_with_more_calls_than_planned_says_how_many() -> None:
    term = Term("exposed tp", 1.0, 3.0, {"calls": 48, "bytes": 2e6, "waited_ms": 0.1,
                                          "predicted_calls": 16, "predicted_bytes": 2e6})
    assert "48 collectives a step where the planner counts 16" in why(term)


def test_overlap_the_planner_assumed_but_did_not_happen_is_named() -> None:
    term = Term("exposed dp_shard", 1.0, 4.0, {
        "calls": 8, "bytes": 1e6, "waited_ms": 0.0, "predicted_calls": 8,
        "predicted_bytes": 1e6, "hidden_ms": 0.2, "predicted_hidden_ms": 3.0})
    assert "the planner hid 3 ms of it behind compute, 0.2 ms hid" in why(term)


def test_slow_collectives_alone_compare_per_call_time_with_the_fit() -> None:
    term = Term("exposed tp", 1.0, 2.0, {"calls": 10, "bytes": 1e6, "waited_ms": 0.0,
                                          "predicted_calls": 10, "predicted_bytes": 1e6})
    assert "each collective took 0.2 ms, the profile's fit 0.1 ms: the link ran slower" \
        in why(term)


def test_communication_the_planner_does_not_count_is_flagged() -> None:
    term = Term("exposed world", 0.0, 1.5, {"calls": 2, "bytes": 8, "waited_ms": 0.0})
    assert math.isinf(term.ratio)
    assert why(term).startswith("measured none predicted: the planner counts no exposed "
                                "communication on world; the ranks issued 2 collectives")


def test_compute_beside_communication_on_cpu_blames_the_shared_cores() -> None:
    term = Term("compute", 10.0, 20.0, {"flops": 2e9, "achieved_tflops": 0.1,
                                        "profile_tflops": 0.2, "device": "cpu",
                                        "hidden_ms": 6.0, "slowest": 1, "slowest_ms": 20.5,
                                        "fastest": 0, "fastest_ms": 19.5})
    text = why(term)
    assert "ran at 0.1 TFLOP/s, the profile's matmuls at 0.2" in text
    assert "6 ms of communication a step ran beside compute (comm hidden): on CPU ranks" in text
    assert "ranks differ" not in text  # 20.5 vs 19.5: within 25%


def test_host_time_counts_ops_and_the_profiles_allowance() -> None:
    term = Term("host time", 4.0, 10.0, {"ops": 500, "gap_us": 20.0, "per_layer_us": 1000.0,
                                         "layers": 4})
    assert why(term) == ("measured 2.5x predicted: 10 ms a step between 500 ops (20 us after "
                         "each: Python, autograd, hooks), where the profile allows 1e+03 us per "
                         "layer for 4 layers")


def test_compute_over_and_host_time_under_are_read_together() -> None:
    term = Term("host time", 60.0, 20.0, {"ops": 800, "gap_us": 25.0, "per_layer_us": 3e4,
                                          "layers": 2, "with_other": (2.0, 80.0)})
    assert "compute and host time together: 100 ms measured, 62 ms predicted (1.6x)" \
        in why(term)
    both_over = Term("host time", 10.0, 20.0, {"ops": 800, "gap_us": 25.0,
                                               "per_layer_us": 3e4, "layers": 2,
                                               "with_other": (2.0, 80.0)})
    assert "together" not in why(both_over)  # both over: each is its own story


def test_an_unbalanced_pipeline_names_both_stages() -> None:
    term = Term("bubble", 2.0, 6.0, {"slowest": 1, "slowest_ms": 30.0, "fastest": 0,
                                     "fastest_ms": 15.0, "waited_ms": 5.0, "host_ms": 1.0,
                                     "compute_ms": 22.0, "slots": 1.2})
    text = why(term)
    assert "rank 1 computes 30 ms a step, rank 0 15 ms" in text
    assert "5 ms of it waiting for the neighbouring stage" in text


def test_the_step_names_its_largest_gaps() -> None:
    term = Term("step", 10.0, 20.0, {"gaps": {"compute": 1.0, "exposed tp": 7.0,
                                              "host time": 2.0, "optimizer": 0.0}})
    assert why(term).endswith("+10 ms a step, most of it exposed tp +7 ms, host time +2 ms, "
                              "compute +1 ms")


MODEL = ("dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256, "
         "max_seq_len=32")
SHAPE = ModelShape(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256,
                   seq_len=32)
STEP = f"""
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.models.llama import loss_fn
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank
cfg = ModelConfig({MODEL})
plan = ParallelPlan(data_parallel="zero3", seq_len=32)
model = parallelize(Transformer(cfg), mesh, plan)
opt = build_optimizer(model, mesh, plan)
r, n = data_rank(mesh)
x, y = local_batch(step=0, batch=2, seq=32, vocab=cfg.vocab_size, rank=r, ranks=n)

def train_step():
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()

train_step()  # warm-up: FSDP's lazy init
"""


@pytest.fixture
def profiled(cluster: Cluster) -> CellProfile:
    cluster.init_mesh("dp=2 tp=2")
    cluster.run(STEP, timeout=300)
    result = cluster.run("for _ in range(2):\n    train_step()", profile=True, timeout=300)
    assert result.profile is not None
    return result.profile


def test_a_profiled_zero3_tp_step_has_every_term_and_a_reason_where_off(
        profiled: CellProfile) -> None:
    hw = HARDWARE["h100-sxm"]  # far from CPU ranks: most terms are off, each must say why
    est = estimate(SHAPE, Layout.parse("dp=2 tp=2 zero=3 mbs=2", precision="fp32"), hw)
    frame = plan_vs_measured(profiled, est, steps=2).frame
    terms = list(frame["term"])
    assert terms[:2] == ["compute", "host time"] and terms[-2:] == ["optimizer", "step"]
    assert {"exposed dp_shard", "exposed tp"} <= set(terms)
    assert "bubble" not in terms  # no pipeline
    for row in frame.itertuples(index=False):
        predicted, measured, ratio, reason = row[1], row[2], row[3], row[4]
        assert math.isfinite(predicted) and math.isfinite(measured) and measured >= 0, row
        if predicted > 0:
            assert ratio == pytest.approx(measured / predicted), row
        off = not LOW <= ratio <= HIGH
        assert bool(reason) == off, row
        if off:
            assert re.match(r"measured (\S+x|none) predicted: \S", reason), row
    # the measured terms share each rank's window out: their sum is the step, bar overlap
    # between axes' collectives
    parts = frame[frame["term"] != "step"]["measured (ms)"].sum()
    step = frame.set_index("term").loc["step", "measured (ms)"]
    assert parts == pytest.approx(step, rel=0.05)


@pytest.mark.parametrize("layout", ["dp=4 zero=0 mbs=2", "dp=2 tp=2 zero=3 mbs=4",
                                    "pp=2 dp=2 zero=3 mbs=2 m=4", "dp=2 cp=2 zero=1"])
def test_the_planners_terms_add_up_to_its_step(layout: str) -> None:
    for hw in (HARDWARE["h100-sxm"], HARDWARE["cpu"]):  # overlapping, and not
        e = estimate(SHAPE, Layout.parse(layout, precision="fp32"), hw)
        terms = e.compute_s + sum(e.exposed_by_axis.values()) + e.bubble_s + e.optimizer_s
        assert terms == pytest.approx(e.step_s)
        assert (e.bubble_s > 0) == (e.layout.pp > 1)
