"""Sequence parallelism keeps its gathered inputs as shards and gathers them again in the
backward (meshlab.parallel.sp_regather): the same gradients to the bit, with the bytes
the derivation says saved, on meshlab's Transformer and on a transformers model, alone and
under autocast, FSDP2's bf16, activation checkpointing and activation offload."""

from __future__ import annotations

import pytest

from meshlab import Cluster

RUN = """
import torch, transformers as T
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.measure.memory import activation_bytes

def llama():
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))

BUILD = {"meshlab": lambda: Transformer(ModelConfig(n_layers=2)), "llama": llama}
# autocast over fp32 weights runs without FSDP: on each tp group alone (DDP takes no DTensors)
CASES = {"fp32": {}, "bf16 autocast": dict(data_parallel="none", mixed_precision="bf16"),
         "bf16 fsdp": dict(mixed_precision="bf16"), "full ac": dict(activation_checkpoint="full"),
         "offload": dict(offload_activations=True)}
tokens = local_batch(step=0, batch=8, seq=16, vocab=64, rank=mesh["dp"].get_local_rank(),
                     ranks=2)[0]

def logits(out):
    return getattr(out, "logits", out).float()

found = {}
for family, build in BUILD.items():
    for case, options in CASES.items():
        runs = []
        for regather in (False, True):
            torch.manual_seed(0)
            on = mesh["tp"] if options.get("data_parallel") == "none" else mesh
            model = parallelize(build(), on, ParallelPlan(
                seq_len=16, sequence_parallel=True, sp_regather=regather, **options))
            saved = activation_bytes(model, tokens)
            loss = logits(model(tokens)).logsumexp(-1).mean()
            loss.backward()
            grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
                     for n, p in model.named_parameters()}
            runs.append((loss.item(), grads, saved))
        (loss0, grads0, saved0), (loss1, grads1, saved1) = runs
        found[f"{family}/{case}"] = (loss0 == loss1, max((grads0[n] - grads1[n]).abs().max().item()
                                                   for n in grads0), saved0 - saved1)
found
"""


@pytest.mark.cluster
def test_regathered_inputs_give_the_same_gradients_and_save_what_the_derivation_says(
        cluster: Cluster) -> None:
    cluster.init_mesh("dp=2 tp=2")
    result = cluster.run(RUN, keep_values=True)
    assert 0 in result.values, result.notes
    found = result.values[0]
    for key, (same_loss, grad_diff, _) in found.items():
        assert same_loss and grad_diff == 0.0, (key, grad_diff)  # the same values, regathered
    # a layer's attention and MLP each keep their input's part, not the whole: 64 tokens a
    # rank (4 sequences of 16) x h x (1 - 1/tp) x bytes, twice a layer, 2 layers
    def saving(h: int, nbytes: int) -> float:
        return 2 * 2 * 64 * h * (1 - 1 / 2) * nbytes

    for family, h in (("meshlab", 64), ("llama", 32)):
        assert found[f"{family}/fp32"][2] == saving(h, 4)
        assert found[f"{family}/bf16 fsdp"][2] == saving(h, 2)  # FSDP2's bf16 activations
        # autocast's three 16-bit copies of the attention's input (q, k, v) and two of the
        # MLP's (gate, up) give way to the fp32 part: 2 (3 + 2) h bytes whole, 2 x 4h/tp kept
        assert found[f"{family}/bf16 autocast"][2] == 2 * 64 * h * (2 * (3 + 2) - 2 * 4 / 2)
