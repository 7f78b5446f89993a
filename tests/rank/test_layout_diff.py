"""The layout diff (meshlab.verify.layout_diff) on real ranks: correct layouts match one
process module by module, and each deliberately broken plan is named where its bug lives.

The bug kinds are here, not in the tool: each is an edit of the parallel run's model, before
or after parallelize, that a real plan could make by mistake.
"""

from __future__ import annotations

from typing import Any

import pytest

from meshlab.notebook.cluster import Cluster

pytestmark = pytest.mark.cluster

CELL = """
import torch, meshlab.mesh
from meshlab.models import ModelConfig
from meshlab.parallel import ParallelPlan
from meshlab.verify.layout_diff import diff_with_itself, diff_with_single_process
from meshlab.verify.two_layouts import diff_layouts
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

diffs = {{}}
cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64)

def left_out_of_ddp(model):  # a replicated parameter DDP does not all-reduce
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["layers.1.ffn_norm.weight"])
    return model

def rows_swapped(model):  # tp rank 0's shard of a column-parallel weight in the wrong order
    weight = model.layers["0"].attention.wk.weight
    if meshlab.mesh.build("dp=2 tp=2")["tp"].get_local_rank() == 0:
        with torch.no_grad():
            local = weight.to_local()
            local.copy_(local.roll(1, dims=0))
    return model

def untied(model):  # the output layer given its own copy of the tied embedding
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model

def averaged_twice(model):  # a replicated weight's gradient divided by the dp ranks again
    model.module.layers["1"].attention_norm.weight.register_hook(lambda grad: grad / 4)
    return model

def tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=64, max_position_embeddings=16,
        tie_word_embeddings=True))

def unseeded_noise(model):  # a draw outside the seeded generator, as a racing kernel would
    import time
    noise = torch.Generator().manual_seed(time.monotonic_ns())
    model.layers["1"].feed_forward.register_forward_hook(
        lambda m, args, out: out + 1e-9 * torch.rand(out.shape, generator=noise,
                                                     dtype=out.dtype))
    return model

import meshlab.verify.layout_diff as layout_diff
for name, edits in (("itself", {{}}), ("itself, unseeded", dict(after=unseeded_noise)),
                    ("itself, unseeded, digests", dict(after=unseeded_noise))):
    layout_diff.DIGEST_ABOVE = 0 if "digests" in name else 1 << 20  # every tensor a digest
    d = diff_with_itself(cfg, meshlab.mesh.build("dp=4"), ParallelPlan(data_parallel="zero3"),
                         steps=2, **edits)
    first = d.first
    diffs[name] = (max(x.error for x in d.differences), str(d),
                   None if first is None else (first.step, first.phase, first.module), [])

deep = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64)

def sp_without_gather(model):  # the attention's input not gathered over the sequence: each tp
    tp = meshlab.mesh.build("dp=2 tp=2")["tp"]  # rank tiles its own chunk in its place
    def tiled(module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        local = x.to_local() if isinstance(x, DTensor) else x
        mine = local.chunk(2, dim=1)[tp.get_local_rank()].repeat(1, 2, 1)
        mine = DTensor.from_local(mine, x.device_mesh, x.placements) \
            if isinstance(x, DTensor) else mine
        return ((mine, *args[1:]), kwargs) if args else (args, {{**kwargs, "x": mine}})
    model.layers["0"].attention.register_forward_pre_hook(tiled, with_kwargs=True)
    return model

class Attention(torch.nn.Module):  # written by hand, with biases (a key bias's gradient is 0)
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm(x)
        q, k, v = (f(h).view(B, T, 4, 8).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(a.transpose(1, 2).reshape(B, T, 32))

class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)
        self.blocks = torch.nn.ModuleList([Attention(), Attention()])

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

moe = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64,
                  n_experts=4, top_k=2)

def wrong_expert_rank(model):  # each token sent to the other ep rank's expert of its index
    layer = model.layers["0"].feed_forward
    send = layer.dispatch
    layer.dispatch = lambda m, tokens, experts, weights: send(m, tokens, (experts + 2) % 4,
                                                              weights)
    return model

def wrong_block(model):  # stage 1 opened with block 1's weights (a loader off by one block)
    model.layers["2"].load_state_dict(model.layers["1"].state_dict())
    return model

CASES = {{
    "ddp": ("dp=4", dict(data_parallel="ddp"), {{}}),
    "zero3": ("dp=4", dict(data_parallel="zero3"), {{}}),
    "tp_sp": ("dp=2 tp=2", dict(), {{}}),
    "left_out_of_ddp": ("dp=4", dict(data_parallel="ddp"), dict(before=left_out_of_ddp)),
    "rows_swapped": ("dp=2 tp=2", dict(), dict(after=rows_swapped)),
    "averaged_twice": ("dp=4", dict(data_parallel="ddp"), dict(after=averaged_twice)),
    "untied": ("dp=4", dict(data_parallel="ddp"), dict(before=untied, model=tied_llama)),
    "pp": ("dp=2 pp=2", dict(microbatches=2), dict(model=deep)),
    "pp_gpipe_llama": ("dp=2 pp=2", dict(pipeline_schedule="gpipe", microbatches=4),
                       dict(model=tied_llama)),
    "wrong_block": ("dp=2 pp=2", dict(), dict(model=deep, before=wrong_block)),
    "sp_without_gather": ("dp=2 tp=2", dict(), dict(after=sp_without_gather)),
    "ep": ("dp=4 ep=2", dict(data_parallel="none"), dict(model=moe)),
    "gpt_zero3": ("dp=4", dict(data_parallel="zero3"), dict(model=GPT)),
    # options in pairs: the accumulation EP once trained wrong with, a pipeline over TP
    "ep_accum": ("dp=4 ep=2", dict(data_parallel="none", grad_accum=2), dict(model=moe)),
    "zero3_accum": ("dp=4", dict(grad_accum=2), {{}}),
    "pp_tp": ("pp=2 tp=2", dict(), dict(model=deep)),
    "wrong_expert_rank": ("dp=4 ep=2", dict(data_parallel="none"),
                          dict(model=moe, after=wrong_expert_rank)),
}}
for name, (mesh, plan, edits) in CASES.items():
    model = edits.pop("model", cfg)
    d = diff_with_single_process(model, meshlab.mesh.build(mesh), ParallelPlan(**plan),
                                 steps=2, **edits)
    first = d.first
    diffs[name] = (max(x.error for x in d.differences), str(d),
                   None if first is None else (first.step, first.phase, first.module),
                   d.not_compared[:5])
    if name == "rows_swapped":
        diffs["rows_swapped diff"] = d

# two layouts beside each other: ZeRO-3 on dp=4 and TP+SP on dp=2 tp=2, then the second
# given the wrong shard (its ranks named, and which of the two departed from one process)
zero3 = ("dp=4", ParallelPlan(data_parallel="zero3"))
tp_sp = ("dp=2 tp=2", ParallelPlan())
for name, edits in (("two layouts", {{}}), ("two layouts, rows_swapped",
                                          dict(after=rows_swapped))):
    d = diff_layouts(cfg, zero3, tp_sp, names=("zero3", "tp_sp"), steps=2, **edits)
    first = d.first
    diffs[name] = (max(x.error for x in d.differences), str(d),
                   None if first is None else (first.step, first.phase, first.module,
                                               first.layout, first.rank), d.not_compared[:5])
diffs
"""


def test_correct_layouts_match_and_each_broken_one_is_named_where_its_bug_lives(
        cluster: Cluster) -> None:
    diffs = cluster.run(CELL.format(), keep_values=True, timeout=240).values[0]
    for correct in ("ddp", "zero3", "tp_sp", "pp", "pp_gpipe_llama", "ep", "gpt_zero3",
                    "ep_accum", "zero3_accum", "pp_tp"):
        worst, _, first, unheld = diffs[correct]
        assert first is None and worst < 1e-4 and not unheld, (correct, diffs[correct])
    assert diffs["itself"][0] == 0.0 and diffs["itself"][1].startswith("bit-identical")
    assert diffs["itself, unseeded"][2] == (0, "forward", "layers.1.feed_forward")
    # the first run kept as digests: the same tensor named, its error infinite (no magnitude)
    assert diffs["itself, unseeded, digests"][2] == (0, "forward", "layers.1.feed_forward")
    assert diffs["itself, unseeded, digests"][0] == float("inf")
    assert diffs["left_out_of_ddp"][2] == (0, "parameter gradient", "layers.1.ffn_norm.weight")
    assert diffs["rows_swapped"][2] == (0, "forward", "layers.0.attention.wk")
    # what %mesh compare shows of it: the table leads with the module, the picture outlines it
    from meshlab.notebook.tables.layout_diff import layout_diff_frame, layout_diff_views

    diff = diffs["rows_swapped diff"]
    frame = layout_diff_frame(diff)
    first = frame[frame["first"]]
    assert list(first["module"]) == ["layers.0.attention.wk"], first
    assert (first["ranks beyond"].iloc[0]) == "0,2"  # tp rank 0 of each dp pair
    verdict, table, chart = layout_diff_views(diff)
    assert str(verdict).startswith(
        "first difference from one process: step 0, forward of layers.0.attention.wk")
    assert table.frame["error"].iloc[0] == frame["error"].max()
    spec = chart.spec()
    assert "outlined" in str(spec["title"]) and spec["facet"]["column"]["field"] == "phase"
    assert diffs["averaged_twice"][2] == (0, "parameter gradient",
                                          "layers.1.attention_norm.weight")
    assert diffs["untied"][2] == (0, "parameter gradient", "model.embed_tokens.weight")
    assert diffs["wrong_expert_rank"][2] == (0, "forward", "layers.0.feed_forward"), \
        diffs["wrong_expert_rank"]
    assert diffs["sp_without_gather"][2] == (0, "forward", "layers.0.attention.wq"), \
        diffs["sp_without_gather"]
    # the block's first weight (its norm's are ones in both blocks, as initialised)
    assert diffs["wrong_block"][2] == (0, "forward", "layers.2.attention.wq"), \
        diffs["wrong_block"]
    # two layouts: every tensor of each compared with the other's, both ways
    worst, said, first, unheld = diffs["two layouts"]
    assert first is None and worst < 1e-10 and not unheld, diffs["two layouts"]
    assert said.startswith("matches zero3: ") and "tp_sp: matches one process" in said
    worst, said, first, _ = diffs["two layouts, rows_swapped"]
    assert first[:4] == (0, "forward", "layers.0.attention.wk", "tp_sp"), said
    assert first[4] in (0, 2)  # tp rank 0 of a dp pair: the ranks whose shard was rolled
    assert "zero3: matches one process" in said
    assert "tp_sp: first difference from one process: step 0, forward of " \
        "layers.0.attention.wk" in said


def test_mesh_compare_prints_the_verdict_and_keeps_the_diff(shell: Any, capsys: Any) -> None:
    shell.run_line_magic("mesh", "init dp=4")
    shell.run_cell_magic("mesh", "", "from meshlab.models import ModelConfig\n"
                         "from meshlab.parallel import ParallelPlan\n"
                         "tiny = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, "
                         "vocab_size=64, ffn_hidden=64)\n"
                         "zero3 = ParallelPlan(data_parallel='zero3')\n"
                         "tp_sp = ParallelPlan()")
    capsys.readouterr()
    shell.run_line_magic("mesh", "compare tiny zero3 --steps 1 -o diff")
    diff = shell.user_ns["diff"]
    assert diff.ok and diff.differences and {d.rank for d in diff.differences} == {0, 1, 2, 3}
    assert capsys.readouterr().out.startswith("matches one process: ")
    shell.run_line_magic("mesh", "compare tiny zero3 --steps 1 --itself")
    assert capsys.readouterr().out.startswith("bit-identical run to run: ")
    shell.run_line_magic("mesh", "compare tiny zero3 --steps 1 --beside tp_sp "
                         "--beside-mesh dp=2,tp=2")
    said = capsys.readouterr().out
    assert said.startswith("matches zero3 on dp_shard=4: "), said
    assert "tp_sp on dp_shard=2 tp=2: matches one process" in said
    with pytest.raises(Exception, match=r"beside_mesh='dp=3'.*4 ranks"):
        shell.run_line_magic("mesh", "compare tiny zero3 --beside tp_sp --beside-mesh dp=3")
