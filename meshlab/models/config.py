"""The shape of meshlab's reference Transformer (meshlab.models.llama) and its MoE layers
(meshlab.models.moe): plain data, below both."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Shape of the model; the defaults fit 4 CPU ranks and still shard every weight."""

    dim: int = 64
    """Hidden size."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    vocab_size: int = 256
    """Tokens in the vocabulary."""
    ffn_hidden: int = 128
    """Hidden size of the SwiGLU feed-forward (per expert, for MoE)."""
    max_seq_len: int = 32
    """Longest sequence RoPE is precomputed for."""
    n_experts: int = 0
    """Experts per MoE layer; 0 means a dense model."""
    top_k: int = 2
    """Experts each token is routed to (MoE)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base."""
    seed: int = 0
    """Initial weights are a function of this seed only."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.n_experts and not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head dim {self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads
