"""torch's ring attention (ParallelPlan(context_parallel="torch")) on the one GPU a test has.

Two ranks of NCCL need two GPUs (NCCL refuses two ranks on one device), and parallelize only
applies context parallel when cp > 1, so on one GPU this file calls apply_cp itself on a
1-rank "cp" mesh: torch's context-parallel SDPA (the DTensor dispatcher, its templated ring
forward and backward) runs, with no peer to rotate K/V to. What it proves: meshlab wires
torch's ring attention so that it runs on CUDA and computes plain causal attention, forward
and backward. What it cannot: the K/V rotation between ranks and the causal masking of other
ranks' blocks (cp >= 2, two GPUs).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="torch's ring attention runs on CUDA only: no GPU here")

SEQ = 64


def _ring_module() -> Any:
    """The module that holds torch's templated ring attention (moved between releases)."""
    import torch.distributed.tensor.experimental._attention as shim

    return sys.modules[shim._templated_ring_attention.__module__]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ring_attention_at_cp1_matches_plain_attention(
        one_rank: None, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from meshlab.models import ModelConfig, Transformer, global_batch
    from meshlab.parallel.context import apply_cp

    ring_module = _ring_module()
    calls = {"forward": 0, "backward": 0}
    for name, key in (("_templated_ring_attention", "forward"),
                      ("_templated_ring_attention_backward", "backward")):
        original = getattr(ring_module, name)

        def counted(*args: Any, _original: Any = original, _key: str = key,
                    **kwargs: Any) -> Any:
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(ring_module, name, counted)

    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    cfg = ModelConfig(max_seq_len=SEQ)
    plain = Transformer(cfg).cuda().to(dtype)
    ring = apply_cp(copy.deepcopy(plain), mesh, seq_len=SEQ, impl="torch")
    inputs, targets = (t.cuda() for t in global_batch(step=0, batch=4, seq=SEQ,
                                                      vocab=cfg.vocab_size))
    logits, grads = [], []
    for model in (plain, ring):
        out = model(inputs)
        nn.functional.cross_entropy(out.float().flatten(0, 1), targets.flatten()).backward()
        logits.append(out.detach().float())
        grads.append([p.grad.float() for p in model.parameters()])
    layers = len(ring.layers)
    assert calls["forward"] >= layers and calls["backward"] >= layers, (
        f"torch's ring attention did not run in every layer: {calls}, {layers} layers")
    rtol, atol = (1e-4, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(logits[1], logits[0], rtol=rtol, atol=atol)
    for (name, _), a, b in zip(plain.named_parameters(), *grads, strict=True):
        scale = a.abs().max().clamp_min(1e-12)
        assert ((b - a).abs().max() / scale).item() < (1e-3 if dtype == torch.float32
                                                        else 5e-2), name


def test_parallelize_takes_context_parallel_torch_on_a_cuda_mesh_without_cp(
        one_rank: None) -> None:
    # cp=1: parallelize leaves attention alone (nothing to split); the plan is still valid
    from torch.distributed.device_mesh import init_device_mesh

    from meshlab.models import ModelConfig, Transformer
    from meshlab.parallel import ParallelPlan, parallelize

    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "cp"))
    model = Transformer(ModelConfig()).cuda()
    cores = [b.attention.core for b in model.layers.values()]
    parallelize(model, mesh, ParallelPlan(data_parallel="none", context_parallel="torch"))
    assert [b.attention.core for b in model.layers.values()] == cores
