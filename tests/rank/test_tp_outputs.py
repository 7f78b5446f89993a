"""A tensor-parallel layer's output is one the model's own code may change in place: Llama4's
MoE adds its routed experts into its shared expert's row-parallel output (``out.add_``),
which once crashed every TP mesh ("a view ... is being modified inplace")."""

from __future__ import annotations

import ast

import pytest

from meshlab import Cluster

LLAMA4_TP = """
import transformers as T
from meshlab.parallel import ParallelPlan
from meshlab.verify.compare import compare_with_single_process
config = T.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
    max_position_embeddings=64, experts_implementation="eager")
r = compare_with_single_process(lambda: T.Llama4ForCausalLM(config), mesh,
                                ParallelPlan(data_parallel='zero3'), steps=2,
                                dtype=torch.float64, optimizer="sgd")
(r.ok, r.max_loss_error, r.max_param_error)
"""


@pytest.mark.cluster
def test_llama4_trains_under_tensor_parallel_like_one_process(cluster: Cluster) -> None:
    cluster.init_mesh("dp=2 tp=2")
    result = cluster.run(LLAMA4_TP)
    verdicts = {r: ast.literal_eval(o.result or "") for r, o in result.outputs.items()}
    assert all(v[0] for v in verdicts.values()), verdicts


def test_the_writable_output_passes_the_gradient_through() -> None:
    import torch

    from meshlab.parallel.tensor import _Writable

    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out = _Writable.apply(x * 2)
    out.add_(1.0)  # allowed: not a view of a custom Function's output
    out.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((3,), 2.0, dtype=torch.float64))
