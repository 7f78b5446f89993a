"""meshlab's own models compute in the dtype they are given: a float64 model is float64
throughout (its norms, rotary angles and router too), so a float64 comparison against one
process is exact to float64; half types widen to float32 where precision matters."""

from __future__ import annotations

import torch

from meshlab.models import ModelConfig, Transformer
from meshlab.models.llama import RMSNorm, apply_rope, rope_frequencies


def test_rmsnorm_in_float64_is_float64_math() -> None:
    x = torch.randn(4, 16, dtype=torch.float64) * 1e3 + 1 / 3
    norm = RMSNorm(16, eps=1e-6).to(torch.float64)
    exact = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (norm(x) - exact).abs().max().item() < 1e-13  # float32 inside: ~1e-7


def test_rope_in_float64_rotates_in_float64() -> None:
    x = torch.randn(1, 8, 2, 8, dtype=torch.float64) * 1e3 + 1 / 3
    freqs = rope_frequencies(8, 8, 10000.0).to(torch.float64)  # the table as the model holds it
    cos, sin = freqs[None, :, None, :, 0], freqs[None, :, None, :, 1]
    real, imag = x[..., 0::2], x[..., 1::2]
    exact = torch.stack([real * cos - imag * sin, real * sin + imag * cos], -1).flatten(-2)
    rotated = apply_rope(x, freqs)
    assert rotated.dtype == torch.float64
    assert (rotated - exact).abs().max().item() < 1e-12  # float32 inside: ~1e-4 at 1e3


def test_half_types_still_norm_in_float32() -> None:
    x = torch.randn(4, 16).to(torch.bfloat16)
    out = RMSNorm(16, eps=1e-6).to(torch.bfloat16)(x)
    wide = x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide.to(torch.bfloat16))


def test_a_float64_moe_routes_in_float64() -> None:
    model = Transformer(ModelConfig(n_experts=4, top_k=2)).to(torch.float64)
    moe = model.layers["0"].feed_forward
    tokens = torch.randn(5, model.cfg.dim, dtype=torch.float64)
    _, weights = moe.route(tokens)
    top = moe.router(tokens).topk(2, dim=-1).values.softmax(-1)
    assert weights.dtype == torch.float64 and torch.equal(weights, top)


def test_index_add_rows_is_index_add_keeping_only_the_index() -> None:
    from meshlab.models.moe import index_add_rows

    index = (torch.arange(21) // 3)[torch.randperm(21)]  # each of 7 tokens three times
    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randn(21, 8, dtype=dtype, requires_grad=True)
        out = torch.randn(7, 8, dtype=dtype, requires_grad=True)
        grad = torch.randn(7, 8, dtype=dtype)
        saved: list[torch.dtype] = []

        def pack(t: torch.Tensor, saved: list[torch.dtype] = saved) -> torch.Tensor:
            saved.append(t.dtype)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mine = index_add_rows(out, index, rows)
        theirs = out.index_add(0, index, rows)
        assert torch.equal(mine, theirs)
        assert all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(
            torch.autograd.grad(mine, (out, rows), grad),
            torch.autograd.grad(theirs, (out, rows), grad), strict=True))
        assert saved == [torch.int64]  # the index, not the rows


def test_an_moe_layer_keeps_two_copies_of_each_routed_token() -> None:
    """The copy of a token each of its experts reads, and that expert's output the gate
    multiplies: 2 x top_k x dim a token beside the router's input (a third, the gated
    output, was index_add's until index_add_rows)."""
    from meshlab.models.moe import MoE

    cfg = ModelConfig(dim=32, ffn_hidden=48, n_experts=4, top_k=2)
    moe, tokens = MoE(cfg), 10
    storages: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(torch.randn(2, tokens // 2, cfg.dim, requires_grad=True))
    weights = {p.untyped_storage().data_ptr() for p in moe.parameters()}
    hidden = [t for ptr, t in storages.items() if ptr not in weights
              and t.is_floating_point() and t.dim() == 2 and t.shape[1] == cfg.dim]
    assert sum(len(t) for t in hidden) == tokens + 2 * cfg.top_k * tokens


def test_an_moe_backward_stacks_its_experts_gradients_once() -> None:
    """Each stacked expert weight is split once a forward (unbind), so its backward holds
    the experts' gradients and one stacked copy: 4 stacked weights' worth of temporaries at
    its peak for the three, where indexing per expert (the layer's _forward on its own)
    summed a whole-size gradient per expert and held 5. The same gradients to the bit."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshlab.models.moe import MoE

    cfg = ModelConfig(dim=64, ffn_hidden=64, n_experts=8, top_k=2)
    x = torch.randn(16, cfg.dim)
    held, grads = [], []
    for split in (True, False):
        torch.manual_seed(0)
        moe = MoE(cfg)
        tracker = MemTracker()
        tracker.track_external(moe)
        with tracker:
            out = moe(x) if split else moe._forward(x)
            out.backward(torch.ones_like(out))
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        held.append(next(v for k, v in peak.items() if str(k).endswith("TEMP")))
        grads.append([p.grad for p in moe.parameters()])
    stacked = moe.w1.numel() * moe.w1.element_size()
    assert [round(h / stacked) for h in held] == [4, 5]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
