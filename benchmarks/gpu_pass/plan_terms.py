"""The planner's compute terms measured on one GPU: GEMMs at the shapes of published runs'
layers, attention (SDPA, causal) forward and backward, and one whole decoder layer, eager and
compiled. Writes JSON that ``benchmarks/plan_terms.py`` sets beside the planner's terms.

$ python benchmarks/gpu_pass/plan_terms.py out.json        # on a CUDA device (torch only)
$ SMALL=1 python benchmarks/gpu_pass/plan_terms.py out.json  # a check of the script on CPU
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SMALL = bool(os.environ.get("SMALL"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
# (name, tokens, hidden, q width, kv width, ffn, gated, heads, seq): one micro-batch of a
# published run's layer on one GPU (tp already divided out)
LAYERS = [
    ("llama3-8b mbs2 s8192", 16384, 4096, 4096, 1024, 14336, True, 32, 8192),
    ("llama3-70b tp8 mbs1 s8192", 8192, 8192, 1024, 128, 3584, True, 8, 8192),
    ("mcore-gpt-1.7b mbs4 s4096", 16384, 2048, 2048, 2048, 8192, False, 16, 4096),
    ("mcore-gpt-16b tp4 mbs4 s4096", 16384, 6144, 1536, 1536, 6144, False, 12, 4096),
]
if SMALL:
    LAYERS = [("tiny", 256, 64, 64, 32, 128, True, 4, 128)]


def timed(fn: Callable[[], object], reps: int = 10) -> float:
    """Median seconds of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def gemms(tokens: int, h: int, q: int, kv: int, ffn: int, gated: bool) -> dict[str, float]:
    """Forward and backward (both gradients) of each weight GEMM of the layer."""
    out = {}
    shapes = {"qkv": (h, q + 2 * kv), "out": (q, h), "up": (h, ffn * (2 if gated else 1)),
              "down": (ffn, h)}
    for name, (k, n) in shapes.items():
        x = torch.randn(tokens, k, device=DEVICE, dtype=DTYPE)
        w = torch.randn(k, n, device=DEVICE, dtype=DTYPE)
        g = torch.randn(tokens, n, device=DEVICE, dtype=DTYPE)
        out[f"{name} fwd"] = timed(lambda x=x, w=w: x @ w)
        out[f"{name} bwd"] = timed(lambda x=x, w=w, g=g: (g @ w.T, x.T @ g))
    return out


def attention(tokens: int, heads: int, seq: int, d: int = 128) -> dict[str, float]:
    """SDPA (flash on CUDA), causal: forward, and forward + backward."""
    b = max(1, tokens // seq)
    q, k, v = (torch.randn(b, heads, seq, d, device=DEVICE, dtype=DTYPE, requires_grad=True)
               for _ in range(3))

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd() -> None:
        fwd().sum().backward()

    with torch.no_grad():
        forward = timed(fwd)
    return {"attention fwd": forward, "attention fwd+bwd": timed(fwd_bwd)}


class Layer(torch.nn.Module):
    """A pre-norm decoder layer: RMSNorm, QKV, causal SDPA, output, RMSNorm, (Swi)GLU MLP."""

    def __init__(self, h: int, q: int, kv: int, ffn: int, gated: bool, heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv * heads // q, q // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
        self.qkv = torch.nn.Linear(h, q + 2 * kv, bias=False)
        self.out = torch.nn.Linear(q, h, bias=False)
        self.up = torch.nn.Linear(h, ffn * (2 if gated else 1), bias=False)
        self.down = torch.nn.Linear(ffn, h, bias=False)
        self.gated, self.q, self.kv = gated, q, kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.q, self.kv, self.kv], dim=-1)
        q = q.view(b, s, self.heads, self.d).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.d).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, self.q))
        u = self.up(self.norm2(x))
        if self.gated:
            gate, up = u.chunk(2, dim=-1)
            u = F.silu(gate) * up
        else:
            u = F.gelu(u)
        return x + self.down(u)


def layer(tokens: int, h: int, q: int, kv: int, ffn: int, gated: bool, heads: int,
          seq: int, compile: bool) -> dict[str, float]:
    """One layer's forward + backward, eager and (``compile``) compiled."""
    m = Layer(h, q, kv, ffn, gated, heads).to(DEVICE, DTYPE)
    x = torch.randn(max(1, tokens // seq), seq, h, device=DEVICE, dtype=DTYPE,
                    requires_grad=True)
    out = {"layer eager": timed(lambda: m(x).sum().backward(), reps=5)}
    if not compile:  # a compile takes half a minute: the first layer only
        return out
    compiled = torch.compile(m)
    out["layer compiled"] = timed(lambda: compiled(x).sum().backward(), reps=5)
    return out


def main() -> None:
    results: dict[str, object] = {"device": torch.cuda.get_device_name() if DEVICE == "cuda"
                                  else "cpu", "torch": torch.__version__, "layers": {}}
    for i, (name, tokens, h, q, kv, ffn, gated, heads, seq) in enumerate(LAYERS):
        t = time.perf_counter()
        row = {**gemms(tokens, h, q, kv, ffn, gated), **attention(tokens, heads, seq),
               **layer(tokens, h, q, kv, ffn, gated, heads, seq, compile=i == 0)}
        results["layers"][name] = row  # type: ignore[index]
        print(f"{name}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in row.items())
              + f" ({time.perf_counter() - t:.0f} s)", flush=True)
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
