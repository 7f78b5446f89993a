"""Fused projections under tensor parallel (issue 61): a nanoGPT-style model whose attention
computes q, k, v with one ``c_attn = nn.Linear(d, 3 * d)`` and splits its output by
``self.n_embd``, and whose MLP packs gate and up in one Linear, trains under TP like one
process with FusedColwise and LocalSizes; every plan under which its own forward would fail,
or silently train on the wrong slices, is refused before training, naming the module and the
fix; a model without a plan is refused with one read off its own Linears.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshlab import Cluster

NANOGPT = '''
import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    """karpathy/nanoGPT's, with the head size read from the attributes, not the input."""

    def __init__(self, n_embd, n_head, sizes_from_input=False, chunk=False, by_head=False):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)  # q, k, v packed
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, 0.0
        self.sizes_from_input, self.chunk, self.by_head = sizes_from_input, chunk, by_head

    def forward(self, x):
        B, T, C = x.size()
        qkv = self.c_attn(x)
        width = C if self.sizes_from_input else self.n_embd  # nanoGPT's own reads C
        if self.by_head:  # each head's q, k, v side by side (GPT-NeoX's packing)
            q, k, v = qkv.view(B, T, self.n_head, -1).transpose(1, 2).chunk(3, dim=-1)
        else:
            q, k, v = qkv.chunk(3, dim=2) if self.chunk else qkv.split(self.n_embd, dim=2)
            q, k, v = (t.view(B, T, self.n_head, width // self.n_head).transpose(1, 2)
                       for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, width))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.gate_up = nn.Linear(n_embd, 2 * 2 * n_embd)  # gate and up packed
        self.down = nn.Linear(2 * n_embd, n_embd)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, n_embd, n_head, **attention):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn, self.mlp = CausalSelfAttention(n_embd, n_head, **attention), MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, n_embd=32, n_head=4, n_layer=2, block_size=16, **attention):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(Block(n_embd, n_head, **attention) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.size(1)))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))
'''

PLAN = ("{'transformer.h.*.attn': LocalSizes('n_head', 'n_embd'), "
        "'transformer.h.*.attn.c_attn': FusedColwise(parts=3), "
        "'transformer.h.*.attn.c_proj': 'rowwise', "
        "'transformer.h.*.mlp.gate_up': FusedColwise(parts=2), "
        "'transformer.h.*.mlp.down': 'rowwise'}")
"""The plan the docs give (docs/guides/parallelism.md), as meshlab suggests it."""

SETUP = NANOGPT + f'''
import meshlab.mesh
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.parallel.fused import FusedColwise, LocalSizes
from meshlab.verify.compare import compare_with_single_process
PLAN = {PLAN}
'''


def _nanogpt() -> dict[str, Any]:
    names: dict[str, Any] = {}
    exec(NANOGPT, names)
    return names


@pytest.mark.cluster
def test_a_nanogpt_with_fused_projections_trains_under_tp_like_one_process(
        cluster: Cluster) -> None:
    # dp=2 tp=2 ZeRO-3: FSDP splits the strided c_attn weight along its inputs, so it gathers
    # back whole; tp=4: one head of each part per rank; q, k, v packed by head: the proof
    # passes a plain column split, which keeps each head's parts together
    result = cluster.run(SETUP + '''
from functools import partial
_by_head = {**PLAN, "transformer.h.*.attn.c_attn": "colwise"}
_verdicts = {}
for _case, _mesh, _dp, _factory, _plan in (("dp=2 tp=2", "dp=2 tp=2", "zero3", GPT, PLAN),
                                           ("tp=4", "tp=4", "none", GPT, PLAN),
                                           ("by head", "tp=4", "none",
                                            partial(GPT, by_head=True), _by_head)):
    _r = compare_with_single_process(_factory, meshlab.mesh.build(_mesh), ParallelPlan(
        data_parallel=_dp, tp_plan=_plan), steps=2, dtype=torch.float64, vocab=64)
    _verdicts[_case] = (_r.ok, _r.max_loss_error, _r.max_param_error, _r.worst_param)
_verdicts
''', keep_values=True, timeout=180)
    for verdicts in result.values.values():
        for mesh, (ok, loss_error, param_error, _) in verdicts.items():
            assert ok and loss_error < 1e-12 and param_error < 1e-9, (mesh, verdicts[mesh])


@pytest.mark.cluster
def test_a_forward_that_would_unpack_or_train_the_wrong_slices_is_refused_before_training(
        cluster: Cluster) -> None:
    # a plain column split of c_attn: the user's split(n_embd) fails ("expected 3, got 2"),
    # and a chunk(3) of it would silently pair rank 0's q with half of k; nanoGPT's own
    # forward reads the width off its input, which no attribute divides
    result = cluster.run(SETUP + '''
from functools import partial
_plain = {**PLAN, "transformer.h.*.attn.c_attn": "colwise"}
_cases = {"unpack": (GPT, {k: v for k, v in _plain.items() if k != "transformer.h.*.attn"}),
          "chunk": (partial(GPT, chunk=True), _plain),
          "mlp": (GPT, {**PLAN, "transformer.h.*.mlp.gate_up": "colwise"}),
          "input": (partial(GPT, sizes_from_input=True), PLAN),
          "no sizes": (GPT, {k: v for k, v in PLAN.items() if k != "transformer.h.*.attn"})}
_said, _mesh = {}, meshlab.mesh.build("dp=2 tp=2")
for _name, (_factory, _plan) in _cases.items():
    torch.manual_seed(0)  # every rank builds the same weights
    try:
        parallelize(_factory(), _mesh, ParallelPlan(tp_plan=_plan))
        _said[_name] = "trained"
    except ValueError as e:
        _said[_name] = str(e)
_said
''', keep_values=True, timeout=120)
    said = result.values[0]
    assert all("trained" not in ranks.values() for ranks in result.values.values()), said
    assert ("'transformer.h.*.attn.c_attn': 'colwise' cuts transformer.h.0.attn.c_attn "
            "(nn.Linear(32, 96))") in said["unpack"], said["unpack"]
    assert "not enough values to unpack (expected 3, got 2)" in said["unpack"]
    assert ("give 'transformer.h.*.attn.c_attn': FusedColwise(parts=3) and "
            "'transformer.h.*.attn': LocalSizes('n_head', 'n_embd')") in said["unpack"]
    for name in ("chunk", "mlp"):  # the forward runs: only the numbers say it is wrong
        assert "its output differs from its whole forward's by" in said[name], said[name]
    assert "give 'transformer.h.*.mlp.gate_up': FusedColwise(parts=2)" in said["mlp"]
    assert ("FusedColwise(parts=3) does not give transformer.h.0.attn (CausalSelfAttention) "
            "what its forward gave whole") in said["input"], said["input"]
    assert "is invalid for input of size" in said["input"]
    assert "`.view(B, T, self.n_embd)`" in said["input"]
    assert "give 'transformer.h.*.attn': LocalSizes('n_head', 'n_embd')" in said["no sizes"]


def test_a_model_without_a_tp_plan_is_refused_with_one_read_off_its_own_linears() -> None:
    from meshlab.parallel.tensor import model_plan

    with pytest.raises(ValueError) as refused:
        model_plan(_nanogpt()["GPT"]())
    said = str(refused.value)
    assert said.startswith(f"GPT ships no tensor-parallel plan: pass ParallelPlan(tp_plan="
                           f"{PLAN}), read off the Linear layers of transformer.h.0"), said
    assert "q_proj" not in said and "layers.*" not in said


def test_a_fused_projection_on_the_meta_device_needs_the_tiny_check() -> None:
    from meshlab.parallel import fused_proof
    from meshlab.parallel.fused import FusedColwise, LocalSizes

    plan = {"transformer.h.*.attn": LocalSizes("n_embd", "n_head"),
            "transformer.h.*.attn.c_attn": FusedColwise(parts=3)}
    with torch.device("meta"):
        model = _nanogpt()["GPT"]()
    with pytest.raises(ValueError, match=r"transformer.h.0.attn holds a fused projection "
                                         r".*is on the meta device: pass parallelize\(\.\.\., "
                                         r"check='tiny'\)"):
        fused_proof.capture(model, plan, user=True)
    fused_proof.capture(model, plan, user=True, vouched=True)  # a tiny copy proved the plan


def test_a_fused_projection_names_its_parts() -> None:
    from meshlab.parallel.fused import FusedColwise, LocalSizes

    with pytest.raises(ValueError, match=r"FusedColwise\(parts=0\): expected the number"):
        FusedColwise(parts=0)
    with pytest.raises(ValueError, match=r"LocalSizes\(\): expected the names"):
        LocalSizes()
    assert repr(FusedColwise(3)) == "FusedColwise(parts=3)"
    assert repr(LocalSizes("n_embd", "n_head")) == "LocalSizes('n_embd', 'n_head')"
