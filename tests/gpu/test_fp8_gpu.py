"""FP8 training through torchao (float8 linear layers) on a GPU, against bf16; and the fp8
matmul that meshlab.calibrate times.

torchao is a peer in the test environment, never a meshlab dependency: without it (or
without a GPU of compute capability >= 8.9) these tests skip, saying which.
Loss tolerance: the fp8 run's loss stays within 5% (relative) of the bf16 run's at every
step of a short run (tensorwise-scaled e4m3/e5m2 casts: a few tenths of a percent is usual).
The speed of fp8 against bf16 is printed (and written to $GPU_PASS_RESULTS/fp8.json where that
is set), asserted only to be measured.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    pytest.skip("fp8 matmuls need a GPU: none here", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip(f"fp8 matmuls need compute capability >= 8.9 (Ada, Hopper); this GPU has "
                f"{torch.cuda.get_device_capability()}", allow_module_level=True)

LOSS_RTOL = 0.05
RESULTS: dict[str, float] = {}


def _record(**values: float) -> None:
    RESULTS.update(values)
    folder = os.environ.get("GPU_PASS_RESULTS")
    if folder:
        (Path(folder) / "fp8.json").write_text(json.dumps(RESULTS, indent=1))


def _float8() -> object:
    torchao = pytest.importorskip("torchao", reason="torchao (float8 training) not installed")
    from torchao.float8 import convert_to_float8_training

    print(f"torchao {torchao.__version__} on torch {torch.__version__}")
    return convert_to_float8_training


def _not_the_head(module: nn.Module, name: str) -> bool:
    # torchtitan's choice: the output projection stays in bf16 (and every dim % 16 == 0)
    return name != "output" and isinstance(module, nn.Linear) \
        and module.in_features % 16 == 0 and module.out_features % 16 == 0


def test_a_meshlab_transformer_trains_in_fp8_like_bf16() -> None:
    convert = _float8()
    from meshlab.models import ModelConfig, Transformer, global_batch

    cfg = ModelConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=1536,
                      vocab_size=2048, max_seq_len=256)
    batches = [tuple(t.cuda() for t in global_batch(step=s, batch=8, seq=256,
                                                     vocab=cfg.vocab_size)) for s in range(12)]
    runs = {}
    for name in ("bf16", "fp8"):
        torch.manual_seed(0)
        model = Transformer(cfg).cuda().to(torch.bfloat16)
        if name == "fp8":
            model = convert(model, module_filter_fn=_not_the_head)
            converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
            assert converted == 7 * cfg.n_layers, converted  # q k v o + w1 w2 w3 per block
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for inputs, targets in batches:
            loss = nn.functional.cross_entropy(model(inputs).float().flatten(0, 1),
                                               targets.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[name] = losses
    bf16, fp8 = runs["bf16"], runs["fp8"]
    print("bf16", [round(v, 4) for v in bf16])
    print("fp8 ", [round(v, 4) for v in fp8])
    worst = max(abs(a - b) / abs(a) for a, b in zip(bf16, fp8, strict=True))
    _record(max_loss_diff=worst, bf16_final_loss=bf16[-1], fp8_final_loss=fp8[-1])
    assert fp8[-1] < fp8[0] and bf16[-1] < bf16[0], runs
    assert worst < LOSS_RTOL, f"fp8 loss differs from bf16 by {worst:.2%} (> {LOSS_RTOL:.0%})"


def test_calibrates_fp8_matmul_runs_and_beats_bf16(one_rank: None) -> None:
    from meshlab.calibrate.compute import _matmul, dtypes_for, time_matmuls

    device = torch.device("cuda", torch.cuda.current_device())
    assert "fp8" in dtypes_for(device), "torch._scaled_mm did not run on this GPU"
    out = _matmul("fp8", 256, 512, 128, device)()
    assert out.shape == (256, 512) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    # the same product in fp8 and from its fp8-rounded inputs in fp32: only the rounding of
    # the accumulation and output differs
    a = torch.randn(256, 128, device=device)
    b = torch.randn(128, 512, device=device)
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    got = torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16).float()
    ref = a8.float() @ b8.float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    points = {p.dtype: p for p in time_matmuls([(8192, 8192, 8192)], ["bf16", "fp8"], device,
                                               reps=10)}
    ratio = points["fp8"].tflops / points["bf16"].tflops
    print(f"calibrate's 8192^3: bf16 {points['bf16'].tflops:.0f} TFLOP/s, fp8 "
          f"{points['fp8'].tflops:.0f} TFLOP/s ({ratio:.2f}x)")
    _record(calibrate_bf16_tflops=points["bf16"].tflops,
            calibrate_fp8_tflops=points["fp8"].tflops)
    assert ratio > 1.0, f"fp8 ran at {ratio:.2f}x bf16 on {torch.cuda.get_device_name()}"


def test_fp8_linear_stack_speed_against_bf16() -> None:
    convert = _float8()
    import triton.testing

    dim, tokens, depth = 8192, 8192, 4

    def stack() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(depth)]
                             ).cuda().to(torch.bfloat16)

    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    times = {}
    outputs = {}
    for name in ("bf16", "fp8"):
        model = stack() if name == "bf16" else convert(stack())
        compiled = torch.compile(model)  # fp8's scaling casts fuse only when compiled

        def step(m: nn.Module = compiled) -> None:
            m(x).sum().backward()

        outputs[name] = compiled(x).float()
        times[name] = triton.testing.do_bench(step, warmup=50, rep=300)
        del model, compiled
    flops = 3 * 2 * tokens * dim * dim * depth  # forward + two backward matmuls per layer
    speedup = times["bf16"] / times["fp8"]
    error = ((outputs["fp8"] - outputs["bf16"]).norm() / outputs["bf16"].norm()).item()
    print(f"{depth} x Linear({dim}, {dim}) on {tokens} tokens, forward + backward, compiled: "
          f"bf16 {times['bf16']:.2f} ms ({flops / times['bf16'] / 1e9:.0f} TFLOP/s), "
          f"fp8 {times['fp8']:.2f} ms ({flops / times['fp8'] / 1e9:.0f} TFLOP/s): "
          f"fp8 {speedup:.2f}x bf16; output relative difference {error:.3g}")
    _record(bf16_ms=times["bf16"], fp8_ms=times["fp8"], speedup=speedup,
            stack_output_rel_diff=error)
    assert error < 0.1, f"fp8 output differs from bf16 by {error:.3g} (relative norm)"
    assert speedup > 0
