"""Context parallel keeps every token's position: batches of any length cp divides, uneven
ones refused on every rank before a collective, and what a model does by position
(chunked attention, an attention temperature) either kept or refused with its reason."""

from __future__ import annotations

import ast

import pytest

from meshlab import Cluster
from meshlab.notebook.output import MeshError

# logits of this rank's slice beside the same model's on the whole sequence, in one process
LOGITS = """
import copy
import transformers as T
from meshlab.models import ModelConfig, Transformer
from meshlab.parallel.context import apply_cp, sequence_slice
torch.manual_seed(0)
model = {model}.to(torch.float64)
whole = copy.deepcopy(model)
apply_cp(model, mesh, seq_len=16, impl={impl!r})
tokens = torch.randint(0, 64, (2, {length}))
def logits(m, x):
    out = m(x)
    return out if isinstance(out, torch.Tensor) else out.logits
mine = logits(model, sequence_slice(tokens, mesh))
ref = sequence_slice(logits(whole, tokens), mesh)  # (B, T/cp, vocab)
float((mine - ref).abs().max() / ref.abs().max())
"""
MESHLAB = "Transformer(ModelConfig(vocab_size=64, n_heads=8, n_kv_heads=4))"
LLAMA = ("T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, "
         "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, "
         "max_position_embeddings=64))")


@pytest.mark.cluster
@pytest.mark.parametrize("model, impl", [(MESHLAB, "meshlab"), (MESHLAB, "ulysses"),
                                         (LLAMA, "meshlab")],
                         ids=["meshlab", "meshlab-ulysses", "llama"])
def test_a_batch_shorter_than_the_plans_seq_len_keeps_its_positions(
        cluster: Cluster, model: str, impl: str) -> None:
    # the plan says 16 tokens; the batches have 8 and 24: each rank's offset is its own
    cluster.init_mesh("cp=4")
    for length in (8, 24):
        result = cluster.run(LOGITS.format(model=model, impl=impl, length=length),
                             keep_values=True)
        errors = result.values
        assert all(e < 1e-12 for e in errors.values()), (length, errors)


@pytest.mark.cluster
def test_an_uneven_split_is_refused_on_every_rank_and_the_cluster_goes_on(cluster: Cluster
                                                                          ) -> None:
    cluster.init_mesh("cp=4")
    with pytest.raises(MeshError) as e:
        cluster.run("from meshlab.parallel.context import sequence_slice\n"
                    "sequence_slice(torch.zeros(2, 30, dtype=torch.long), mesh)")
    assert "4 of 4 ranks failed" in str(e.value), str(e.value)
    assert "30 tokens do not split evenly over cp=4" in str(e.value)
    assert cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()",
                       keep_values=True).values == {r: 4.0 for r in range(4)}


LLAMA4 = """
import transformers as T
from meshlab.parallel import ParallelPlan
from meshlab.verify.compare import compare_with_single_process
config = T.Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    intermediate_size_mlp=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
    max_position_embeddings=64, attention_chunk_size=4, floor_scale=4,
    experts_implementation="eager", {extra})
r = compare_with_single_process(lambda: T.Llama4ForCausalLM(config), mesh,
                                ParallelPlan(data_parallel='zero3'), steps=2,
                                dtype=torch.float64, optimizer="sgd")
(r.ok, r.max_loss_error, r.max_param_error)
"""


@pytest.mark.cluster
def test_llama4s_chunked_attention_layers_keep_their_blocks_under_cp(cluster: Cluster) -> None:
    # 16 tokens in blocks of 4 on cp=2: every rank's keys cross block edges (the mask once
    # dropped them: parameters 1.7e-2 from one process)
    cluster.init_mesh("dp=2 cp=2")
    result = cluster.run(LLAMA4.format(extra="attn_temperature_tuning=False"))
    verdicts = {r: ast.literal_eval(o.result or "") for r, o in result.outputs.items()}
    assert all(v[0] for v in verdicts.values()), verdicts


@pytest.mark.cluster
def test_llama4s_attention_temperature_is_refused_naming_why(cluster: Cluster) -> None:
    cluster.init_mesh("dp=2 cp=2")
    with pytest.raises(MeshError, match=r"attention temperature on its layers without RoPE "
                                        r"\(\[3\]...\) counts positions from 0 in each rank's "
                                        r"slice.*attn_temperature_tuning=False"):
        cluster.run(LLAMA4.format(extra="attn_temperature_tuning=True"))
