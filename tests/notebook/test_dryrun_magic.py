"""%mesh dryrun and %mesh plan --verify in a real IPython shell: the user's model factory on
hundreds of fake ranks in the notebook's own process, shown beside the planner."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from meshlab.dry_run.run import DryRun, planner_beside
from meshlab.notebook.tables.dryrun import dryrun_views
from meshlab.plan import Layout
from meshlab.plan.report import Plan

pytest.importorskip("transformers", reason="transformers is a test dependency")


def shown(cap: Any) -> str:
    return cap.stdout + "\n".join(o.data.get("text/plain", "") for o in cap.outputs)


FACTORY = """
from transformers import LlamaConfig, LlamaForCausalLM

def small_llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=4, num_attention_heads=8,
                                        num_key_value_heads=4, max_position_embeddings=256))
"""


def test_dryrun_magic_runs_a_notebook_factory_on_fake_ranks_beside_the_planner(shell: Any
                                                                               ) -> None:
    shell.run_cell(FACTORY)
    with capture_output() as cap:
        shell.run_line_magic("mesh", 'dryrun small_llama --layout "pp=2 dp_shard=32 tp=2 m=2" '
                                     "--seq 128 -o dry")
    dry = shell.user_ns["dry"]
    assert isinstance(dry, DryRun) and dry.world_size == 128
    assert sorted(run.rank for run in dry.ranks) == [0, 64]  # one per pipeline stage
    text = shown(cap)
    assert "LlamaForCausalLM on 128 fake ranks" in text, text
    assert "rank 0 (" in text and "rank 64 (" in text
    assert "fits h100-sxm: yes" in text
    memory, sent, chart = cap.outputs[-3:]
    assert re.search(r"planner \((KiB|MiB|GiB)\)", memory.data["text/plain"])  # the chart's unit
    assert "tp" in sent.data["text/plain"] and "dp_shard" in sent.data["text/plain"]
    assert "image/svg+xml" in chart.data
    with torch.device("meta"):
        whole = sum(p.numel() for p in shell.user_ns["small_llama"]().parameters())
    for run in dry.ranks:  # half the layers, over 32 x 2 ranks: never the whole model
        assert 0 < run.params < whole / 32, (run.params, whole)
        assert run.memory["total"] > 0
    assert_the_chart_reads_as_the_text_beside_it(dry)


def assert_the_chart_reads_as_the_text_beside_it(dry: DryRun) -> None:
    """Each bar ends where the summary and the table's total row say: the dry run's at its
    step's peak (its categories as they stood then), the planner's at its total."""
    summary, memory, _, chart = dryrun_views(dry, "h100-sxm")
    spec = chart.chart.to_dict()
    (values,) = [v for v in spec["datasets"].values()]
    bars: dict[str, float] = {}
    for mark in values:
        bars[mark["row"]] = bars.get(mark["row"], 0.0) + mark["amount"]
    unit = spec["layer"][0]["encoding"]["x"]["title"].split()[0]
    size = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    frame = memory.frame.set_index(["rank", "category"])
    column = next(c for c in frame.columns if c.startswith("planner ("))
    table_unit = 2 ** (10 * ("B", "KiB", "MiB", "GiB").index(column[9:-1]))
    for run in dry.ranks:
        peak = run.memory["total"]
        assert bars[f"rank {run.rank}: dry run"] * size == pytest.approx(peak, rel=1e-9)
        assert f"peak {peak / size:.3g} {unit}" in summary.text
        planned = frame.loc[(run.rank, "total"), column] * table_unit
        assert bars[f"rank {run.rank}: planner"] * size == pytest.approx(planned, rel=1e-9)


def test_dryrun_magic_names_a_bad_layout_and_the_fix(shell: Any) -> None:
    with pytest.raises(UsageError, match="microbatches"):
        shell.run_line_magic("mesh", 'dryrun meshlab --layout "pp=2 dp_shard=2 m=1"')
    with pytest.raises(UsageError, match="arguments are required: --layout"):
        shell.run_line_magic("mesh", "dryrun meshlab")


def test_plan_verify_dry_runs_the_best_layouts(shell: Any) -> None:
    with capture_output() as cap:
        shell.run_line_magic("mesh", 'plan meshlab --gpus 64 --batch 128 --where "pp=2" '
                                     "--top 3 --verify 2 -o checked")
    plan = shell.user_ns["checked"]
    assert isinstance(plan, Plan) and len(plan.verified) == 2
    table = cap.outputs[-1].data["text/plain"]
    assert re.search(r"dry run peak \((KiB|MiB|GiB)\)", table)
    for estimate, dry in zip(plan.estimates, plan.verified, strict=False):
        assert Layout.parse(dry.layout) == estimate.layout and dry.world_size == 64


def test_plan_verify_dry_runs_gradient_accumulation_without_fsdp(shell: Any) -> None:
    """torch's MemTracker takes a model's second forward for a second step and refused it:
    `--verify` on the layout the planner found best for this model on CPUs (zero=0, m > 1)
    ended in a bare NotImplementedError."""
    with capture_output():
        shell.run_line_magic("mesh", 'plan meshlab --gpus 4 --hardware cpu --layout '
                                     '"dp_shard=4 zero=0 mbs=2 m=3" --verify 1 -o accumulated')
    [dry] = shell.user_ns["accumulated"].verified
    assert "microbatches=3" in dry.layout and dry.ranks[0].memory["activations"] > 0


NANOGPT = """
import math
import torch
from torch import nn
from torch.nn import functional as F
from meshlab.parallel import ParallelPlan

class LayerNorm(nn.Module):  # nanoGPT's, as written: no reset_parameters()
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)

class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = LayerNorm(d, True), LayerNorm(d, True)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))

class GPT(nn.Module):
    def __init__(self, vocab=256, d=64, layers=2, heads=4):
        super().__init__()
        self.config = type("Config", (), {"vocab_size": vocab, "hidden_size": d})()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = LayerNorm(d, True)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

mlp_tp = ParallelPlan(tp_plan={"h.*.c_fc": "colwise", "h.*.mlp_proj": "rowwise"})
clashing = ParallelPlan(data_parallel="ddp", tp_plan=mlp_tp.tp_plan)
"""


def test_dryrun_magic_takes_a_hand_written_model_and_its_plan(shell: Any) -> None:
    """nanoGPT as written: a LayerNorm with no reset_parameters() (a dry run fills nothing),
    its TP plan from a notebook ParallelPlan (--plan); a plan that contradicts the layout is
    refused naming both."""
    shell.run_cell(NANOGPT)
    with capture_output():
        shell.run_line_magic("mesh", 'dryrun GPT --layout "dp_shard=8 tp=2" --seq 32 '
                                     "--plan mlp_tp -o gpt")
    [run] = shell.user_ns["gpt"].ranks
    tp = [t for t in run.collectives if t.axis == "tp"]
    assert tp and run.memory["total"] > 0, run.collectives
    # the planner's shape read from its modules: its parameters are the model's but its
    # biases (the planner's shape has none)
    dry = shell.user_ns["gpt"]
    assert dry.shape is not None and (dry.shape["hidden"], dry.shape["heads"],
                                      dry.shape["ffn"], dry.shape["gated_ffn"]) == (64, 4, 256,
                                                                                   False)
    rows = {r.name: r for r in planner_beside(dry) if r.what == "memory"}
    assert rows["params"].comparable and rows["params"].planner > 0
    assert not rows["activations"].comparable and "hand-written" in rows["buffers"].difference
    with pytest.raises(UsageError, match=r"plan sets data_parallel='ddp', which the layout "
                                         r"decides otherwise \(data_parallel='zero3'\)"):
        shell.run_line_magic("mesh", 'dryrun GPT --layout "dp_shard=8 tp=2" --seq 32 '
                                     "--plan clashing")
    with pytest.raises(UsageError, match="--plan nothing: not defined in the notebook"):
        shell.run_line_magic("mesh", 'dryrun GPT --layout "dp_shard=8 tp=2" --plan nothing')
    # without a plan: refused with one read off its Linears, and how a dry run takes it
    with pytest.raises(UsageError, match=r"(?s)GPT ships no tensor-parallel plan: pass "
                                         r"ParallelPlan\(tp_plan=.*%mesh dryrun \.\.\. --plan "
                                         r"NAME"):
        shell.run_line_magic("mesh", 'dryrun GPT --layout "dp_shard=8 tp=2" --seq 32')
