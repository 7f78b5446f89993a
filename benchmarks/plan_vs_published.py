"""The planner beside published large training runs: predicted vs reported TFLOP/s per GPU.

Each row is a run whose paper gives the model, the layout, the batch and the achieved
throughput. What a paper does not say (schedule details, recomputation) is set to the
stated assumption, and both readings are printed where it matters. No GPU needed.

$ python benchmarks/plan_vs_published.py
"""

from __future__ import annotations

from meshlab.plan import HARDWARE, MODELS, Layout, ModelShape, estimate

# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC21, arXiv 2104.04473), Table 1: the 1T model (128 layers, hidden 25,600,
# 160 heads, sequence 2,048, vocabulary 51,200).
GPT_1T = ModelShape(name="gpt-1t", layers=128, hidden=25600, heads=160, ffn=4 * 25600,
                    vocab=51200, seq_len=2048, gated_ffn=False, tied_embeddings=True,
                    learned_positions=True)

# (run, source, model, hardware, layout, reported TFLOP/s per GPU, what the paper counts)
RUNS = [
    ("Llama 3 405B, 8,192 GPUs", "Dubey et al. 2024, Llama 3, Table 4", MODELS["llama3-405b"],
     "h100-sxm", "tp=8 pp=16 dp=64 zero=2 mbs=1 m=32", 430, "model"),
    ("  same, interleaved v=2", "", MODELS["llama3-405b"], "h100-sxm",
     "tp=8 pp=16 dp=64 zero=2 mbs=1 m=32 schedule=interleaved_1f1b v=2", 430, "model"),
    ("Llama 3 405B, 16,384 GPUs", "Dubey et al. 2024, Llama 3, Table 4",
     MODELS["llama3-405b"], "h100-sxm", "tp=8 pp=16 dp=128 zero=2 mbs=1 m=16", 400, "model"),
    ("  same, interleaved v=2", "", MODELS["llama3-405b"], "h100-sxm",
     "tp=8 pp=16 dp=128 zero=2 mbs=1 m=16 schedule=interleaved_1f1b v=2", 400, "model"),
    ("GPT-3 175B, 1,536 GPUs", "Narayanan et al. 2021, Megatron-LM, Table 1",
     MODELS["gpt3-175b"], "a100-80gb", "tp=8 pp=16 dp=12 zero=0 mbs=1 m=128 ac=full", 153,
     "hardware"),
    ("GPT 1T, 3,072 GPUs", "Narayanan et al. 2021, Megatron-LM, Table 1", GPT_1T,
     "a100-80gb", "tp=8 pp=64 dp=6 zero=0 mbs=1 m=512 ac=full", 163, "hardware"),
]


def main() -> None:
    print(f"{'run':<28} {'layout':<58} {'reported':>8} {'predicted':>9} {'ratio':>6} "
          f"{'bubble':>6} {'GiB':>5}")
    for name, _source, model, hw, text, reported, counts in RUNS:
        e = estimate(model, Layout.parse(text), HARDWARE[hw])
        # Megatron counts recomputed FLOPs (its eq. 3 has the factor 4 of full recompute);
        # Llama 3 reports model FLOPs (MFU)
        flops = e.hardware_flops if counts == "hardware" else e.model_flops
        predicted = flops / e.step_s / e.layout.gpus / 1e12
        print(f"{name:<28} {e.layout.describe():<58} {reported:>8} {predicted:>9.0f} "
              f"{predicted / reported:>6.2f} {e.bubble_fraction:>6.1%} "
              f"{e.memory['total'] / 2**30:>5.0f}")


if __name__ == "__main__":
    main()
