"""What a step keeps for the backward under meshlab.dry_run.fused_memory, held to
Korthikanti's count.

One block of meshlab's Transformer (and of transformers' Llama) runs on fake tensors under
torch's memory tracker, op by op and with fused kernels' rules: the fused figure is
Korthikanti et al.'s count for the block, term by term, plus what the fused kernels keep
besides (FlashAttention's log-sum-exp, a norm's statistic per token), byte for byte; the
eager figure exceeds it by what the rules drop (the norms' fp32 copies and normalized
outputs, SiLU's output, GQA's repeated keys and values), byte for byte. On real tensors
the rules change nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from meshlab.dry_run.fused_memory import fused_memory
from meshlab.models import ModelConfig, Transformer
from meshlab.parallel.activation_checkpoint import apply_ac
from meshlab.plan.formulas import layer_activation_bytes

CFG = ModelConfig(dim=256, n_heads=8, n_kv_heads=2, ffn_hidden=512, n_layers=1,
                  vocab_size=512, max_seq_len=64)
BATCH, SEQ = 2, 64


def fake() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def bf16_by_default() -> Any:
    """Built in bf16 (a fake model's .to() cannot swap tensors the tracker refers to)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def held_after_forward(block: Any, x: torch.Tensor, *args: Any, fused: bool,
                       **kwargs: Any) -> int:
    """Bytes the block's forward leaves allocated (what it keeps for the backward, and its
    output), as torch's memory tracker counts them."""
    from torch.distributed._tools.mem_tracker import MemTracker  # imports triton: not early

    tracker = MemTracker()
    tracker.track_external(block)
    with tracker:
        before = _activations(tracker)
        with fused_memory() if fused else contextlib.nullcontext():
            out = block(x, *args, **kwargs)
        held = _activations(tracker) - before
    del out
    return held


def _activations(tracker: Any) -> int:
    return sum(v for per in tracker.get_tracker_snapshot("current").values()
               for k, v in per.items() if str(getattr(k, "value", k)) == "Activation")


def korthikanti(*, hidden: int, heads: int, kv_heads: int, ffn: int) -> float:
    head = hidden // heads
    return layer_activation_bytes(seq=SEQ, batch=BATCH, hidden=hidden, heads=heads,
                                  q_width=heads * head, kv_width=kv_heads * head, ffn=ffn,
                                  gated=True, dropout=False, scores=False)


def test_meshlab_block_keeps_korthikanti_count_with_fused_kernels() -> None:
    tokens, h, f = BATCH * SEQ, CFG.dim, CFG.ffn_hidden
    q, kv = h, CFG.n_kv_heads * CFG.head_dim
    with fake(), bf16_by_default():
        model = Transformer(CFG)
        block = model.layers["0"]
        x = torch.randn(BATCH, SEQ, h, dtype=torch.bfloat16, requires_grad=True)
        fused = held_after_forward(block, x, model.freqs, fused=True)
        eager = held_after_forward(block, x, model.freqs, fused=False)
    kept = korthikanti(hidden=h, heads=CFG.n_heads, kv_heads=CFG.n_kv_heads, ffn=f)
    lse, rstd = 4 * CFG.n_heads * tokens, 2 * 4 * tokens  # fp32, per head / per norm
    # besides: the block's output, and the RoPE table the tracker first sees here
    seen = 2 * h * tokens + model.freqs.nbytes
    assert fused == kept + lse + rstd + seen
    # op by op: each norm's fp32 copy (4h) and normalized output (2h), where a fused norm
    # keeps its input (the block's input, held by the caller either way; the second's,
    # 2h); SiLU's output (2f); keys and values repeated to the query heads
    dropped = 2 * (4 * h + 2 * h) - 2 * h + 2 * f + 4 * (q - kv)
    assert eager - fused == dropped * tokens


def test_transformers_llama_block_keeps_korthikanti_count_with_fused_kernels() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=512, num_hidden_layers=1, vocab_size=512,
                         max_position_embeddings=SEQ, attn_implementation="sdpa")
    tokens = BATCH * SEQ
    with fake(), bf16_by_default():
        block = LlamaDecoderLayer(config, 0)
        rope = LlamaRotaryEmbedding(config)
        x = torch.randn(BATCH, SEQ, 256, dtype=torch.bfloat16, requires_grad=True)
        positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
        cos_sin = tuple(t.to(torch.bfloat16) for t in rope(x, positions))
        fused = held_after_forward(block, x, position_embeddings=cos_sin, fused=True)
    kept = korthikanti(hidden=256, heads=8, kv_heads=2, ffn=512)
    lse, rstd = 4 * 8 * tokens, 2 * 4 * tokens
    # besides: the block's output, and the RoPE angles the tracker first sees here
    seen = 2 * 256 * tokens + sum(t.nbytes for t in cos_sin)
    assert fused == kept + lse + rstd + seen


def backward_peak(*, checkpointed: bool, fused: bool) -> int:
    """The step's peak, as torch's memory tracker counts it, of one block's forward and
    backward, the block checkpointed (torch's, non-reentrant) or not."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.checkpoint import checkpoint

    with fake(), bf16_by_default():
        model = Transformer(CFG)
        block = model.layers["0"]
        x = torch.randn(BATCH, SEQ, CFG.dim, dtype=torch.bfloat16, requires_grad=True)
        tracker = MemTracker()
        tracker.track_external(block)
        with tracker, fused_memory() if fused else contextlib.nullcontext():
            out = (checkpoint(block, x, model.freqs, use_reentrant=False) if checkpointed
                   else block(x, model.freqs))
            out.sum().backward()
        return sum(v for per in tracker.get_tracker_snapshot("peak").values()
                   for k, v in per.items() if str(getattr(k, "value", k)) == "Total")


def test_a_checkpointed_block_recomputes_what_fused_kernels_keep() -> None:
    # the recomputation saves under checkpoint's own hooks: with fused kernels it holds
    # what the forward held, and the backward peaks where it does without checkpointing
    peaks = {(ckpt, fused): backward_peak(checkpointed=ckpt, fused=fused)
             for ckpt in (False, True) for fused in (False, True)}
    assert peaks[True, True] == peaks[False, True] < peaks[True, False] == peaks[False, False]


def test_real_tensors_are_saved_as_they_are() -> None:
    torch.manual_seed(0)
    model = Transformer(CFG)
    x = torch.randint(0, CFG.vocab_size, (BATCH, SEQ))
    grads = []
    for fused, checkpointed in ((False, False), (True, False), (True, True)):
        model.zero_grad()
        if checkpointed:  # the recomputation too
            apply_ac(model, "full")
        with fused_memory() if fused else contextlib.nullcontext():
            model(x).float().square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g, strict=True))


def deepseek_step_held(seq: int) -> int:
    """Bytes a one-layer DeepSeek-V3 (transformers', multi-head latent attention: values
    narrower than queries and keys) keeps after its forward on fake tensors, as a dry run
    runs it."""
    import transformers

    from meshlab.dry_run.fused_attention import causal_without_mask

    config = transformers.DeepseekV3Config(
        hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=512, vocab_size=512, q_lora_rank=128, kv_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1,
        max_position_embeddings=4 * SEQ)
    with fake(), causal_without_mask():
        model = transformers.DeepseekV3ForCausalLM(config)
        ids = torch.randint(0, 512, (BATCH, seq))
        positions = torch.arange(seq)[None].expand(BATCH, seq)  # as a pipeline stage's
        return held_after_forward(model, ids, position_ids=positions, use_cache=False,
                                  fused=True)


def test_latent_attention_keeps_what_a_fused_kernel_does_with_no_mask() -> None:
    """torch's CPU kernel cannot take values narrower than the queries (MLA's) and runs the
    math path, keeping every score; transformers, given fake positions, builds a sequence x
    sequence mask a training step does not have. Under the dry run's contexts neither is
    kept: what the step holds grows with the sequence linearly (beside a few bytes per
    step, the kernel's random seed and offset), as a fused kernel's does."""
    held = [deepseek_step_held(n * SEQ) for n in (1, 2, 3)]
    assert held[2] - held[1] == held[1] - held[0]
