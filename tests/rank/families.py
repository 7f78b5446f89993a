"""The model families the tests train: transformers models built from tiny configs (nothing
downloaded) and a GPT written in a cell, none written with meshlab in mind. The source is
run on the ranks (``exec``), where ``FAMILIES[name]()`` builds one."""

from __future__ import annotations

import re

FAMILIES_SOURCE = '''
import torch, transformers as T
from torch import nn


def _tiny(config_class, **kw):
    # 8 query and 4 key/value heads: a head split over cp=2 inside tp=2 still divides them
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return config_class(**{**base, **kw})


MOE = dict(num_experts=4, num_experts_per_tok=2, experts_implementation="eager")


class CellGPT(nn.Module):
    """A GPT written in a cell: tied embedding, pre-norm blocks, returns (logits, None)."""

    def __init__(self, vocab=64, dim=32, heads=4, layers=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(CellBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.config = type("Config", (), {"vocab_size": vocab})()

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)), None


class CellBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head_dim = dim // heads

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (p(h).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))  # (B, nh, T, hs): nh local under TP
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.down(nn.functional.gelu(self.up(self.ln_2(x))))


CELL_TP_PLAN = {"tok": "embedding_rowwise", "head": "colwise_gather_output",
                "blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise",
                "blocks.*.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

FAMILIES = {
    "Llama": lambda: T.LlamaForCausalLM(_tiny(T.LlamaConfig)),
    "Llama (tied)": lambda: T.LlamaForCausalLM(_tiny(T.LlamaConfig, tie_word_embeddings=True)),
    "Qwen2": lambda: T.Qwen2ForCausalLM(_tiny(T.Qwen2Config, tie_word_embeddings=True)),
    "Qwen3": lambda: T.Qwen3ForCausalLM(_tiny(T.Qwen3Config, head_dim=8,
                                              tie_word_embeddings=True)),
    "Mistral": lambda: T.MistralForCausalLM(_tiny(T.MistralConfig)),
    "Gemma2": lambda: T.Gemma2ForCausalLM(_tiny(T.Gemma2Config, head_dim=8,
                                                attn_implementation="eager")),
    "Gemma3": lambda: T.Gemma3ForCausalLM(_tiny(T.Gemma3TextConfig, head_dim=8,
                                                sliding_window=4)),
    "Phi-3": lambda: T.Phi3ForCausalLM(_tiny(T.Phi3Config)),
    "GPT-2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=4,
                                                    n_head=4, n_positions=64, resid_pdrop=0.0,
                                                    embd_pdrop=0.0, attn_pdrop=0.0)),
    "Mixtral": lambda: T.MixtralForCausalLM(_tiny(T.MixtralConfig, num_local_experts=4,
                                                  num_experts_per_tok=2,
                                                  experts_implementation="eager")),
    "Qwen3-MoE": lambda: T.Qwen3MoeForCausalLM(_tiny(T.Qwen3MoeConfig, head_dim=8,
                                                     moe_intermediate_size=16, **MOE)),
    "OLMoE": lambda: T.OlmoeForCausalLM(_tiny(T.OlmoeConfig, **MOE)),
    "GPT in a cell": CellGPT,
    # the fourth round's: families the matrix had never run (each shaped to keep what it does:
    # MLA, shared experts, sinks, state-space layers, chunked attention, multipliers, ...)
    "DeepSeek-V3": lambda: T.DeepseekV3ForCausalLM(_tiny(
        T.DeepseekV3Config, num_key_value_heads=8,  # MLA: a key per head, as in the real one
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
        experts_implementation="eager")),
    "Qwen2-MoE": lambda: T.Qwen2MoeForCausalLM(_tiny(
        T.Qwen2MoeConfig, moe_intermediate_size=16, shared_expert_intermediate_size=32, **MOE)),
    "GPT-OSS": lambda: T.GptOssForCausalLM(_tiny(
        T.GptOssConfig, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, sliding_window=4, experts_implementation="eager",
        attn_implementation="eager")),
    "Jamba": lambda: T.JambaForCausalLM(_tiny(
        T.JambaConfig, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
        expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=2, experts_implementation="eager")),
    "Bamba": lambda: T.BambaForCausalLM(_tiny(
        T.BambaConfig, attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8)),
    "Llama4": lambda: T.Llama4ForCausalLM(_tiny(
        T.Llama4TextConfig, head_dim=8, intermediate_size_mlp=64, num_local_experts=4,
        num_experts_per_tok=1, attention_chunk_size=4, floor_scale=4,
        experts_implementation="eager")),
    "GPT-NeoX": lambda: T.GPTNeoXForCausalLM(_tiny(
        T.GPTNeoXConfig, rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0)),
    "Falcon": lambda: T.FalconForCausalLM(_tiny(
        T.FalconConfig, num_kv_heads=2, new_decoder_architecture=True)),
    "Cohere": lambda: T.CohereForCausalLM(_tiny(T.CohereConfig)),
    "Granite": lambda: T.GraniteForCausalLM(_tiny(
        T.GraniteConfig, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0,
        attention_multiplier=0.3)),
    "OLMo2": lambda: T.Olmo2ForCausalLM(_tiny(T.Olmo2Config)),
    "StableLM": lambda: T.StableLmForCausalLM(_tiny(T.StableLmConfig, qk_layernorm=True)),
    "Phi": lambda: T.PhiForCausalLM(_tiny(
        T.PhiConfig, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "SmolLM3": lambda: T.SmolLM3ForCausalLM(_tiny(T.SmolLM3Config)),
}
'''


FAMILY_NAMES = re.findall(r'^    "([^"]+)":', FAMILIES_SOURCE, re.M)
ROUND_THREE = FAMILY_NAMES[:FAMILY_NAMES.index("DeepSeek-V3")]
"""The families of the matrix before the fourth round (tests that run each family alone)."""
