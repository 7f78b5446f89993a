"""Published H100-era runs (2024-): Llama 3."""

from __future__ import annotations

from meshlab.plan.published.run import MODEL_TFLOPS, PublishedRun
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
            f"{layout} zero=2", batch, tflops, MODEL_TFLOPS, layer_slots=2,
            free=("micro_batch", "schedule", "virtual") + (("recompute",) if row == 3 else ()),
            assumed=("FlashAttention-style attention (not stated)",
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


RUNS: list[PublishedRun] = [*_llama3()]
