"""Published H100-era runs (2024-): Llama 3, torchtitan's tables, Megatron-Core's H100 table,
NeMo's and Megatron-Bridge's DGX-H100 tables."""

from __future__ import annotations

from dataclasses import replace

from meshlab.plan.hardware import HARDWARE
from meshlab.plan.published.run import (
    MEGATRON_CORE_TFLOPS,
    MODEL_TFLOPS,
    TOKENS_PER_GPU,
    PublishedRun,
)
from meshlab.plan.shapes import MODELS, ModelShape

# Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4 and section
# 3.3: H100 80 GB, 400 Gb/s RoCE per GPU, FSDP that does not reshard after the forward
# (zero=2 here), interleaved schedule with one layer removed from the first and the last
# stage, no activation checkpointing at 8K, BF16 MFU on 989 TFLOP/s.
_LLAMA3 = "Dubey et al. 2024 (arXiv 2407.21783)"


def _llama3() -> list[PublishedRun]:
    base = MODELS["llama3-405b"]
    long = ModelShape(**{**base.__dict__, "name": "llama3-405b-128k", "seq_len": 131072})
    rows = [(1, base, "tp=8 pp=16 dp=64", 2048, 430),
            (2, base, "tp=8 pp=16 dp=128", 2048, 400),
            (3, long, "tp=8 cp=16 pp=16 dp=8 cp_impl=all_gather", 128, 380)]
    runs = []
    for row, model, layout, batch, tflops in rows:
        runs.append(PublishedRun(
            f"Llama 3 405B, row {row}", f"{_LLAMA3}, Table 4, row {row}", model, "h100-sxm",
            f"{layout} zero=2 attention_kernel=flash2", batch, tflops, MODEL_TFLOPS,
            layer_slots=2,
            free=("micro_batch", "schedule", "virtual") + (("recompute",) if row == 3 else ()),
            assumed=("FlashAttention-2 (attention_kernel=flash2; not stated): the fused "
                     "kernel of the first half of 2024, when the model trained (torch's SDPA "
                     "ran it on Hopper; FlashAttention-3 came out with the paper)",
                     "schedule free between 1F1B and interleaved: Llama 3's interleaved "
                     "schedule tunes the micro-batches per round to fit memory (section "
                     "3.3.2); the planner's is Megatron's, which keeps more in flight",
                     "vocabulary 128,256 (the released one; the table says 128,000)")
            + (("dp=8: the table prints 4, but 16,384 GPUs and 16M tokens need 8",
                "recompute free: section 3.3 states none only for 8K sequences",
                "cp_impl=all_gather: section 3.3.2's all-gather of K and V in 2 x cp "
                "load-balanced chunks; the backward's reduce-scatter of their gradients is "
                "the all-gather's transpose (not stated)")
               if row == 3 else ("no recompute (section 3.3)",)),
            family="Llama 3"))
    return runs



def _with_seq(model: ModelShape, seq_len: int) -> ModelShape:
    return replace(model, name=f"{model.name}-{seq_len // 1024}k", seq_len=seq_len)


# torchtitan's published H100 tables: benchmarks/llama3_h100_202412_torchtitan.md (written as
# docs/performance.md in d4c86e37, measured with torchtitan 9dec370, torch 1963fc8, Dec 2024)
# and benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (820504e2, June 2025). Not the
# paper's tables (arXiv 2410.06511, a different measurement, not readable here).
_TITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ b5bcd76c"
_TITAN_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @ b5bcd76c"
GRAND_TETON_H100 = replace(
    HARDWARE["h100-sxm"], name="h100-hbm2e-500w", memory_gib=94.0, memory_bandwidth_gbs=2400,
    tflops={"fp32": 61, "tf32": 456, "bf16": 912, "fp8": 1824})
"""torchtitan's Grand Teton H100s, as its table states them: "96GB HBM2e with 2.4 TB/sec",
"400 Gb/s per GPU", "the default 500W power limit"; "the actual peak TFLOPs number is between
SXM and NVL, and we don't know its exact value": taken midway (989.5 and 835 TFLOP/s bf16),
an assumption; 96 GB is 94 GiB as the device reports it less its reserve."""
_TITAN_FACTS = ("gradients reduced in fp32 (reduce_fp32: torchtitan's only "
                "--training.mixed_precision_reduce)",
                "sequence 8,192 (not printed; the shipped train_configs at 9dec370)",
                "async TP, where on, is torch.compile's micro-pipeline TP (async_tp_impl="
                "torch): Llama's wq/wk/wv and w1/w3 are separate Linears, so the backward's "
                "reduce-scatters of their summed input gradients are not fused "
                "(torch/_inductor/fx_passes/micro_pipeline_tp.py: _find_producer_matmul)",
                "attention_kernel=flash2: SDPA's flash backend (FlashAttention-2), the default "
                "of December 2024's torch (cuDNN was opt-in: pytorch#138522); with CP "
                "torchtitan pins FLASH_ATTENTION/EFFICIENT_ATTENTION (utils.get_train_context "
                "@ 9dec370)", "FSDP reshards after the forward "
                "(torchtitan's default: zero=3)", "Grand Teton peak taken midway between H100 "
                "SXM and NVL (the table says it is between them)")
_FA2 = "attention_kernel=flash2"
_TORCH_SP = ("sp_regather=0: torch's sequence parallelism (torchtitan's TP plan: "
             "PrepareModuleInput to Replicate, then ColwiseParallel) keeps the gathered input "
             "for the weights' gradients and gathers nothing again in the backward")
_FP8 = ("Float8 (torchao, dynamic tensorwise: torchtitan's default) on every Linear but the "
        "output (float8.py @ 9dec370: fqn != \"output\"); attention in bf16")
_TORCH_CP = ("CP is torch's ring attention through context_parallel(), as torchtitan calls "
             "it: head-tail load-balanced (cp_balanced; torch's _ContextParallelOptions."
             "enable_load_balance defaults to True)")


def _torchtitan() -> list[PublishedRun]:
    llama8, llama70, llama405 = MODELS["llama3-8b"], MODELS["llama3-70b"], MODELS["llama3-405b"]
    rows: list[tuple[str, ModelShape, str, int, float, tuple[str, ...], tuple[str, ...]]] = []
    for table, gpus, figures in (("Table 1", 8, (5762, 6667, 8532)),
                                 ("Table 3", 128, (5605, 6514, 8380))):
        for variant, extra, tps in zip(("FSDP", "FSDP + torch.compile",
                                        "FSDP + torch.compile + Float8"),
                                       ("", " fused=1", " fused=1 precision=fp8"), figures,
                                       strict=True):
            rows.append((f"{table} {variant}", llama8,
                         f"dp={gpus} zero=3 mbs=2 ac=op reduce_fp32=1{extra}", 2 * gpus,
                         tps, (), ("selective: the configs' per-op SAC (selective_ac_option "
                                   "'op'), ac=op",) + ((_FP8,) if "fp8" in extra else ())))
    for variant, extra, tps in (("2D", "", 829), ("2D + AsyncTP", " async_tp=1", 876)):
        rows.append((f"Table 4 {variant}", llama70, "dp=32 tp=8 zero=3 mbs=16 ac=full fused=1 "
                     f"precision=fp8 reduce_fp32=1 sp_regather=0{extra}", 512, tps, (),
                     (_FP8, _TORCH_SP)))
    for variant, sched, tps in (("1F1B", "schedule=1f1b", 100),
                                ("Interleaved 1F1B", "schedule=interleaved_1f1b v=2", 128)):
        rows.append((f"Table 5 {variant}", llama405, "pp=8 dp=8 tp=8 zero=3 mbs=4 ac=full "
                     f"fused=1 precision=fp8 async_tp=1 reduce_fp32=1 sp_regather=0 {sched}",
                     256, tps, (),
                     (_FP8, _TORCH_SP, "8 micro-batches of 4 (the default: as many as stages)",
                      "2 stages per rank interleaved (the default)",
                      "126 layers in stages of 8 or 16 with the embedding and output counted")))
    for fsdp, cp, tps in ((8, 1, 3890), (4, 2, 2540), (2, 4, 1071), (1, 8, 548)):
        rows.append((f"Table 2 FSDP {fsdp}, CP {cp}", _with_seq(llama8, 32768 * cp),
                     f"dp={fsdp} cp={cp} cp_impl=torch cp_balanced=1 zero=3 mbs=1 ac=full "
                     "fused=1 precision=fp8 reduce_fp32=1", fsdp, tps, (),
                     (_FP8, _TORCH_CP,
                      "the global batch: local batch 1 on each FSDP rank")))
    for fsdp, cp, tps in ((8, 1, 76), (4, 2, 47), (2, 4, 31), (1, 8, 16)):
        rows.append((f"Table 6 FSDP {fsdp}, CP {cp}", _with_seq(llama405, 32768 * cp),
                     f"pp=8 dp={fsdp} cp={cp} tp=8 cp_impl=torch cp_balanced=1 zero=3 mbs=1 "
                     "ac=full fused=1 precision=fp8 async_tp=1 reduce_fp32=1 sp_regather=0 "
                     "schedule=1f1b", 8 * fsdp, tps, (),
                     (_FP8, _TORCH_CP, _TORCH_SP,
                      "8 micro-batches of 1 (the default: as many as stages)",
                      "the global batch: local batch 8 on each FSDP rank")))
    runs = [PublishedRun(f"torchtitan {model.name} {what}", f"{_TITAN}, {what}", model,
                         GRAND_TETON_H100, f"{layout} {_FA2}", batch, tps, TOKENS_PER_GPU,
                         free=free,
                         assumed=(*_TITAN_FACTS, *assumed), family="torchtitan 2024",
                         layer_slots=2 if "pp=" in layout else 0)
            for what, model, layout, batch, tps, free, assumed in rows]
    for variant, extra, rate in (("vanilla TP", "", 597.3), ("async TP", " async_tp=1", 652.4)):
        runs.append(PublishedRun(
            f"torchtitan llama3-70b bf16, {variant}",
            f"{_TITAN_ASYNC}, Table \"Llama3 70b on 256 H100s\", row None (bfloat16)",
            llama70, GRAND_TETON_H100,
            f"dp=32 tp=8 zero=3 mbs=16 ac=full fused=1 reduce_fp32=1{extra} {_FA2} "
            "sp_regather=0", 512, rate, TOKENS_PER_GPU, assumed=(*_TITAN_FACTS, _TORCH_SP),
            family="torchtitan 2024"))
    return runs


# Megatron-LM's README, "Performance Benchmarking": images/model_table.png (commit f2e5db40,
# 2024-07-15, Megatron-Core r0.8.0 on H100): GPTs of 1.7B to 462B, vocabulary 131,072,
# sequence 4,096, "--overlap-grad-reduce, --overlap-param-gather (DP), --tp-comm-overlap (TP),
# and PP (enabled by default)", MFU on 989 TFLOP/s (a maintainer, NVIDIA/Megatron-LM#1276).
_MCORE = "NVIDIA/Megatron-LM README.md images/model_table.png @ f2e5db40"
_MCORE_TABLE = [  # (name, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU)
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
]


def _megatron(tp: int, pp: int, cp: int, dp: int, vp: int = 1,
              optimizer: str = "zero=2 reduce_once=1") -> str:
    """A Megatron-Core run with Transformer Engine, as the planner reads it: its distributed
    optimizer (sharded states, accumulated gradients reduce-scattered once a step), TE's
    fused kernels and cuDNN attention, TP overlapped by TE's userbuffers, CP as ring
    attention over head-tail chunks, interleaving when there are virtual stages."""
    return (f"tp={tp} pp={pp} cp={cp} dp={dp} {optimizer} fused=1 attention_kernel=cudnn"
            + (" async_tp=1 async_tp_impl=te" if tp > 1 else "")
            + (" cp_impl=torch cp_balanced=1" if cp > 1 else "")
            + (f" schedule=interleaved_1f1b v={vp}" if vp > 1 else ""))


def _mcore_run(name: str, source: str, model: ModelShape, tp: int, pp: int, dp: int,
               batch: int, tflops: float) -> PublishedRun:
    free = ("micro_batch", "recompute") + (("schedule", "virtual") if pp > 1 else ())
    return PublishedRun(
        name, source, model, "h100-sxm",
        f"{_megatron(tp, pp, 1, dp)} reduce_fp32=1", batch, tflops, MEGATRON_CORE_TFLOPS, free=free,
        assumed=("bf16 (MFU divides by the bf16 peak)", "DGX H100 nodes (not stated)",
                 "the distributed optimizer (--overlap-param-gather needs it): zero=2 "
                 "reduce_once=1, its fp32 gradients unsharded and reduce-scattered once a "
                 "step (the README's \"Distributed Optimizer\": with bf16 parameters \"the "
                 "grads in this case are not distributed\")",
                 "gradients reduced in fp32 (Megatron's arguments.py forces it with bf16)",
                 "Transformer Engine's fused kernels; attention cuDNN's fused kernel, TE's "
                 "choice on Hopper (attention_kernel=cudnn; not stated)",
                 "--tp-comm-overlap through Transformer Engine's userbuffers, which "
                 "overlap every TP collective (async_tp_impl=te)",
                 "a GPT with a 4h MLP, untied embeddings, no dropout (not stated; the "
                 "parameter counts fit)", "the logged FLOP count (not stated)"),
        family="Megatron-Core 2024")


def _mcore_gpt(size: str, heads: int, hidden: int, layers: int) -> ModelShape:
    return ModelShape(name=f"mcore-gpt-{size.lower()}", layers=layers, hidden=hidden,
                      heads=heads, ffn=4 * hidden, vocab=131072, seq_len=4096,
                      gated_ffn=False, layer_norm=True)


def _megatron_core() -> list[PublishedRun]:
    return [_mcore_run(f"Megatron-Core GPT {size}, {gpus:,} GPUs",
                       f"{_MCORE}, Table, row {row} ({size})",
                       _mcore_gpt(size, heads, hidden, layers), tp, pp, gpus // (tp * pp),
                       batch, tflops)
            for row, (size, heads, hidden, layers, tp, pp, gpus, batch, tflops)
            in enumerate(_MCORE_TABLE, 1)]


# The same README's strong scaling of its 177B GPT (images/strong_scaling.png @ f2e5db40:
# "from 96 H100 GPUs to 4608 GPUs, using the same batch size of 1152 sequences"; MFU 47% ->
# 42%). The plot prints no figures: each dot's centre is read against the log-log gridlines
# (fitted to 0.5%), aggregate petaFLOP/s over its GPUs; the 2,304-GPU dot reads 434.6 TFLOP/s
# a GPU where the table's 177B row prints 432.8. The plot names no layout: the table's tp 8 x
# pp 6 is assumed (every count is 48 x dp). Not in RUNS: a check of how the optimism moves
# with scale, not another row of the table.
_MCORE_STRONG = [(96, 461.5), (144, 461.1), (288, 458.7), (576, 455.7), (1152, 448.2),
                 (2304, 434.6), (3072, 424.7), (4608, 413.5)]  # (GPUs, TFLOP/s per GPU)
MCORE_STRONG_SCALING: list[PublishedRun] = [
    _mcore_run(f"Megatron-Core GPT 177B strong scaling, {gpus:,} GPUs",
               f"NVIDIA/Megatron-LM README.md images/strong_scaling.png @ f2e5db40, dot at "
               f"{gpus:,} GPUs (read off the plot)", _mcore_gpt("177B", 96, 12288, 96),
               8, 6, gpus // 48, 1152, tflops)
    for gpus, tflops in _MCORE_STRONG]
"""Megatron-Core's 177B from 96 to 4,608 H100s at one batch, as its README plots it."""


# NeMo 24.07's DGX-H100 FP8 table: NVIDIA/NeMo docs/source/performance/performance_summary.md
# @ 0b8a80ee ("Container: NeMo24.07. System: DGX-H100"), the Llama rows; every degree, the
# micro-batch and the virtual stages printed, DP the GPUs left. Llama 2 shapes as Meta
# released them (vocabulary 32,000).
_NEMO = "NVIDIA/NeMo docs/source/performance/performance_summary.md @ 0b8a80ee"
_LLAMA2 = {"7b": ModelShape(name="llama2-7b", layers=32, hidden=4096, heads=32, ffn=11008,
                            vocab=32000, seq_len=4096),
           "13b": ModelShape(name="llama2-13b", layers=40, hidden=5120, heads=40, ffn=13824,
                             vocab=32000, seq_len=4096),
           "70b": ModelShape(name="llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8,
                             ffn=28672, vocab=32000, seq_len=4096)}

# The table's GPT-3 and Nemotron rows, as NeMo's own model configs at the same commit define
# them (nemo/collections/llm/gpt/model/base.py GPTConfig5B/20B/175B, nemotron.py
# Nemotron3Config8B/22B, Nemotron4Config340B): GPT-3 with a 4h GELU MLP, LayerNorm, learned
# positions, tied embeddings, Megatron's 0.1 dropout (none at 175B) and GPT-2's vocabulary
# (50,257, padded); Nemotron with a squared-ReLU MLP, LayerNorm, RoPE and 256,000 tokens.
def _gpt3(size: str, layers: int, hidden: int, heads: int, dropout: bool) -> ModelShape:
    return ModelShape(name=f"nemo-gpt3-{size}", layers=layers, hidden=hidden, heads=heads,
                      ffn=4 * hidden, vocab=50304, seq_len=2048, gated_ffn=False,
                      layer_norm=True, tied_embeddings=True, learned_positions=True,
                      dropout=dropout)


def _nemotron(size: str, layers: int, hidden: int, heads: int, kv_heads: int | None,
              ffn: int) -> ModelShape:
    return ModelShape(name=f"nemotron-{size}", layers=layers, hidden=hidden, heads=heads,
                      kv_heads=kv_heads, ffn=ffn, vocab=256000, seq_len=4096,
                      gated_ffn=False, layer_norm=True)


_NEMO_TABLE = [  # (model, GPUs, GBS, MBS, TP, PP, CP, VP, tokens/s per GPU)
    (_LLAMA2["7b"], 8, 128, 1, 1, 1, 1, 1, 16934), (_LLAMA2["13b"], 16, 128, 1, 1, 4, 1, 10, 8715),
    (_LLAMA2["70b"], 64, 128, 1, 4, 4, 1, 20, 1728),
    (MODELS["llama3-8b"], 8, 128, 1, 1, 1, 2, 1, 12273),
    (MODELS["llama3-70b"], 64, 128, 1, 4, 4, 2, 5, 1524),
    (_gpt3("5b", 24, 4096, 32, True), 64, 2048, 4, 1, 1, 1, 1, 23406),
    (_gpt3("20b", 44, 6144, 48, True), 64, 256, 2, 2, 1, 1, 1, 5851),
    (_gpt3("175b", 96, 12288, 96, False), 128, 256, 1, 4, 8, 1, 6, 716),
    (_gpt3("175b", 96, 12288, 96, False), 512, 2048, 2, 4, 8, 1, 6, 825),
    (_nemotron("8b", 32, 4096, 32, None, 16384), 64, 256, 4, 2, 1, 1, 1, 12507),
    (_nemotron("22b", 40, 6144, 48, None, 24576), 64, 256, 2, 2, 4, 1, 10, 4312),
    (_nemotron("340b", 96, 18432, 96, 8, 73728), 128, 32, 1, 8, 8, 1, 12, 326),
]


def _nemo() -> list[PublishedRun]:
    runs = []
    for model, gpus, batch, mbs, tp, pp, cp, vp, tps in _NEMO_TABLE:
        dp = gpus // (tp * pp * cp)
        runs.append(PublishedRun(
            f"NeMo 24.07 {model.name}, {gpus} GPUs", f"{_NEMO}, Table (FP8), row {model.name}",
            model, "h100-sxm", f"{_megatron(tp, pp, cp, dp, vp)} mbs={mbs} precision=fp8",
            batch, tps, TOKENS_PER_GPU, free=("recompute",),
            assumed=("Megatron-Core with Transformer Engine: fused kernels, the distributed "
                     "optimizer (zero=2 reduce_once=1: it shards the optimizer's states and "
                     "reduce-scatters the accumulated gradients once a step), overlapped "
                     "data-parallel traffic",
                     "attention in cuDNN's fused kernel, TE's choice on Hopper "
                     "(attention_kernel=cudnn; not printed)",
                     "TP communication overlapped by Transformer Engine's userbuffers "
                     "(NeMo's performance configs, async_tp_impl=te; not printed)",
                     "FP8 on every Linear at the float8 training rate measured with torchao "
                     "(Transformer Engine's own casts not measured)",
                     "CP as ring attention (Transformer Engine's) over Megatron's 2 x cp "
                     "head-tail chunks (get_batch_on_this_cp_rank: cp_balanced)",
                     "recompute not printed"),
            family="NeMo 24.07"))
    return runs


# Megatron-Bridge's DGX-H100 Llama rows (NeMo containers 25.09 and 26.04/26.04.01), from its
# performance summary archive; each run's settings are its perf recipe's
# (scripts/performance/... at the release branches' cherry-picks r0.1.0 @ a2884419 and
# r0.4.0 @ 2b82f6f1): FP8 current scaling on every layer (first_last_layers_bf16 = False),
# no recompute, the distributed optimizer with overlapped gradient reduce and parameter
# gather, gradients reduced in bf16 (grad_reduce_in_fp32 = False), Transformer Engine's TP
# overlap (userbuffers) with sequence parallelism, TE's fused cross-entropy, no CUDA graphs;
# the 8B in Megatron-FSDP ("optim_grads_params": zero=3, reducing every micro-step). The
# 26.04.01 70B row (1,664 tokens/s, 731 TFLOP/s) disagrees with itself under the recipe's
# own FLOP count (1,664 gives ~747): 26.04's row (1,633 and 734, which agree) stands for it.
_BRIDGE = ("NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @ "
           "067f987df03b8355b03192d88d70f1709fedf51a")
_BRIDGE_TABLE = [  # (container, model, GPUs, GBS, TP, PP, CP, VP, FSDP, tokens/s per GPU)
    ("25.09", "llama3-8b", 8, 128, 1, 1, 1, 1, True, 14079),
    ("25.09", "llama3-70b", 64, 128, 4, 8, 1, 5, False, 1619),
    ("25.09", "llama3-405b", 1024, 512, 8, 8, 2, 8, False, 302),
    ("26.04", "llama3-70b", 64, 256, 4, 8, 1, 5, False, 1633),
    ("26.04.01", "llama3-405b", 1024, 1536, 8, 8, 2, 8, False, 328),
]


def _megatron_bridge() -> list[PublishedRun]:
    runs = []
    for container, name, gpus, batch, tp, pp, cp, vp, fsdp, tps in _BRIDGE_TABLE:
        dp = gpus // (tp * pp * cp)
        optimizer = "zero=3 reduce_once=0" if fsdp else "zero=2 reduce_once=1"
        layout = f"{_megatron(tp, pp, cp, dp, vp, optimizer)} mbs=1 ac=none precision=fp8"
        slots = 2 if "405b" in name else 0
        runs.append(PublishedRun(
            f"Megatron-Bridge {container} {name}, {gpus:,} GPUs",
            f"{_BRIDGE}, Table \"{container} NeMo Container\", row {name} DGX-H100",
            MODELS[name], "h100-sxm", layout, batch, tps, TOKENS_PER_GPU, layer_slots=slots,
            assumed=("DGX H100 nodes at their default clocks (vboost not recorded)",
                     "FP8 at the float8 training rate measured with torchao (Transformer "
                     "Engine's own casts not measured)",
                     "attention in cuDNN's fused kernel (25.09 enables it, 26.04 leaves TE "
                     "its choice)",
                     "CP as ring attention over Megatron's head-tail chunks (cp_balanced)")
            + (("126 layers on 64 virtual stages with the embedding and the loss counted "
                "as a layer each (the only even split)",) if slots else ()),
            family="Megatron-Bridge 2025-26"))
    return runs


RUNS: list[PublishedRun] = [*_llama3(), *_torchtitan(), *_megatron_core(), *_nemo(),
                            *_megatron_bridge()]
