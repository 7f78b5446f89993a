"""The planner's context-parallel model (meshlab.plan.context_formulas, meshlab.plan.context):
closed forms against a direct count, Ulysses' constant bytes, the search's choice and its
reasons, and the optimizer / precision / QAT terms of the memory model. No engines."""

from __future__ import annotations

import dataclasses

import pytest

from meshlab.plan.context import best_cp, cp_options
from meshlab.plan.context_formulas import (
    HEAD_SPLIT_CP,
    context_parallel_bytes,
    context_parallel_collectives,
    context_parallel_memory,
    cp_refusal,
)
from meshlab.plan.estimate import estimate
from meshlab.plan.formulas import bus_factor, sharded_state_bytes, zero_bytes
from meshlab.plan.hardware import HARDWARE
from meshlab.plan.layout import Layout
from meshlab.plan.layout_check import check
from meshlab.plan.report import plan
from meshlab.plan.search import search
from meshlab.plan.shapes import MODELS, ModelShape

H100 = HARDWARE["h100-sxm"]
LLAMA8_128K = dataclasses.replace(MODELS["llama3-8b"], seq_len=131072)
LLAMA70_128K = dataclasses.replace(MODELS["llama3-70b"], seq_len=131072)


def _shape(p: int, **over: int) -> dict[str, int]:
    return {"batch": 2, "seq_len": 8 * p, "heads": 2 * p, "kv_heads": p, "head_dim": 4,
            "cp": p, "dtype_bytes": 2, **over}


def _ulysses_by_hand(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                     cp: int, dtype_bytes: int) -> tuple[float, float]:
    """(handed in, sent) bytes of one rank: each of q, k, v, out (B, H, T/p, D) cut by heads
    into p pieces, piece j to rank j (its own stays); forward and backward alike."""
    sent = handed = 0.0
    for width in (heads, kv_heads, kv_heads, heads):  # q, k, v, the output back
        tensor = [[[[1] * head_dim for _ in range(seq_len // cp)] for _ in range(width)]
                  for _ in range(batch)]
        pieces = [[row[h * width // cp:(h + 1) * width // cp] for row in tensor]
                  for h in range(cp)]
        sizes = [sum(len(head) * len(head[0]) * len(head[0][0]) for head in piece)
                 * dtype_bytes for piece in pieces]
        handed += sum(sizes)
        sent += sum(size for j, size in enumerate(sizes) if j != 0)  # rank 0 keeps piece 0
    return 2 * handed, 2 * sent  # the backward's reverse moves the same


@pytest.mark.parametrize("p", range(2, 9))
def test_ulysses_bytes_equal_a_count_of_the_all_to_all_pieces(p: int) -> None:
    shape = _shape(p)
    by_formula = context_parallel_bytes("ulysses", **shape)
    handed, sent = _ulysses_by_hand(**shape)
    assert by_formula["message"] == pytest.approx(handed, rel=1e-12)
    assert by_formula["wire"] == pytest.approx(sent, rel=1e-12)


@pytest.mark.parametrize("p", range(2, 9))
def test_all_gather_and_ring_bytes_equal_a_count_of_the_slices_sent(p: int) -> None:
    shape = _shape(p)
    kv = shape["batch"] * shape["seq_len"] // p * shape["kv_heads"] * shape["head_dim"] * 2
    # all-gather: my K and V slices to p-1 ranks; the all-reduce of the whole gradients
    # sends 2(p-1) pieces of 1/p (reduce-scatter, then all-gather); reduce-scatter half that
    gathered = 2 * kv * (p - 1)
    reduced = 2 * (p - 1) * (2 * kv * p / p)
    assert context_parallel_bytes("meshlab", **shape)["wire"] == pytest.approx(
        gathered + reduced)
    assert context_parallel_bytes("all_gather", **shape)["wire"] == pytest.approx(
        gathered + reduced / 2)
    # ring: p-1 hops of K and V forward and backward, p hops of their fp32 gradients
    ring = (p - 1) * 2 * kv + (p - 1) * 2 * kv + p * 2 * kv * 4 / 2
    assert context_parallel_bytes("torch", **shape)["wire"] == pytest.approx(ring)


def test_ulysses_per_link_volume_is_4nh_over_p_for_multi_head_attention() -> None:
    # Jacobs et al. 2023: 4Nh/P per direction for q, k, v and the output (heads = kv_heads)
    b, n, heads, d, p, e = 1, 4096, 8, 16, 4, 2
    got = context_parallel_bytes("ulysses", batch=b, seq_len=n, heads=heads, kv_heads=heads,
                                 head_dim=d, cp=p, dtype_bytes=e)
    assert got["message"] / 2 == 4 * n * heads * d * e / p


@pytest.mark.parametrize("impl", ["ulysses", "chunked"])
def test_ulysses_message_bytes_stay_constant_when_seq_and_cp_double_and_all_gathers_grow(
        impl: str) -> None:
    def per_rank(what: str, s: int, p: int) -> float:
        return context_parallel_bytes(what, batch=1, seq_len=s, heads=32, kv_heads=8,
                                      head_dim=128, cp=p, dtype_bytes=2)["message"]

    assert per_rank(impl, 65536, 4) == per_rank(impl, 131072, 8) == per_rank(impl, 32768, 2)
    # the all-gather hands in its constant slice, the all-reduce the whole sequence's K/V
    assert per_rank("meshlab", 131072, 8) == 3 * per_rank("meshlab", 32768, 2)


def test_the_planner_counts_the_cp_bytes_of_the_formula() -> None:
    lay = Layout.parse("cp=4 tp=2 dp=2 zero=3 mbs=2 m=3 ac=selective")
    for impl in ("meshlab", "torch", "ulysses", "chunked", "all_gather"):
        e = estimate(LLAMA8_128K, dataclasses.replace(lay, context_parallel=impl), H100)
        planned = sum(c.calls * c.nbytes * bus_factor(c.collective, c.ranks)
                      for c in e.collectives if c.axis == "cp")
        per_layer = context_parallel_bytes(
            impl, batch=2, seq_len=131072, heads=16, kv_heads=4, head_dim=128, cp=4,
            dtype_bytes=2)["wire"]
        assert planned == pytest.approx(per_layer * 32 * 3, rel=1e-12), impl


def test_the_planner_says_ulysses_bytes_stay_constant_and_all_gathers_grow() -> None:
    def wire(impl: str, seq: int, cp: int) -> float:
        model = dataclasses.replace(MODELS["llama3-8b"], seq_len=seq)
        e = estimate(model, Layout(cp=cp, zero=3, recompute="full", context_parallel=impl),
                     H100)
        return sum(c.calls * c.nbytes for c in e.collectives if c.axis == "cp"
                   and "recomputed" not in c.what)

    assert wire("ulysses", 65536, 2) == pytest.approx(wire("ulysses", 131072, 4))
    assert wire("meshlab", 131072, 4) > 1.9 * wire("meshlab", 65536, 2)


def test_ulysses_is_refused_where_kv_heads_per_tp_do_not_split_over_cp() -> None:
    assert cp_refusal("ulysses", heads=32, kv_heads=8, tp=1, cp=8) is None
    why = cp_refusal("ulysses", heads=32, kv_heads=8, tp=8, cp=2)
    assert why is not None and "kv_heads/tp = 8/8 = 1 is not divisible by cp=2" in why
    with pytest.raises(ValueError, match="less tp, or context_parallel=meshlab"):
        check(LLAMA8_128K, Layout.parse("tp=8 cp=2 cp_impl=ulysses"))


def test_the_128k_llama3_8b_at_cp8_tp1_runs_a_head_split_implementation() -> None:
    lay = Layout.parse("cp=8 zero=3 ac=full")
    options = {o.impl: o for o in cp_options(LLAMA8_128K, lay, H100)}
    best = best_cp(LLAMA8_128K, lay, H100)
    assert best is not None and all(o.estimate is not None for o in options.values())
    # the reason: 8 kv heads split over 8 ranks, and contiguous all-gather/ring slices leave
    # the last rank (2 - 1/8) x the balanced causal attention
    assert best.layout.context_parallel in HEAD_SPLIT_CP
    fastest = min(o.estimate.step_s for o in options.values() if o.estimate and o.estimate.fits)
    assert best.step_s == fastest
    skewed = options["meshlab"].estimate
    assert skewed is not None and skewed.compute_s > 1.5 * best.compute_s
    assert f"cp_impl={best.layout.context_parallel} (fastest that fits)" in best.notes[-1]


def test_the_128k_llama3_70b_at_tp8_cp2_runs_the_ring_where_ulysses_is_refused() -> None:
    lay = Layout.parse("tp=8 cp=2 dp=4 zero=3 ac=full")
    options = {o.impl: o for o in cp_options(LLAMA70_128K, lay, H100)}
    assert options["ulysses"].estimate is None and options["chunked"].estimate is None
    assert "not divisible by cp=2" in options["ulysses"].refused
    best = best_cp(LLAMA70_128K, lay, H100)
    assert best is not None and best.layout.context_parallel == "torch"
    ring, gather = options["torch"].estimate, options["meshlab"].estimate
    assert ring is not None and gather is not None
    # the same skewed compute; the ring hides its hops behind attention, the gather cannot
    assert ring.compute_s == pytest.approx(gather.compute_s)
    assert ring.exposed_by_axis["cp"] < gather.exposed_by_axis["cp"]


def test_the_ring_is_refused_on_cpu_ranks() -> None:
    with pytest.raises(ValueError, match="CUDA ranks only"):
        estimate(MODELS["meshlab"], Layout.parse("cp=2 cp_impl=torch"), HARDWARE["cpu"])


def test_plan_of_a_layout_without_cp_impl_says_which_it_picked() -> None:
    p = plan(LLAMA8_128K, gpus=8, layout="cp=8 zero=3 ac=full")
    assert any("cp_impl not given" in n for n in p.notes)
    assert "cp_impl=" in p.text() and "refused" not in p.text()


def test_the_search_keeps_one_implementation_per_layout_and_honours_a_pinned_one() -> None:
    small = ModelShape(name="small", layers=2, hidden=256, heads=8, kv_heads=4, ffn=512,
                       vocab=1024, seq_len=16384)
    found = search(small, gpus=4, hardware=H100, global_batch=4, top=None,
                   constraints="pp=1 tp=1 cp=4 zero=3 mbs=1 ac=full")
    assert len(found) == 1 and "cp_impl=" in found["layout"][0]
    pinned = search(small, gpus=4, hardware=H100, global_batch=4, top=None,
                    constraints="pp=1 tp=1 cp=4 zero=3 mbs=1 ac=full cp_impl=meshlab")
    assert list(pinned["layout"]) == ["cp=4 zero=3 mbs=1 m=4 ac=full cp_impl=meshlab"]


def test_chunked_offload_moves_keys_and_values_to_the_host() -> None:
    shape = _shape(4)
    on = context_parallel_memory("chunked", **shape, chunks=4, offload=True)
    off = context_parallel_memory("chunked", **shape, chunks=4)
    assert on["kv_kept"] == 0 and on["host"] == off["kv_kept"] > 0
    lay = Layout.parse("cp=4 zero=3 cp_impl=chunked cp_offload=1")
    e = estimate(LLAMA8_128K, lay, H100)
    assert e.memory["host"] > 0 and any("key/value chunks" in c.what for c in e.collectives)


def test_chunked_scores_are_one_chunk_of_the_whole_sequence() -> None:
    shape = _shape(4)
    ulysses = context_parallel_memory("ulysses", **shape)["scores"]
    assert context_parallel_memory("chunked", **shape, chunks=4)["scores"] == ulysses / 4


@pytest.mark.parametrize("kind,per_param", [("adamw", 12), ("adamw_bf16", 8), ("sgd", 8)])
def test_the_optimizer_sets_zero_k_and_zero_shards_it(kind: str, per_param: float) -> None:
    lay = Layout.parse(f"dp=8 zero=1 optimizer={kind}")
    e = estimate(MODELS["llama3-8b"], lay, H100)
    params = round(MODELS["llama3-8b"].params)
    expected = zero_bytes(params, dp=8, stage=1, optimizer_bytes=per_param)["optimizer"]
    assert e.memory["optimizer"] == pytest.approx(expected, rel=1e-9)


def test_adafactor_is_its_master_weights_and_each_tensors_factored_states() -> None:
    lay = Layout.parse("dp=8 zero=1 optimizer=adafactor")
    e = estimate(MODELS["llama3-8b"], lay, H100)
    params = round(MODELS["llama3-8b"].params)
    master = zero_bytes(params, dp=8, stage=1, optimizer_bytes=4)["optimizer"]
    layer = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (4096,), (4096,),
             (14336, 4096), (14336, 4096), (4096, 14336)]  # q, k, v, o, norms, gate, up, down
    shapes = layer * 32 + [(128256, 4096), (128256, 4096), (4096,)]
    factored = sharded_state_bytes("adafactor", shapes, dp=8, stage=1)
    assert e.memory["optimizer"] == pytest.approx(master + factored, rel=1e-9)


def test_fp16_is_planned_as_bf16_and_says_so() -> None:
    bf16 = estimate(MODELS["llama3-8b"], Layout.parse("dp=8 zero=3"), H100)
    fp16 = estimate(MODELS["llama3-8b"], Layout.parse("dp=8 zero=3 precision=fp16"), H100)
    assert fp16.memory == bf16.memory and fp16.step_s == bf16.step_s
    assert any("fp16: counted as bf16" in n for n in fp16.notes)


def test_qat_keeps_memory_and_adds_time() -> None:
    base = estimate(MODELS["llama3-8b"], Layout.parse("dp=8 zero=3"), H100)
    qat = estimate(MODELS["llama3-8b"], Layout.parse("dp=8 zero=3 qat=8da4w"), H100)
    assert qat.memory == base.memory and qat.step_s > base.step_s
    assert any("qat=8da4w" in n for n in qat.notes)


def test_fp8_is_planned_on_gpus_with_an_fp8_peak_only() -> None:
    e = estimate(MODELS["llama3-8b"], Layout.parse("dp=8 zero=3 precision=fp8"), H100)
    assert any("GPU only" in n for n in e.notes)
    with pytest.raises(ValueError, match="no fp8 peak"):
        estimate(MODELS["llama3-8b"], Layout.parse("dp=8 zero=3 precision=fp8"),
                 HARDWARE["a100-80gb"])


def test_the_collectives_of_one_impl_name_forward_and_backward() -> None:
    names = [(c.collective, c.backward) for c in
             context_parallel_collectives("ulysses", **_shape(2))]
    assert names.count(("all_to_all", False)) == names.count(("all_to_all", True)) == 2


def test_the_console_plans_a_preset_at_another_sequence_length() -> None:
    import argparse

    from meshlab.plan.cli import chosen_model

    args = argparse.Namespace(preset="llama3-8b", model=None, layers=None, hidden=None,
                              heads=None, ffn=None, vocab=None, seq=131072, kv_heads=None,
                              experts=None, top_k=None)
    shape = chosen_model(args)
    assert isinstance(shape, ModelShape)
    assert shape == dataclasses.replace(MODELS["llama3-8b"], seq_len=131072)


def test_only_the_ring_hides_its_hops_behind_attention() -> None:
    link = {"latency_s": 5e-6, "bandwidth_bytes_s": 100e9}
    for impl in ("meshlab", "ulysses", "chunked", "torch"):
        total, exposed = context_parallel_seconds_of(impl, attention_s=1.0, **link)
        assert total > 0 and exposed == (0.0 if impl == "torch" else total), impl


def context_parallel_seconds_of(impl: str, **kw: float) -> tuple[float, float]:
    from meshlab.plan.context_formulas import context_parallel_seconds

    return context_parallel_seconds(impl, **kw, **_shape(4))  # type: ignore[arg-type]


def test_the_planner_speaks_the_rank_sides_vocabulary() -> None:
    """The planner (pure Python) names the options ParallelPlan and build_optimizer take."""
    from meshlab.parallel import context, optimizers, precision
    from meshlab.plan import context_formulas, formulas, layout

    assert set(optimizers.OPTIMIZERS) == set(formulas.OPTIMIZER_KINDS)
    assert ("none", *precision.QAT_SCHEMES) == layout.QAT_SCHEMES
    assert set(context.IMPLEMENTATIONS) - {"auto"} <= set(context_formulas.CP_IMPLEMENTATIONS)
