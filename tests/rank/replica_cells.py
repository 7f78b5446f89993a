"""Cells the replica-mode tests share (tests/rank/test_local_sgd.py, test_edit.py,
test_parameter_server.py): run on every rank by ``cluster.run``."""

TWO_RUNS = """
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank, full_parameters, train
r, n = data_rank(mesh)
batches = [local_batch(step=s, batch=8, seq=16, vocab=256, rank=r, ranks=n) for s in range(4)]
runs = []
for options, chunks in {runs}:
    plan = ParallelPlan(**options)
    torch.manual_seed(0)
    model = parallelize(Transformer(ModelConfig()).double(), mesh, plan)
    opt = build_optimizer(model, mesh, plan, **{optimizer})
    losses = [l for lo, hi in chunks
              for l in train(model, opt, batches[lo:hi], average_over=mesh["dp"].get_group())]
    runs.append((losses, full_parameters(model)))
(first_losses, first), (second_losses, second) = runs
(max(abs(a - b) for a, b in zip(first_losses, second_losses)),
 max(((first[k] - second[k]).abs().max() / first[k].abs().max()).item() for k in first))
"""
"""The same float64 model trained under two plans (``runs``: [(ParallelPlan options,
[(first, last) batches of each train() call])]) on the same 4 batches: (largest loss gap,
largest parameter gap relative to the tensor's largest value)."""

TINY_LLAMA = """
import transformers as T
def llama():  # a model meshlab did not write, its blocks found by transformers' own names
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False))
"""
"""Defines ``llama()``: a tiny transformers Llama, built from its config."""
