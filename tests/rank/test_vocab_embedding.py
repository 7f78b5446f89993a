"""The tp-split embedding's gradient is this rank's rows of the vocabulary, as its weight is
(meshlab.parallel.vocab_embedding), and equals one process's: on a bare embedding whose
vocabulary tp does not divide (with a padding row), on meshlab's Transformer and on a
transformers Llama under sequence parallelism. torch's RowwiseParallel gave it a Replicate
gradient at the whole vocabulary."""

from __future__ import annotations

import pytest

from meshlab import Cluster

RUN = """
import torch, transformers as T
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from meshlab.models import ModelConfig, Transformer
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.parallel.vocab_embedding import VocabParallelEmbedding

tp = mesh["tp"]
tokens = torch.randint(0, 63, (4, 16), generator=torch.Generator().manual_seed(1))
weights = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

def bare(style):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(63, 8, padding_idx=40, dtype=torch.float64)
    if style is not None:  # the output split along the sequence: this rank's half
        parallelize_module(emb, tp, style(input_layouts=Replicate(), output_layouts=Shard(1)))
    out = emb(tokens)
    part = weights if style is None else weights.chunk(2, 1)[tp.get_local_rank()]
    (out * part).sum().backward()
    return emb.weight.grad

def llama():
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

def model_grad(build, parallel):
    torch.manual_seed(0)
    model = build().to(torch.float64)
    if parallel:
        model = parallelize(model, tp, ParallelPlan(data_parallel="none", seq_len=16,
                                                    sequence_parallel=True))
    out = model(tokens)
    getattr(out, "logits", out).logsumexp(-1).mean().backward()
    emb = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return emb.weight.grad

def said(grad, one):
    whole = grad.full_tensor()
    return (str(grad.placements), tuple(grad.to_local().shape), (whole - one).abs().max().item(),
            one.abs().max().item())

found = {"bare": said(bare(VocabParallelEmbedding), bare(None)),
         "torch's": said(bare(RowwiseParallel), bare(None))}
for name, build in (("meshlab", lambda: Transformer(ModelConfig(n_layers=2))), ("llama", llama)):
    found[name] = said(model_grad(build, True), model_grad(build, False))
found
"""


@pytest.mark.cluster
def test_the_embeddings_gradient_is_this_ranks_rows_and_one_processs(cluster: Cluster) -> None:
    cluster.init_mesh("dp=2 tp=2")
    result = cluster.run(RUN, keep_values=True)
    assert 0 in result.values, result.notes
    found = result.values[0]
    # 63 rows over 2 ranks: 32 and 31, the gradient laid out as the weight
    assert found["bare"][:3] == ("(Shard(dim=0),)", (32, 8), 0.0)
    assert found["torch's"][:2] == ("(Replicate(),)", (63, 8))  # what this replaces
    for name, rows, width in (("meshlab", 128, 64), ("llama", 32, 32)):
        placement, shape, gap, scale = found[name]
        assert (placement, shape) == ("(Shard(dim=0),)", (rows, width)), found[name]
        # float64: the other layers' tp sums reorder additions, ~1e-16 relative each
        assert gap <= 1e-12 * scale, found[name]
