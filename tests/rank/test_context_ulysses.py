"""Ulysses and FPDT-style chunked context parallel: each trains like one process (float64,
losses and parameters to 1e-9), refuses what it cannot split, and moves the bytes its
formula says (the all-to-all's constant when sequence and cp grow together).
"""

from __future__ import annotations

import pytest
import torch

from meshlab import Cluster
from meshlab.parallel import ParallelPlan
from meshlab.parallel.context_chunked import AttendBlock

CELL = """
from meshlab.models import ModelConfig
from meshlab.parallel import ParallelPlan
from meshlab.verify.compare import compare_with_single_process
from transformers import LlamaConfig, LlamaForCausalLM
result = compare_with_single_process({model}, mesh, ParallelPlan({plan}), steps=2, batch=4,
                                     dtype=torch.float64, optimizer={optimizer!r})
(result.ok, result.max_loss_error, result.max_param_error, result.worst_param)
"""

GQA = "ModelConfig(n_heads=8, n_kv_heads=4)"  # two query heads per key/value head


def llama(extra: str = "") -> str:
    """A tiny transformers Llama with grouped-query attention, built from its config."""
    return ("lambda: LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, "
            "intermediate_size=64, num_hidden_layers=2, num_attention_heads=8, "
            f"num_key_value_heads=4, max_position_embeddings=32{extra}))")


LLAMA = llama()

RUNS = [
    ("cp=4", GQA, "data_parallel='zero2', context_parallel='ulysses'"),
    ("dp=2 cp=2", GQA, "data_parallel='ddp', context_parallel='ulysses'"),
    ("cp=2 tp=2", GQA, "data_parallel='zero3', context_parallel='ulysses'"),
    ("dp=2 cp=2", LLAMA, "data_parallel='ddp', context_parallel='ulysses'"),
    ("cp=2 tp=2", LLAMA, "data_parallel='zero3', context_parallel='ulysses'"),
    ("cp=4", GQA, "data_parallel='zero2', context_parallel='chunked', cp_chunks=4, "
                  "cp_offload=True"),
    ("dp=2 cp=2", LLAMA, "data_parallel='ddp', context_parallel='chunked', cp_chunks=3"),
    ("cp=4", llama(", attn_implementation='eager'"),
     "data_parallel='zero2', context_parallel='ulysses'"),
]


@pytest.mark.cluster
@pytest.mark.parametrize("spec, model, plan", RUNS,
                         ids=["ulysses-cp4", "ulysses-dp2cp2", "ulysses-cp2tp2",
                              "ulysses-llama-dp2cp2", "ulysses-llama-cp2tp2",
                              "chunked-offload-cp4", "chunked-llama-dp2cp2",
                              "ulysses-llama-eager-cp4"])
def test_head_split_context_parallel_trains_like_one_process(cluster: Cluster, spec: str,
                                                             model: str, plan: str) -> None:
    cluster.init_mesh(spec)
    result = cluster.run(CELL.format(model=model, plan=plan, optimizer="adamw"), timeout=120)
    verdicts = [out.result or "" for out in result.outputs.values()]
    assert all(v.startswith("(True,") for v in verdicts), f"{spec} {plan}: " + result.results()


@pytest.mark.cluster
def test_chunked_eager_llama_matches_one_process_to_its_float32_softmax(cluster: Cluster
                                                                         ) -> None:
    """transformers' eager attention softmaxes in float32: a query chunk's rows, shorter
    than one process's (masked keys left out), sum in another order, so AdamW, which
    divides by each gradient's own scale, moves parameters by 2e-4 (measured); with SGD both
    hold float64's tolerances (measured: losses 9e-11, parameters 2e-9 of 1e-8)."""
    cluster.init_mesh("cp=4")
    plan = "data_parallel='zero2', context_parallel='chunked', cp_chunks=2, cp_offload=True"
    result = cluster.run(CELL.format(model=llama(", attn_implementation='eager'"), plan=plan,
                                     optimizer="sgd"), timeout=120)
    verdicts = [out.result or "" for out in result.outputs.values()]
    assert all(v.startswith("(True,") for v in verdicts), result.results()


@pytest.mark.cluster
@pytest.mark.parametrize("model, why", [
    ("Transformer(ModelConfig())", r"context_parallel='ulysses' splits attention heads over "
     r"cp=4, and meshlab's Transformer has 4 query and 2 key/value heads; expected both "
     r"multiples of 4: use context_parallel='meshlab'"),
    ("T.GptOssForCausalLM(T.GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, "
     "num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=8, "
     "num_local_experts=2, num_experts_per_tok=1, attn_implementation='eager'))",
     r"has parameters its attention function reads for all heads \(sinks\); use "
     r"context_parallel='meshlab'"),
], ids=["heads-not-divisible", "gpt-oss-sinks"])
def test_ulysses_refuses_heads_it_cannot_split(cluster: Cluster, model: str, why: str) -> None:
    from meshlab import MeshError

    cluster.init_mesh("cp=4")
    with pytest.raises(MeshError, match=why):
        cluster.run("import transformers as T\n"
                    "from meshlab.parallel import ParallelPlan, parallelize\n"
                    "from meshlab.models import ModelConfig, Transformer\n"
                    f"parallelize({model}, mesh, ParallelPlan(data_parallel='ddp', "
                    "context_parallel='ulysses'))")


def test_chunk_options_apply_to_chunked_only() -> None:
    with pytest.raises(ValueError, match=r"cp_chunks=8, cp_offload=False apply to "
                                         r"context_parallel='chunked', not 'ulysses'"):
        ParallelPlan(context_parallel="ulysses", cp_chunks=8)
    with pytest.raises(ValueError, match=r"cp_chunks=0 must be an integer >= 1"):
        ParallelPlan(context_parallel="chunked", cp_chunks=0)


STEP = """
from meshlab.models import ModelConfig, Transformer
from meshlab.models.llama import loss_fn
from meshlab.parallel.context import apply_cp, sequence_slice
torch.manual_seed(0)
model = apply_cp(Transformer(ModelConfig(n_heads=8, n_kv_heads=4)), mesh, seq_len={T},
                 impl={impl!r})
tokens = torch.randint(0, 256, (2, {T} + 1))
x, y = sequence_slice(tokens[:, :-1], mesh), sequence_slice(tokens[:, 1:], mesh)
"""

B, H, KV, D, LAYERS, FLOAT = 2, 8, 4, 8, 2, 4  # the step's batch and ModelConfig's shapes


def cp_bytes(cluster: Cluster, spec: str, seq: int, impl: str) -> dict[str, int]:
    """Bytes rank 0 moves on the cp group in one forward and backward, by collective."""
    cluster.init_mesh(spec)
    cluster.run(STEP.format(T=seq, impl=impl))
    result = cluster.run("loss_fn(model(x), y).backward()", comms=True)
    totals: dict[str, int] = {}
    for record in result.comms[0]:
        totals[record.op] = totals.get(record.op, 0) + record.bytes
    return totals


@pytest.mark.cluster
def test_ulysses_bytes_stay_constant_as_sequence_and_cp_grow(cluster: Cluster) -> None:
    rows = {(seq, cp, impl): cp_bytes(cluster, spec, seq, impl)
            for seq, cp, spec in [(16, 2, "dp=2 cp=2"), (32, 4, "cp=4")]
            for impl in ("ulysses", "chunked", "meshlab")}
    for (seq, cp, impl), ops in rows.items():
        print(f"T={seq} cp={cp} {impl}: {ops}")
    for seq, cp in [(16, 2), (32, 4)]:
        # q, k, v and the output each way, forward and backward, in every layer
        slices = B * (seq // cp) * D * FLOAT
        assert rows[(seq, cp, "ulysses")] == {"all_to_all": 2 * LAYERS * (2 * H + 2 * KV)
                                              * slices}
        # K and V gathered (repeated to every query head), their gradients all-reduced
        whole = B * H * seq * D * FLOAT
        assert rows[(seq, cp, "meshlab")] == {"all_gather": 2 * LAYERS * whole,
                                              "all_reduce": 2 * LAYERS * whole}
    assert rows[(16, 2, "ulysses")] == rows[(32, 4, "ulysses")]
    assert rows[(16, 2, "chunked")] == rows[(16, 2, "ulysses")]  # chunking moves no more
    assert rows[(32, 4, "meshlab")]["all_gather"] == 2 * rows[(16, 2, "meshlab")]["all_gather"]


def eager_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
                ) -> torch.Tensor:
    """Attention that materialises its scores, as transformers' eager attention does."""
    query_pos = torch.arange(start, start + q.shape[2])[:, None]
    hidden = torch.arange(keys.shape[2])[None, :] > query_pos
    scores = (q @ keys.transpose(-1, -2)).masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


def attention_peak(chunks: int, attend: AttendBlock, seq: int = 128, heads: int = 2) -> int:
    """Peak bytes alive during a forward and backward of chunked attention, as torch's
    MemTracker counts them (every tensor's storage, inputs included)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshlab.parallel.context_chunked import chunked_attention

    q, k, v = (torch.randn(1, heads, seq, 8, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    tracker = MemTracker()
    with tracker:
        chunked_attention(q, k, v, chunks=chunks, attend=attend).sum().backward()
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


@pytest.mark.parametrize("attend", ["eager", "sdpa"])
def test_chunked_attention_holds_a_chunk_of_scores_at_a_time(attend: str) -> None:
    from meshlab.parallel.context_chunked import sdpa_block

    block = eager_block if attend == "eager" else sdpa_block
    peaks = {chunks: attention_peak(chunks, block) for chunks in (1, 4)}
    print(f"{attend}: peak bytes by cp_chunks {peaks}")
    scores = 2 * 128 * 128 * 8  # the whole T x T score matrix of 2 heads in float64
    assert peaks[4] < peaks[1] - scores // 4  # a quarter of the rows at a time


def test_chunked_offload_fetches_each_key_value_chunk_for_every_later_query_chunk() -> None:
    from meshlab.parallel.context_chunked import KVOffload, chunked_attention, sdpa_block

    q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    offload = KVOffload()
    out = chunked_attention(q, k, v, chunks=4, attend=sdpa_block, offload=offload)
    kv = 2 * k.numel() * k.element_size()
    assert offload.moved == kv and offload.fetched == kv // 4 * (1 + 2 + 3 + 4)
    out.sum().backward()  # each query chunk recomputed: its chunks fetched again
    assert offload.fetched == 2 * kv // 4 * (1 + 2 + 3 + 4)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
