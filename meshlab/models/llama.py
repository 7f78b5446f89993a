"""A small Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU (or MoE).

Written the way torchtitan writes it, so the parallel plans read the same: layers live in
a ModuleDict keyed by index (pipeline stages delete the ones they do not own), attention
infers its local head count from its weights (tensor parallel shards them), and the
attention core is one method that context parallelism can replace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlab.models.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(at_least_fp32(x.dtype))  # bf16/fp16 in fp32; float64 stays float64
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) \
            * self.weight


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """The dtype a model's precision-sensitive parts compute in: fp32 for half types, the
    given dtype otherwise (a float64 model computes everything in float64, so a float64
    comparison is exact to float64, not to a float32 norm)."""
    return torch.promote_types(dtype, torch.float32)


def rope_frequencies(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Rotation angles as (cos, sin) pairs: (max_seq_len, head_dim // 2, 2)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (B, T, H, D) by the first T rows of freqs."""
    freqs = freqs[: x.shape[1]]  # (T, D/2, 2)
    pairs = x.to(at_least_fp32(x.dtype)).unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    cos, sin = freqs[None, :, None, :, 0], freqs[None, :, None, :, 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        repeat = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, H, T, D)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ / √d) v with a causal mask; context parallelism replaces this."""
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward (or MoE) with residuals."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.n_experts:
            from meshlab.models.moe import MoE

            self.feed_forward: nn.Module = MoE(cfg)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab). A pipeline stage may lack either end."""

    freqs: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        torch.manual_seed(cfg.seed)  # the same weights in every process
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("freqs", rope_frequencies(cfg.head_dim, cfg.max_seq_len,
                                                       cfg.rope_theta), persistent=False)
        self.seq_offset = 0  # first position of this rank's tokens (context parallelism)

    def reset_parameters(self) -> None:
        """The model's own tensors (its blocks reset their own): the RoPE table, which a
        model built on the meta device lacks."""
        cfg = self.cfg
        self.freqs.copy_(rope_frequencies(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # Attention slices what it needs: under sequence parallelism h here holds only this
        # rank's part of the sequence, while attention sees all of it.
        freqs = self.freqs[self.seq_offset:]
        for layer in self.layers.values():
            h = layer(h, freqs)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in at least fp32 (bf16 logits lose too much)."""
    logits = logits.flatten(0, 1)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return F.cross_entropy(logits, targets.flatten(0, 1))
