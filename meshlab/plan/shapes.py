"""Model shapes the planner reasons about: parameter counts by part, and public presets."""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import tomllib


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's shape (Llama-style by default: SwiGLU, no biases)."""

    name: str = "custom"
    layers: int
    hidden: int
    heads: int
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); default: ``heads``."""
    ffn: int
    """Feed-forward hidden size (of each expert, for MoE)."""
    vocab: int
    seq_len: int
    """Training sequence length."""
    head_dim: int = 0
    """Width of one attention head; 0: hidden // heads (Qwen3, Gemma and MLA models set
    their own: Qwen3-32B's 64 heads of 128 are 8,192 wide on a hidden of 5,120)."""
    experts: int = 0
    """Experts per MoE layer (every layer); 0: dense."""
    top_k: int = 1
    """Experts each token goes to."""
    shared_ffn: int = 0
    """Width of the shared experts every token also passes through (DeepSeek's
    n_shared_experts x moe_intermediate_size, Qwen2-MoE's shared_expert_intermediate_size)."""
    dense_layers: int = 0
    """MoE models' first layers with a plain feed-forward instead (DeepSeek's
    first_k_dense_replace): counted in the model's totals; a pipeline's busiest stage is
    sized as MoE layers."""
    dense_ffn: int = 0
    """Those layers' feed-forward width (0: ffn)."""
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values through a rank this
    wide (0: plain attention); ``head_dim`` is then qk_nope_head_dim + qk_rope_head_dim."""
    q_lora_rank: int = 0
    """MLA's queries through a rank this wide (0: a full query projection)."""
    rope_head_dim: int = 0
    """MLA's rotary part of each head (qk_rope_head_dim), shared by the heads' keys."""
    v_head_dim: int = 0
    """MLA's value width per head (0: head_dim)."""
    gated_ffn: bool = True
    """SwiGLU (three matrices) rather than a GELU MLP (two, as in GPT-3)."""
    tied_embeddings: bool = False
    """The output projection reuses the token embedding."""
    learned_positions: bool = False
    """A position-embedding table (GPT-3) rather than RoPE."""
    dropout: bool = False
    """Dropout in training (GPT-2/3, Megatron's GPTs): its masks are kept for the backward.
    Llama-style models train without."""
    layer_norm: bool = False
    """LayerNorm (GPT-3, BLOOM, GLM: one torch kernel even eagerly) rather than RMSNorm
    (Llama: written in PyTorch, eagerly a chain of float32 kernels)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn", "vocab", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.name}: {name} must be >= 1")
        if not self.head_dim and self.hidden % self.heads:
            raise ValueError(f"{self.name}: heads={self.heads} must divide "
                             f"hidden={self.hidden} (or give head_dim)")
        if self.n_kv_heads < 1 or self.heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: kv_heads={self.kv_heads} must divide "
                             f"heads={self.heads}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"{self.name}: top_k={self.top_k} must be in 1..{self.experts}")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_width(self) -> int:
        """One attention head's width: ``head_dim``, or hidden // heads."""
        return self.head_dim or self.hidden // self.heads

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projections of one layer (MLA's low-rank ones and their
        norms)."""
        h, d, n = self.hidden, self.head_width, self.heads
        if not self.kv_lora_rank:
            return 2 * h * n * d + 2 * h * self.n_kv_heads * d
        q, kv, rope = self.q_lora_rank, self.kv_lora_rank, self.rope_head_dim
        v = self.v_head_dim or d
        queries = h * q + q + q * n * d if q else h * n * d
        keys_values = h * (kv + rope) + kv + kv * n * (d - rope + v)
        return queries + keys_values + n * v * h

    @property
    def expert_params(self) -> int:
        """One feed-forward (one expert of an MoE layer)."""
        return (3 if self.gated_ffn else 2) * self.hidden * self.ffn

    @property
    def ffn_params(self) -> int:
        """All feed-forward weights of one layer: every expert plus the router."""
        if not self.experts:
            return self.expert_params
        return (self.experts * self.expert_params + self.hidden * self.experts
                + self.shared_params)

    @property
    def shared_params(self) -> int:
        """The shared experts of one MoE layer (not split by expert parallelism)."""
        return (3 if self.gated_ffn else 2) * self.hidden * self.shared_ffn

    @property
    def layer_params(self) -> int:
        return self.attention_params + self.ffn_params + 2 * self.hidden  # + two norms

    @property
    def embedding_params(self) -> int:
        """Token (and position) embedding, the output projection unless tied, final norm."""
        tables = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        positions = self.seq_len * self.hidden if self.learned_positions else 0
        return tables + positions + self.hidden

    @property
    def dense_layer_saving(self) -> int:
        """What each of the ``dense_layers`` holds fewer than an MoE layer."""
        if not (self.experts and self.dense_layers):
            return 0
        dense = (3 if self.gated_ffn else 2) * self.hidden * (self.dense_ffn or self.ffn)
        return self.ffn_params - dense

    @property
    def params(self) -> int:
        """Every parameter."""
        return (self.layers * self.layer_params + self.embedding_params
                - self.dense_layers * self.dense_layer_saving)

    @property
    def active_matmul_params(self) -> int:
        """Weights one token multiplies by: the FLOPs count (the embedding lookup is not a
        matmul; the output projection is, tied or not; top_k experts of an MoE layer)."""
        ffn = (self.top_k * self.expert_params + self.hidden * self.experts + self.shared_params
               if self.experts else self.expert_params)
        dense = ((3 if self.gated_ffn else 2) * self.hidden * (self.dense_ffn or self.ffn)
                 if self.dense_layers else 0)
        return (self.layers * (self.attention_params + ffn) + self.vocab * self.hidden
                + self.dense_layers * (dense - ffn) * bool(self.experts))

    @classmethod
    def from_config(cls, cfg: Any, *, seq_len: int | None = None,
                    name: str = "meshlab") -> ModelShape:
        """The shape of a ``meshlab.models.ModelConfig`` (read by attribute: no torch)."""
        return cls(name=name, layers=cfg.n_layers, hidden=cfg.dim, heads=cfg.n_heads,
                   kv_heads=cfg.n_kv_heads, ffn=cfg.ffn_hidden, vocab=cfg.vocab_size,
                   seq_len=seq_len or cfg.max_seq_len, experts=cfg.n_experts,
                   top_k=cfg.top_k if cfg.n_experts else 1)

    @classmethod
    def from_transformers(cls, config: Any, *, seq_len: int | None = None,
                          name: str | None = None, layer_norm: bool = False) -> ModelShape:
        """The shape of a transformers decoder's config (read by attribute: no torch):
        its own head width, MoE fields under their families' names (experts, top-k, the
        experts' and shared experts' widths, DeepSeek's first dense layers) and MLA's
        ranks. What no config field says across families (a gated or plain MLP, learned
        positions) is assumed here; ``meshlab.dry_run.shape_from_config.checked_shape`` reads
        it from the model the config builds (``Session.plan`` and ``meshlab plan`` do)."""
        c = config
        experts = int(_first(c, "num_local_experts", "num_experts", "n_routed_experts") or 0)
        # GPT-2's n_inner (None: four times the width), OPT's ffn_dim: families whose MLP is
        # plain; one with an intermediate_size may be either (checked_shape reads its modules)
        gated = _first(c, "intermediate_size") is not None
        ffn = ((_first(c, "moe_intermediate_size") if experts else None)
               or _first(c, "intermediate_size", "n_inner", "ffn_dim") or 4 * c.hidden_size)
        shared = (_first(c, "shared_expert_intermediate_size")
                  or (_first(c, "n_shared_experts") or 0) * (ffn if experts else 0))
        rope = int(_first(c, "qk_rope_head_dim") or 0)
        mla = int(_first(c, "kv_lora_rank") or 0)
        head_dim = (int(_first(c, "qk_nope_head_dim") or 0) + rope if mla
                    else int(_first(c, "head_dim") or 0))
        return cls(
            name=name or getattr(c, "model_type", None) or "transformers",
            layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
            kv_heads=_first(c, "num_key_value_heads"), ffn=ffn, vocab=c.vocab_size,
            seq_len=seq_len or c.max_position_embeddings, head_dim=head_dim,
            experts=experts, top_k=int(_first(c, "num_experts_per_tok") or 1) if experts else 1,
            shared_ffn=int(shared or 0), kv_lora_rank=mla,
            dense_layers=int(_first(c, "first_k_dense_replace") or 0) if experts else 0,
            dense_ffn=int(_first(c, "intermediate_size") or ffn) if experts else 0,
            q_lora_rank=int(_first(c, "q_lora_rank") or 0), rope_head_dim=rope,
            v_head_dim=int(_first(c, "v_head_dim") or 0) if mla else 0,
            tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            gated_ffn=gated, layer_norm=layer_norm)


def _first(config: Any, *names: str) -> Any:
    """The first of ``names`` the config sets (not None)."""
    return next((v for n in names if (v := getattr(config, n, None)) is not None), None)


# Public architecture numbers. Llama 3: Dubey et al. 2024, "The Llama 3 Herd of Models",
# Table 3 (8B, 70B, 405B; pre-training sequence length 8,192). GPT-3: Brown et al. 2020,
# Table 2.1 (175B: 96 layers, d_model 12,288, 96 heads of 128, context 2,048; the GPT-2
# architecture, so a 4x GELU MLP, tied embeddings and learned positions).
MODELS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(name="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8,
                            ffn=14336, vocab=128256, seq_len=8192),
    "llama3-70b": ModelShape(name="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8,
                             ffn=28672, vocab=128256, seq_len=8192),
    "llama3-405b": ModelShape(name="llama3-405b", layers=126, hidden=16384, heads=128,
                              kv_heads=8, ffn=53248, vocab=128256, seq_len=8192),
    "gpt3-175b": ModelShape(name="gpt3-175b", layers=96, hidden=12288, heads=96, ffn=49152,
                            vocab=50257, seq_len=2048, gated_ffn=False, tied_embeddings=True,
                            learned_positions=True, dropout=True, layer_norm=True),
    # meshlab.models.ModelConfig() at the size the benchmarks train (max_seq_len=64)
    "meshlab": ModelShape(name="meshlab", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128,
                          vocab=256, seq_len=64),
}


def model_shape(name_or_shape: str | os.PathLike[str] | ModelShape | Any) -> ModelShape:
    """A preset by name (any case), a ``.toml`` file (``load_model``), the shape itself, or a
    meshlab ``ModelConfig``."""
    if isinstance(name_or_shape, ModelShape):
        return name_or_shape
    if hasattr(name_or_shape, "n_layers") and hasattr(name_or_shape, "dim"):
        return ModelShape.from_config(name_or_shape)
    if hasattr(name_or_shape, "num_hidden_layers") and hasattr(name_or_shape, "hidden_size"):
        return ModelShape.from_transformers(name_or_shape)  # a transformers config
    if isinstance(name_or_shape, os.PathLike) or (
            isinstance(name_or_shape, str) and name_or_shape.strip().endswith(".toml")):
        return load_model(name_or_shape)
    if not isinstance(name_or_shape, str):
        raise ValueError(f"cannot plan a {type(name_or_shape).__name__}: give a preset name "
                         f"({', '.join(MODELS)}), a .toml file, a ModelShape, a meshlab "
                         "ModelConfig or a transformers config")
    key = name_or_shape.strip().lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name_or_shape!r}: choose one of {', '.join(MODELS)}, "
                         "give a .toml file of ModelShape's fields, or a ModelShape "
                         "(ModelShape.from_config(cfg) for a meshlab model)")
    return MODELS[key]


def load_model(path: str | os.PathLike[str]) -> ModelShape:
    """A ``ModelShape`` from a TOML file whose keys are its fields (``name`` defaults to the
    file's stem), e.g. ``layers = 32``, ``hidden = 4096``, ``kv_heads = 8``."""
    path = Path(path).expanduser()
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read the model file {path} ({e.strerror or e}): check the "
                         "path") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid TOML ({e}): fix it there") from None
    known = {f.name: f for f in fields(ModelShape)}
    for key, value in data.items():
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            fix = f"did you mean {close[0]}?" if close else "remove it"
            raise ValueError(f"{path}: unknown key {key!r}: {fix} (a model has "
                             f"{', '.join(known)})")
        kind = _TOML_TYPES[key]
        # bool is an int in Python: `layers = true` must not read as 1
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            expected, example = _EXPECTED[kind]
            raise ValueError(f"{path}: {key} = {json.dumps(value, default=str)} is "
                             f"{_toml_type(value)}, not {expected}: write e.g. "
                             f"{key} = {example}")
        least = 0 if known[key].default == 0 else 1  # experts = 0: a dense model, ...
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise ValueError(f"{path}: {key} = {value} must be at least {least}: write e.g. "
                             f"{key} = 32")
    missing = [n for n, f in known.items() if f.default is MISSING and n not in data]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}: add "
                         f"{'it' if len(missing) == 1 else 'each'} as a whole number, e.g. "
                         f"{missing[0]} = 32")
    return ModelShape(**{"name": path.stem, **data})


# the TOML type of each ModelShape field (kv_heads: an int, or absent for heads)
_TOML_TYPES: dict[str, type] = {f.name: {"str": str, "bool": bool}.get(str(f.type), int)
                                for f in fields(ModelShape)}
_EXPECTED = {int: ("a whole number", "32"), bool: ("true or false", "true"),
             str: ("a string", '"my-model"')}


def _toml_type(value: Any) -> str:
    """What TOML calls a value: a string, a whole number, true/false, a table..."""
    names = {bool: "a boolean", int: "a whole number", float: "a decimal number",
             str: "a string", dict: "a table", list: "an array"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)
