"""Published A100-era runs (2021-24): Megatron-LM's papers, MegaScale's baseline, BLOOM and
GLM-130B."""

from __future__ import annotations

from dataclasses import replace

from meshlab.plan.hardware import HARDWARE, Link
from meshlab.plan.published.run import HARDWARE_TFLOPS, STEP, PublishedRun
from meshlab.plan.shapes import ModelShape


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelShape:
    """A Megatron GPT: 4h GELU MLP, tied embeddings, learned positions, dropout, sequence
    2,048."""
    return ModelShape(name=name, layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden,
                      vocab=vocab, seq_len=2048, gated_ffn=False, tied_embeddings=True,
                      learned_positions=True, dropout=True, layer_norm=True)


GPT_175B = _gpt("gpt-175b", 96, 12288, 96)
GPT_530B = _gpt("gpt-530b", 105, 20480, 128)
GPT_1T = _gpt("gpt-1t", 128, 25600, 160)

# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC21, arXiv 2104.04473). Selene: DGX A100 80 GB, 8 x 200 Gb/s HDR per node.
# Section 5.1: interleaved schedule (depth not given), V = 51,200, s = 2,048; eq. 3 counts
# full activation recomputation; 2021 Megatron: plain data parallelism (no distributed
# optimizer), no sequence parallelism, no FlashAttention.
_NARAYANAN = "Narayanan et al. 2021 (arXiv 2104.04473)"
_MEGATRON_2021 = ("zero=0: data parallelism without a distributed optimizer (2021 Megatron)",
                  "gradients all-reduced after the backward (--overlap-grad-reduce came in "
                  "2023)", "no FlashAttention, no sequence parallelism (both later)",
                  "pipeline sends and receives block their stage (--overlap-p2p-communication "
                  "came in 2023)")
_MEGATRON_KERNELS = "fused=1: section 4.2's fused bias + GeLU, bias + dropout + add and " \
    "scale + mask + softmax kernels (and apex's fused LayerNorm)"
_T1 = [  # (billions, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s)
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def _table1() -> list[PublishedRun]:
    runs = []
    for row, (b, heads, hidden, layers, tp, pp, gpus, batch, tflops) in enumerate(_T1, 1):
        dp = gpus // (tp * pp)
        pipe = " schedule=interleaved_1f1b" if pp > 1 else ""
        runs.append(PublishedRun(
            f"GPT {b}B, {gpus:,} GPUs", f"{_NARAYANAN}, Table 1, row {row} ({b}B)",
            _gpt(f"gpt-{b}b", layers, hidden, heads), "a100-80gb",
            f"tp={tp} pp={pp} dp={dp} zero=0 ac=full sp=0 flash_attention=0 fused=1 "
            "overlap_grad_reduce=0 overlap_p2p=0" + pipe, batch,
            tflops, HARDWARE_TFLOPS,
            free=("micro_batch", "virtual") if pp > 1 else ("micro_batch",),
            assumed=(*_MEGATRON_2021, _MEGATRON_KERNELS), family="Megatron-LM 2021"))
    return runs


def _table2() -> list[PublishedRun]:
    """Table 2: PTD-P (model-parallel size 96 = tp 8 x pp 12 for 175B, 280 = tp 8 x pp 35 for
    530B, from sections 5.3.2 and Table 1) beside ZeRO-3 without model parallelism."""
    runs = []
    ptdp = [(GPT_175B, 8, 12, 1536, (384, 153), (768, 149), (1536, 141)),
            (GPT_530B, 8, 35, 2240, (560, 171), (1120, 167), (2240, 159))]
    for row, (model, tp, pp, batch, *cases) in enumerate(ptdp):
        for i, (gpus, tflops) in enumerate(cases):
            runs.append(PublishedRun(
                f"{model.name} PTD-P, {gpus:,} GPUs",
                f"{_NARAYANAN}, Table 2, PTD-P row {3 * row + i + 1}", model, "a100-80gb",
                f"tp={tp} pp={pp} dp={gpus // (tp * pp)} zero=0 ac=full sp=0 "
                "flash_attention=0 fused=1 overlap_grad_reduce=0 overlap_p2p=0 mbs=1 "
                "schedule=interleaved_1f1b", batch,
                tflops,
                HARDWARE_TFLOPS, free=("virtual",),
                assumed=(*_MEGATRON_2021, _MEGATRON_KERNELS,
                         "tp 8 x pp 12 (175B), tp 8 x pp 35 (530B): the "
                         "table gives only their product"), family="Megatron-LM 2021"))
    zero3 = [(GPT_175B, 1536, 384, 4, 144), (GPT_175B, 1536, 768, 2, 88),
             (GPT_175B, 1536, 1536, 1, 44), (GPT_530B, 2560, 640, 4, 138),
             (GPT_530B, 2240, 1120, 2, 98), (GPT_530B, 2240, 2240, 1, 48)]
    for row, (model, batch, gpus, mbs, tflops) in enumerate(zero3, 1):
        runs.append(PublishedRun(
            f"{model.name} ZeRO-3, {gpus:,} GPUs", f"{_NARAYANAN}, Table 2, ZeRO-3 row {row}",
            model, "a100-80gb", f"dp={gpus} zero=3 shard_unit=weight ac=full flash_attention=0 "
            f"mbs={mbs}", batch, tflops, HARDWARE_TFLOPS,
            assumed=("DeepSpeed ZeRO-3 with activation checkpointing (the FLOP count, eq. 3, "
                     "assumes it), gathering weight by weight", "no FlashAttention (2021)"),
            family="Megatron-LM 2021"))
    return runs


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
# (MLSys 2023, arXiv 2205.05198), Tables 3 and 5: no data parallelism, s = 2,048,
# V = 51,200, interleaved with 3 stages per rank for 175B and 530B (section 6).
_KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198)"


def _korthikanti() -> list[PublishedRun]:
    rows = [  # (model, pp, batch, mbs, v, full recompute s, present work s)
        (_gpt("gpt-22b", 48, 6144, 64), 1, 4, 4, 1, 1.42, 1.10),
        (GPT_175B, 8, 64, 1, 3, 18.13, 13.75),
        (GPT_530B, 35, 280, 1, 3, 49.05, 37.83),
        (GPT_1T, 64, 512, 1, 0, 94.42, 71.49),
    ]
    runs = []
    for row, (model, pp, batch, mbs, v, full_s, present_s) in enumerate(rows, 1):
        gpus = 8 * pp
        pipe = "" if pp == 1 else " schedule=interleaved_1f1b" + (f" v={v}" if v else "")
        free = ("virtual",) if pp > 1 and not v else ()
        for variant, layout, seconds in (
                ("full recompute", "ac=full sp=0", full_s),
                ("selective + SP", "ac=selective sp=1", present_s)):
            runs.append(PublishedRun(
                f"{model.name} {variant}, {gpus} GPUs",
                f"{_KORTHIKANTI}, Tables 3 and 5, row {row} ({variant})", model, "a100-80gb",
                f"tp=8 pp={pp} zero=0 mbs={mbs} flash_attention=0 fused=1 overlap_p2p=0 "
                f"{layout}{pipe}", batch,
                seconds, STEP, free=free,
                assumed=("Megatron's fused kernels (Narayanan et al. 2021, section 4.2)",
                         "pipeline sends and receives block their stage (2022 Megatron)",
                         "no FlashAttention (the selective recompute it introduces is of "
                         "the unfused attention core)",)
                + (("1T: interleaving depth not given",) if free else ()),
                family="Korthikanti 2022"))
    return runs


# Jiang et al. 2024, "MegaScale" (NSDI 24, arXiv 2402.15627), Tables 1 and 2, the stock
# Megatron-LM rows: 175B with 128 heads, tp 8, pp 8, interleaved with 6 stages per rank,
# ZeRO-2 (the distributed optimizer: reduce_once), s = 2,048, V = 64,000; MFU on model
# FLOPs; iteration time printed.
_MEGASCALE = "Jiang et al. 2024 (arXiv 2402.15627)"
_MEGASCALE_175B = _gpt("megascale-175b", 96, 12288, 128, vocab=64000)
MEGASCALE: list[PublishedRun] = [
    PublishedRun(
        f"MegaScale's Megatron-LM, {gpus:,} GPUs",
        f"{_MEGASCALE}, Table 2, Megatron-LM, batch {batch}, {gpus} GPUs", _MEGASCALE_175B,
        "a100-80gb", f"tp=8 pp=8 dp={gpus // 64} zero=2 reduce_once=1 flash_attention=0 "
        "overlap_grad_reduce=0 overlap_p2p=0 "
        "schedule=interleaved_1f1b v=6", batch, seconds, STEP, free=("micro_batch", "recompute"),
        assumed=("A100 80 GB (the paper says Ampere, 8 x 200 Gb/s NICs per node)",
                 "data-parallel traffic not overlapped (MegaScale's Table 3 adds that)",
                 "pipeline sends and receives not overlapped (MegaScale adds that too)",
                 "no FlashAttention and LayerNorm and GeLU unfused (flash_attention=0, "
                 "fused=0): section 3.3 lists FlashAttention-2 and fusing LayerNorm's and "
                 "GeLU's \"fine-grained kernels\" among MegaScale's own operator work beyond "
                 "Megatron-LM (page 5, as quoted in huggingface/nanotron#86); Megatron's "
                 "masked-softmax and bias-dropout-add fusions, which the planner's eager "
                 "model counts unfused too, are not mentioned",),
        family="MegaScale 2024")
    for batch, gpus, seconds in ((768, 256, 40.0), (768, 512, 21.2), (768, 768, 15.2),
                                 (768, 1024, 11.9), (6144, 3072, 29.02), (6144, 6144, 14.78),
                                 (6144, 8192, 12.24), (6144, 12288, 8.57))
]


# BLOOM-176B (BigScience 2022), the training team's own files: bigscience-workshop/bigscience
# @ 9e64edec train/tr11-176B-ml (the Slurm script, README "Hardware", "Replica setup",
# "Important checkpoints"), their Megatron-DeepSpeed fork @ 8387ae17 (the TFLOPs it logs: eq.
# 3) and the HF blog "The Technology Behind BLOOM Training". Jean Zay: 8 A100 80 GB a node on
# NVLink, "4 OmniPath links" a node (100 Gb/s each: 50 Gb/s a GPU).
_BLOOM = "bigscience-workshop/bigscience @ 9e64edec, train/tr11-176B-ml/README.md"
JEAN_ZAY_A100 = replace(HARDWARE["a100-80gb"], name="a100-80gb-jean-zay",
                        inter=Link(bandwidth_gbs=0.9 * 50 / 8, latency_us=10.0))
"""Jean Zay's A100 nodes: four 100 Gb/s Omni-Path links shared by 8 GPUs, at the presets'
90% of line rate."""
BLOOM_176B = ModelShape(name="bloom-176b", layers=70, hidden=14336, heads=112, ffn=4 * 14336,
                        vocab=250880, seq_len=2048, gated_ffn=False, tied_embeddings=True,
                        dropout=True, layer_norm=True)


def _others() -> list[PublishedRun]:
    """Large A100 runs from other teams' papers and logs, with their own software."""
    bloom = PublishedRun(
        "BLOOM-176B, 384 GPUs", f"{_BLOOM}, Table \"Important checkpoints\", row iteration "
        "85376", BLOOM_176B, JEAN_ZAY_A100, "tp=4 pp=12 dp=8 zero=1 mbs=2 ac=full sp=0 "
        "flash_attention=0 fused=1 reduce_fp32=1 overlap_grad_reduce=0 overlap_p2p=0", 2048,
        104.70, STEP, layer_slots=2,
        assumed=("DeepSpeed's 1F1B pipeline engine (not stated): sends block, gradients "
                 "reduced after the last backward", "ZeRO-1 (DeepSpeed's BF16 optimizer, "
                 "\"its own zero stage 1\"), fp32 gradient accumulation and reduction",
                 "Omni-Path links at 100 Gb/s (a secondary source)", "ALiBi costed as "
                 "learned positions are (not at all)"),
        family="BLOOM, GLM 2022")
    glm = [PublishedRun(
        f"GLM-130B, 768 GPUs, batch {batch}", f"THUDM/GLM-130B @ 212215c, logs/main-log-en.md, "
        f"Table \"Speed Testing\", row batch {batch}", GLM_130B, A100_40GB,
        "tp=4 pp=8 dp=24 zero=1 mbs=1 ac=full sp=0 flash_attention=0 fused=1 overlap_p2p=0 "
        "overlap_grad_reduce=0 precision=fp16", batch, seconds, STEP, layer_slots=2,
        assumed=("DGX-A100 40 GB nodes with their 8 x 200 Gb/s NICs (the datasheet; the "
                 "paper says \"96 DGX-A100 GPU (8x40G) servers\")",
                 "as the paper states them (Zeng et al. 2022, arXiv 2210.02414, section 2.3 "
                 "and Table 11): micro-batch 1 (176 a step at batch 4,224), every layer "
                 "checkpointed, ZeRO-1, DeepSpeed's PipeDream-Flush (1F1B), FP16, 9 x 8 - 2 = "
                 "70 layers with the embedding and output a slot each",
                 "masked-softmax and bias-dropout fusion, apex's fused LayerNorm (Table 11) "
                 "as fused=1; its fp32 softmax, GeGLU without a fused kernel and DeepSpeed's "
                 "partitioned activation checkpoints are not costed",
                 "the prefix-bidirectional attention costed as causal"),
        family="BLOOM, GLM 2022") for batch, seconds in ((4224, 88.5), (6144, 122.5))]
    return [bloom, *glm]


# GLM-130B: configs/model_glm_130b.sh (70 layers, 12,288 hidden, GeGLU 32,768, 96 heads,
# vocabulary 150,528, sequence 2,048), "96 DGX-A100 (40G) nodes", MP 4 x PP 8.
GLM_130B = ModelShape(name="glm-130b", layers=70, hidden=12288, heads=96, ffn=32768,
                      vocab=150528, seq_len=2048, layer_norm=True)  # DeepNorm: a LayerNorm
A100_40GB = replace(HARDWARE["a100-80gb"], name="a100-40gb", memory_gib=40,
                    memory_bandwidth_gbs=1555)
"""An A100 40 GB SXM (datasheet: 1,555 GB/s) in a DGX A100."""

RUNS: list[PublishedRun] = [*_table1(), *_table2(), *_korthikanti(), *MEGASCALE, *_others()]
