"""The planner's software facts (fused kernels, async TP, blocking pipeline sends, fp32
gradient reduction, torchtitan's per-op checkpointing, the attention kernel, fp8's reach,
load-balanced context parallelism) counted by hand on TINY, and the search on today's
hardware."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshlab.dry_run.plan import plan_for
from meshlab.plan import HARDWARE, MODELS, Layout, estimate, gemm, search
from meshlab.plan.compute import (
    EAGER_RMSNORM_PASSES,
    LAYER_NORM_PASSES,
    attention_gemms,
    attention_seconds,
    memory_bound_bytes,
    output_parts,
)
from meshlab.plan.estimate import Estimate, term_differences
from meshlab.plan.formulas import layer_activation_bytes, op_recomputed_params
from meshlab.plan.hardware import GH100_ATTENTION, GH100_HELD_OVER_BURST, load, save
from meshlab.plan.stage import Stage
from tests.rank.test_plan import COMPUTE_BOUND, PIPE, TINY, TINY_PARAMS, TOY


def test_fused_kernels_move_each_tensor_once_per_region() -> None:
    # TINY per token and layer (h 64, q 64, kv 32, ffn 128): eager 4,448 values (test_plan);
    # fused: add + norm twice 8h = 512, RoPE 2(q + kv) = 192, attention I/O 2q + 2kv = 192,
    # SwiGLU 3 ffn = 384 -> 1,280; forward + backward x3, 2 bytes, 64 tokens
    eager = memory_bound_bytes(Stage(TINY, Layout(), TOY))
    fused = memory_bound_bytes(Stage(TINY, Layout(fused=True), TOY))
    assert (eager, fused) == (3 * 4448 * 2 * 64, 3 * 1280 * 2 * 64)


def test_an_eager_rmsnorm_costs_what_the_h100_measured_and_a_layernorm_less() -> None:
    # docs/guides/gpu.md: the eager RMSNorm took 0.528 ms on 8,192 x 4,096 bf16 rows, 2.001
    # on 8,192 x 16,384, at a 2,980 GB/s copy rate: 23.4 and 22.2 passes of the rows
    for ms, width in ((0.528, 4096), (2.001, 16384)):
        passes = ms * 1e-3 / (8192 * width * 2 / 2980e9)
        assert abs(passes - EAGER_RMSNORM_PASSES) < 1.0
    gpt = dataclasses.replace(TINY, layer_norm=True)
    rms, layer = (memory_bound_bytes(Stage(m, Layout(), TOY)) for m in (TINY, gpt))
    # two norms a layer, forward and backward (x3), 2 bytes, 64 tokens
    assert rms - layer == 2 * (EAGER_RMSNORM_PASSES - LAYER_NORM_PASSES) * 64 * 3 * 2 * 64
    fused = {memory_bound_bytes(Stage(m, Layout(fused=True), TOY)) for m in (TINY, gpt)}
    assert len(fused) == 1  # fused, a norm is one pass in and out either way


def test_a_transformers_models_norm_is_read_from_its_modules() -> None:
    transformers = pytest.importorskip("transformers", reason="a test dependency")
    from meshlab.dry_run.plan import shape_of

    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    phi = transformers.PhiForCausalLM(transformers.PhiConfig(**tiny))  # LayerNorm
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny))  # RMSNorm
    shapes = [shape_of(phi), shape_of(llama)]
    assert [s.layer_norm for s in shapes if s is not None] == [True, False]


def test_async_tp_exposes_only_what_the_gemms_cannot_hide() -> None:
    sync = estimate(TINY, Layout(tp=2, dp_shard=1), TOY)
    te = estimate(TINY, Layout(tp=2, dp_shard=1, async_tp=True, async_tp_impl="te"), TOY)
    assert {c.overlapped for c in sync.collectives if c.axis == "tp"} == {False}
    assert {c.overlapped for c in te.collectives if c.axis == "tp"} == {True}
    tp = sum(c.seconds for c in sync.collectives if c.axis == "tp")
    assert sync.exposed_by_axis["tp"] == pytest.approx(tp, rel=1e-12)
    # TOY's TP collectives take ~20 us a layer, its GEMMs far more: all hidden (no overlap
    # cost on TOY)
    assert te.exposed_by_axis.get("tp", 0.0) == 0.0
    assert te.step_s == pytest.approx(sync.step_s - tp, rel=1e-9)


def test_torchs_async_tp_leaves_the_backwards_summed_reduce_scatters_exposed() -> None:
    # torch.compile's micro-pipeline TP fuses a reduce-scatter with the one matmul feeding
    # it; the backward's of the attention's and the MLP's input gradients (q + k + v, gate +
    # up) have several: those two of the layer's ten collectives (eight, and the
    # backward's two re-gathers) stay on the critical path
    lay = Layout(tp=2, dp_shard=1, async_tp=True)
    assert lay.async_tp_impl == "torch" and "async_tp_impl" not in lay.describe()
    torch_tp = estimate(TINY, lay, TOY)
    exposed = [c for c in torch_tp.collectives if c.axis == "tp" and not c.overlapped]
    assert {(c.collective, c.what) for c in exposed} == {
        ("reduce_scatter", "TP reduce_scatter of activation gradients")}
    assert exposed[0].calls == 2 * TINY.layers
    assert torch_tp.exposed_by_axis["tp"] == pytest.approx(exposed[0].seconds, rel=1e-12)
    assert Layout.parse("tp=2 async_tp=1 async_tp_impl=te").describe().endswith(
        "async_tp=1 async_tp_impl=te")
    with pytest.raises(ValueError, match="async_tp_impl must be one of torch, te, got 'nccl'"):
        Layout(async_tp_impl="nccl")


def test_reduce_once_reduce_scatters_accumulated_gradients_once_a_step() -> None:
    # meshlab's accumulation and Megatron's distributed optimizer: gradients accumulate
    # unsharded over the micro-batches and are reduce-scattered once (the default);
    # FSDP2's own default reduces after every backward (reduce_once=0)
    once = estimate(TINY, Layout(dp_shard=4, zero=2, microbatches=4, reduce_fp32=True), TOY)
    every = estimate(TINY, dataclasses.replace(once.layout, reduce_once=False), TOY)

    def scatters(e: Estimate) -> int:
        return sum(c.calls for c in e.collectives
                   if c.what == "FSDP reduce-scatter of gradients")

    assert scatters(every) == 4 * scatters(once) == 4 * TINY.layers
    # the unsharded gradients wait in a buffer, in the dtype they are reduced in (fp32 here)
    assert once.memory["buffers"] - every.memory["buffers"] == pytest.approx(TINY_PARAMS * 4)
    assert every.memory["grads"] == pytest.approx(TINY_PARAMS * 2 / 4)
    assert "reduce_once" not in once.layout.describe()
    assert "reduce_once=0" in every.layout.describe().split()
    assert Layout.parse("dp=4 zero=2 reduce_once=0") == dataclasses.replace(
        Layout(dp_shard=4, zero=2), reduce_once=False)
    # one micro-batch: nothing accumulates, the gradients stay sharded
    single = estimate(TINY, Layout(dp_shard=4, zero=2, reduce_fp32=True), TOY)
    assert single.memory["grads"] == pytest.approx(TINY_PARAMS * 2 / 4)


def test_blocking_pipeline_sends_stall_each_chunk_both_ways() -> None:
    lay = Layout(pp=2, microbatches=4)
    free = estimate(PIPE, lay, TOY)
    blocked = estimate(PIPE, dataclasses.replace(lay, overlap_p2p=False), TOY)
    (send,) = [c for c in blocked.collectives if c.axis == "pp"]
    hop = send.seconds / send.calls
    # 4 micro-batches, one chunk a rank: a forward send and a backward send each
    assert blocked.terms()["pp"] == pytest.approx(2 * 4 * hop, rel=1e-12)
    assert "pp" not in free.terms() and blocked.step_s > free.step_s


def test_fp32_reduction_doubles_the_gradient_bytes() -> None:
    lay = Layout(dp_shard=4, zero=0)
    (bf16,) = estimate(TINY, lay, COMPUTE_BOUND).collectives
    (fp32,) = estimate(TINY, dataclasses.replace(lay, reduce_fp32=True), COMPUTE_BOUND).collectives
    assert (bf16.nbytes, fp32.nbytes) == (2 * TINY_PARAMS, 4 * TINY_PARAMS)


def test_per_op_checkpointing_keeps_every_other_matmul_and_attention() -> None:
    # TINY's matmuls in order: q 64, k 32, v 32, o 64, w1 128, w3 128, w2 64 wide; kept: the
    # 1st, 3rd, 5th, 7th (q, v, w1, w2: 64 + 32 + 128 + 64) with the layer's input (64) and
    # attention's output (64): 416 values a token, 2 bytes each
    kept = layer_activation_bytes(seq=64, batch=1, hidden=64, heads=4, q_width=64,
                                  kv_width=32, ffn=128, gated=True, dropout=False,
                                  recompute="op")
    assert kept == 2 * 416 * 64
    # recomputed: k 64 x 32, o 64 x 64, w3 64 x 128 -> 14,336 weights, 2 FLOPs each a token
    assert op_recomputed_params(hidden=64, q_width=64, kv_width=32, ffn=128,
                                gated=True) == 14_336
    none, op = (estimate(TINY, Layout(recompute=r), TOY) for r in ("none", "op"))
    tokens = 64 * TINY.layers
    assert op.hardware_flops - none.hardware_flops == pytest.approx(2 * 14_336 * tokens)
    assert op.memory["activations"] < none.memory["activations"]


def test_the_search_finds_llama3s_own_layout_on_16384_h100s() -> None:
    # Dubey et al. 2024, Table 4, row 2: tp 8, pp 16 (126 layers and the two ends in 16 x 4
    # chunks), dp 128, 16M tokens a step
    best = search(MODELS["llama3-405b"], gpus=16384, hardware=HARDWARE["h100-sxm"],
                  global_batch=2048, top=1)["estimate"].iloc[0]
    assert best.layout.describe() == ("pp=16 dp_shard=128 tp=8 zero=2 interleaved_1f1b/v4 "
                                      "mbs=1 m=16")


def test_term_differences_name_what_separates_two_layouts() -> None:
    a = estimate(PIPE, Layout(pp=2, microbatches=4), TOY)
    b = estimate(PIPE, Layout(pp=2, microbatches=2, micro_batch=2), TOY)
    diffs = dict(term_differences(a, b, least=0.0))
    assert sum(diffs.values()) == pytest.approx(a.step_s - b.step_s, rel=1e-9)
    assert term_differences(a, a) == []


H100 = HARDWARE["h100-sxm"]
LLAMA8 = MODELS["llama3-8b"]


def test_fused_attention_runs_at_its_kernels_measured_rate() -> None:
    # pytorch/pytorch#142132 (H100 SXM, torch 2.6 nightly, Dec 2024): SDPA's flash backend
    # 329.5 TFLOP/s, cuDNN's 631.3, in short runs; held at the power cap as the matmul is
    assert GH100_HELD_OVER_BURST == 664 / 779
    measured = {"flash2": 329.483 / 989.5 * 664 / 779, "cudnn": 631.338 / 989.5 * 664 / 779}
    assert pytest.approx(measured) == GH100_ATTENTION
    # one layer's forward, one sequence of 8,192: QK^T and PV, 2 x 2 s^2 d flops per head,
    # half of the causal square skipped
    flops = 2 * 2 * 8192 * 8192 * 128 * 32
    for kernel, share in (("flash2", GH100_ATTENTION["flash2"]),
                          ("cudnn", GH100_ATTENTION["cudnn"]),
                          ("auto", GH100_ATTENTION["cudnn"])):  # torch's choice on Hopper
        got = attention_seconds(Stage(LLAMA8, Layout(attention_kernel=kernel), H100))
        assert got == pytest.approx(flops / 2 / (989.5e12 * share), rel=1e-12), kernel


def test_a_profile_without_a_kernels_rate_costs_attention_as_two_gemms() -> None:
    a100 = HARDWARE["a100-80gb"]
    slow_memory = dataclasses.replace(a100, memory_bandwidth_gbs=500)
    stage = Stage(LLAMA8, Layout(), slow_memory)
    products = attention_gemms(stage)
    # the scores never reach memory: only the arithmetic, at the GEMM model's rates, however
    # slow the memory (a GEMM writing s x s scores would be bound by it)
    by_hand = sum(gemm.compute_seconds(a100, g, "bf16") for g in products) / 2
    assert attention_seconds(stage) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand < sum(gemm.seconds(slow_memory, g, "bf16", 2) for g in products) / 2
    with pytest.raises(ValueError, match=r"no measured rate for it \(it has none\); use "
                                         "attention_kernel=auto"):
        estimate(LLAMA8, Layout(attention_kernel="cudnn", dp_shard=8), a100)
    with pytest.raises(ValueError, match="attention_kernel must be auto or one of flash2, "
                                         "cudnn, got 'fa3'"):
        Layout.parse("attention_kernel=fa3")


def test_a_profiles_attention_rates_save_and_load(tmp_path: Path) -> None:
    assert load(save(H100, tmp_path / "h100.toml")) == H100
    with pytest.raises(ValueError, match=r"attention_efficiency takes shares in \(0, 1\] for "
                                         "flash2, cudnn"):
        dataclasses.replace(H100, attention_efficiency={"fa3": 0.7})


def test_auto_costs_the_kernel_sdpa_picks_where_the_profile_names_it(tmp_path: Path) -> None:
    # a calibrated profile says which kernel SDPA runs by itself (an older torch on Hopper
    # ran FlashAttention-2 with cuDNN's measured beside it)
    flash_first = dataclasses.replace(H100, attention_default="flash2")
    auto, flash2 = (attention_seconds(Stage(LLAMA8, Layout(attention_kernel=k), hw))
                    for k, hw in (("auto", flash_first), ("flash2", H100)))
    assert auto == flash2 > attention_seconds(Stage(LLAMA8, Layout(), H100))
    assert load(save(flash_first, tmp_path / "flash-first.toml")) == flash_first
    with pytest.raises(ValueError, match="attention_default='cudnn' has no rate in "
                                         "attention_efficiency \\(flash2\\)"):
        dataclasses.replace(H100, attention_efficiency={"flash2": 0.3},
                            attention_default="cudnn")


def test_fp8_training_leaves_attention_and_the_output_in_bf16() -> None:
    # torchao's convert_to_float8_training swaps nn.Linear only; torchtitan skips "output"
    bf16, fp8 = (Stage(LLAMA8, Layout(precision=p), H100) for p in ("bf16", "fp8"))
    assert attention_seconds(fp8) == attention_seconds(bf16)
    assert output_parts(fp8) == output_parts(bf16)
    faster = estimate(LLAMA8, Layout(precision="fp8", dp_shard=8), H100)
    slower = estimate(LLAMA8, Layout(dp_shard=8), H100)
    assert faster.terms()["gemm"] < slower.terms()["gemm"]  # the blocks' Linears do speed up


def test_load_balanced_context_parallelism_has_no_last_rank_skew() -> None:
    # contiguous slices: the last of n ranks holds (n - 1/2)/n of its square, 2 - 1/n times
    # the mean; torch's context_parallel() cuts 2n chunks head-tail (enable_load_balance)
    long = dataclasses.replace(LLAMA8, seq_len=65536)
    for impl in ("meshlab", "torch"):
        flat, balanced = (attention_seconds(Stage(long, Layout.parse(
            f"cp=4 cp_impl={impl}" + extra), H100)) for extra in ("", " cp_balanced=1"))
        assert flat == pytest.approx((2 - 1 / 4) * balanced, rel=1e-12)
    lay = Layout.parse("cp=4 dp=2 cp_impl=torch cp_balanced=1")
    assert Layout.parse(lay.describe()) == lay and "cp_balanced=1" in lay.describe()
    # a dry run runs meshlab's contiguous slices, and says so
    _, notes = plan_for(lay, seq=64)
    assert any(n.startswith("cp_balanced: meshlab holds contiguous sequence slices") for n in notes)
    with pytest.raises(ValueError, match="cp_balanced with context_parallel=ulysses: only "
                                         "meshlab and torch slice the sequence contiguously"):
        Layout.parse("cp=2 cp_impl=ulysses cp_balanced=1")
