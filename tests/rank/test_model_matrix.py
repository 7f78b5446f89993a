"""The model matrix: many model families, each under every strategy, against one process.

Every cell either matches one process (float64, 3 SGD steps, AdamW in one column: losses
1e-9, parameters 1e-8, or 10x the model's own floor where it computes parts in float32, as
compare_with_single_process says in its notes; bf16 cells against fp32: losses 5e-3,
parameters 5e-2) or is
refused before the parallel run trains, with a reason a test below names. Families are
transformers models built from tiny configs (nothing downloaded) and a GPT written in a cell;
they were not written with meshlab in mind.

The table in docs/guides/parallelism.md is this test's output: ``MESHLAB_WRITE_MATRIX=1
python -m pytest tests/rank/test_model_matrix.py`` rewrites it; otherwise the test fails when
they differ.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

import pytest

from meshlab import Cluster

pytest.importorskip("transformers", reason="transformers is a test dependency")

# Defined on the ranks: FAMILIES maps a family to (a factory of its model, what it is).
FAMILIES_SOURCE = '''
import torch, transformers as T
from torch import nn


def _tiny(config_class, **kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return config_class(**{**base, **kw})


MOE = dict(num_experts=4, num_experts_per_tok=2, experts_implementation="eager")


class CellGPT(nn.Module):
    """A GPT written in a cell: tied embedding, pre-norm blocks, returns (logits, None)."""

    def __init__(self, vocab=64, dim=32, heads=4, layers=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(CellBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.config = type("Config", (), {"vocab_size": vocab})()

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)), None


class CellBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head_dim = dim // heads

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (p(h).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))  # (B, nh, T, hs): nh local under TP
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.down(nn.functional.gelu(self.up(self.ln_2(x))))


CELL_TP_PLAN = {"tok": "embedding_rowwise", "head": "colwise_gather_output",
                "blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise",
                "blocks.*.o": "rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

FAMILIES = {
    "Llama": lambda: T.LlamaForCausalLM(_tiny(T.LlamaConfig)),
    "Llama (tied)": lambda: T.LlamaForCausalLM(_tiny(T.LlamaConfig, tie_word_embeddings=True)),
    "Qwen2": lambda: T.Qwen2ForCausalLM(_tiny(T.Qwen2Config, tie_word_embeddings=True)),
    "Qwen3": lambda: T.Qwen3ForCausalLM(_tiny(T.Qwen3Config, head_dim=8,
                                              tie_word_embeddings=True)),
    "Mistral": lambda: T.MistralForCausalLM(_tiny(T.MistralConfig)),
    "Gemma2": lambda: T.Gemma2ForCausalLM(_tiny(T.Gemma2Config, head_dim=8,
                                                attn_implementation="eager")),
    "Gemma3": lambda: T.Gemma3ForCausalLM(_tiny(T.Gemma3TextConfig, head_dim=8,
                                                sliding_window=4)),
    "Phi-3": lambda: T.Phi3ForCausalLM(_tiny(T.Phi3Config)),
    "GPT-2": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_embd=32, n_layer=4,
                                                    n_head=4, n_positions=64, resid_pdrop=0.0,
                                                    embd_pdrop=0.0, attn_pdrop=0.0)),
    "Mixtral": lambda: T.MixtralForCausalLM(_tiny(T.MixtralConfig, num_local_experts=4,
                                                  num_experts_per_tok=2,
                                                  experts_implementation="eager")),
    "Qwen3-MoE": lambda: T.Qwen3MoeForCausalLM(_tiny(T.Qwen3MoeConfig, head_dim=8,
                                                     moe_intermediate_size=16, **MOE)),
    "OLMoE": lambda: T.OlmoeForCausalLM(_tiny(T.OlmoeConfig, **MOE)),
    "GPT in a cell": CellGPT,
}
'''

# strategy -> (mesh, ParallelPlan arguments, how the comparison runs)
FP64 = "dtype=torch.float64, optimizer='sgd'"
ADAMW = "dtype=torch.float64"
BF16 = "dtype=torch.float32, optimizer='sgd'"
STRATEGIES: dict[str, tuple[str, str, str]] = {
    "DDP": ("dp=4", "data_parallel='ddp'", FP64),
    "ZeRO-1": ("dp=4", "data_parallel='zero1'", FP64),
    "ZeRO-2": ("dp=4", "data_parallel='zero2'", FP64),
    "ZeRO-3": ("dp=4", "data_parallel='zero3'", FP64),
    "ZeRO-3 AdamW": ("dp=4", "data_parallel='zero3'", ADAMW),
    "HSDP": ("dp_replicate=2 dp=2", "data_parallel='zero3'", FP64),
    "TP": ("dp=2 tp=2", "data_parallel='zero3'", FP64),
    "TP+SP": ("dp=2 tp=2", "data_parallel='zero3', sequence_parallel=True", FP64),
    "PP 1F1B": ("pp=2 dp=2", "data_parallel='zero3', pipeline_schedule='1f1b'", FP64),
    "PP interleaved": ("pp=2 dp=2", "data_parallel='zero2', pipeline_schedule='interleaved_1f1b',"
                                    " virtual=2, microbatches=4", FP64),
    "PP ZB-H1": ("pp=4", "data_parallel='none', pipeline_schedule='zb_h1', microbatches=4",
                 FP64),
    "CP": ("dp=2 cp=2", "data_parallel='zero3'", FP64),
    "EP": ("dp=4 ep=2", "data_parallel='none'", FP64),
    "AC full": ("dp=4", "data_parallel='zero3', activation_checkpoint='full'", FP64),
    "AC selective": ("dp=4", "data_parallel='zero3', activation_checkpoint='selective'", FP64),
    "offload": ("dp=4", "data_parallel='zero3', offload_params=True, offload_activations=True",
                FP64),
    "grad accum": ("dp=4", "data_parallel='ddp', grad_accum=2", FP64),
    "clipping": ("dp_replicate=2 dp=2", "data_parallel='zero3', max_grad_norm=0.5", FP64),
    "bf16 FSDP": ("dp=4", "data_parallel='zero2', mixed_precision=True", BF16),
    "bf16 autocast": ("dp=4", "data_parallel='ddp', mixed_precision=True", BF16),
    # composed: every axis a norm crosses at once, with recomputation
    "PP×TP, AC, clip": ("pp=2 tp=2", "data_parallel='zero3', activation_checkpoint='full', "
                                     "max_grad_norm=0.5", FP64),
    "EP×DP, AC, clip": ("dp=4 ep=2", "data_parallel='none', activation_checkpoint='selective', "
                                     "max_grad_norm=0.5", FP64),
    # built on the meta device, sharded, then filled: equal to one process at the start, too
    "meta init, TP": ("dp=2 tp=2", "data_parallel='zero3'", FP64 + ", on_meta=True"),
}

# (family or "*", strategy) -> what the refusal must say. Anything else must match one process.
DENSE = ["Llama", "Llama (tied)", "Qwen2", "Qwen3", "Mistral", "Gemma2", "Gemma3", "Phi-3",
         "GPT-2", "GPT in a cell"]
NO_PP_PLAN = ["GPT-2", "GPT in a cell"]
REFUSED: dict[tuple[str, str], str] = {
    **{(f, s): "expert parallel (ep=2) is applied to meshlab's Transformer and transformers' "
               "MoE models" for f in DENSE for s in ("EP", "EP×DP, AC, clip")},
    **{(f, s): "a pipeline split (pp=2) is applied to meshlab's Transformer and transformers' "
               "causal LMs" for f in NO_PP_PLAN for s in ("PP 1F1B", "PP interleaved",
                                                          "PP×TP, AC, clip")},
    **{(f, "PP ZB-H1"): "a pipeline split (pp=4)" for f in NO_PP_PLAN},
    **{(f, "CP"): "context parallel (cp=2) is applied to" for f in NO_PP_PLAN},
    # meshlab's GPT-2 plan uses its Conv1D styles (torch ParallelStyles): no SP derived
    ("GPT-2", "TP+SP"): "the TP plan has no SequenceParallel entry",
    # the MoE experts' own TP style has no sequence-parallel form
    **{(f, "TP+SP"): "has no sequence-parallel form" for f in ("Mixtral", "Qwen3-MoE", "OLMoE")},
}

CELL = '''
from meshlab.parallel import ParallelPlan
from meshlab.parallel.reused_references import reusing_references
from meshlab.parallel.verify import compare_with_single_process
from meshlab.schedules import ScheduleError
import meshlab.mesh

def _cell(family, mesh, plan, how):
    try:
        r = eval(f"compare_with_single_process(FAMILIES[family], meshlab.mesh.build(mesh), "
                 f"ParallelPlan({plan}), steps=3, {how})")
    except (ValueError, ScheduleError) as e:
        return ("refused", str(e))
    except Exception as e:
        return ("error", f"{type(e).__name__}: {e}")
    return ("ok" if r.ok else "DIFFERS", r.max_loss_error, r.max_param_error, r.worst_param,
            r.param_rtol, r.notes)

_matrix = {}
with reusing_references():  # one family's strategies share their one-process runs
    for _strategy, (_mesh, _plan, _how) in STRATEGIES.items():
        if "tp=" in _mesh and FAMILY == "GPT in a cell":
            _plan += ", tp_plan=CELL_TP_PLAN"
        _matrix[_strategy] = _cell(FAMILY, _mesh, _plan, _how)
_matrix
'''


FAMILY_NAMES = re.findall(r'^    "([^"]+)":', FAMILIES_SOURCE, re.M)
RESULTS: dict[str, dict[str, tuple[Any, ...]]] = {}


@pytest.mark.cluster
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_strategy_matches_one_process_or_is_refused_with_its_reason(
        cluster: Cluster, family: str) -> None:
    setup = f"{FAMILIES_SOURCE}\nSTRATEGIES = {STRATEGIES!r}\nFAMILY = {family!r}\n"
    result = cluster.run(setup + CELL, timeout=600)
    verdicts = {rank: ast.literal_eval(out.result or "{}")
                for rank, out in result.outputs.items()}
    matrix = verdicts[0]
    RESULTS[family] = matrix
    faults = []
    for strategy, verdict in matrix.items():
        refusal = REFUSED.get((family, strategy))
        if refusal is not None:
            if verdict[0] != "refused" or refusal not in verdict[1]:
                faults.append(f"{strategy}: expected a refusal saying {refusal!r}, got {verdict}")
        elif verdict[0] != "ok":
            faults.append(f"{strategy}: {verdict}")
        elif strategy.startswith("bf16") and verdict[1] < 1e-7:
            faults.append(f"{strategy}: losses agree to {verdict[1]:.1e}: bf16 did not run")
    for rank, theirs in verdicts.items():  # every rank reaches the same verdicts
        if {s: v[0] for s, v in theirs.items()} != {s: v[0] for s, v in matrix.items()}:
            faults.append(f"rank {rank} disagrees: {theirs}")
    assert not faults, f"{family}:\n" + "\n".join(faults)


MATRIX_PAGE = Path(__file__).parents[2] / "docs" / "guides" / "parallelism.md"
START, END = "<!-- model matrix: written by tests/rank/test_model_matrix.py -->", "<!-- end -->"


def table(results: dict[str, dict[str, tuple[Any, ...]]]) -> str:
    """The matrix as markdown: a family per row, a strategy per column."""
    notes: dict[str, int] = {}

    def cell(verdict: tuple[Any, ...]) -> str:
        if verdict[0] == "refused":  # the reason and its fix, the same for any degree
            reason = re.sub(r"(pp|cp|ep|tp)=\d+", r"\1=N", verdict[1])
            reason = re.sub(r"not yet to \w+", "not yet to this model", reason)
            return f"refused ({notes.setdefault(reason, len(notes) + 1)})"
        return "✓" if verdict[4] in (1e-8, 5e-2) else "✓ *"  # * held to the model's floor

    strategies = list(STRATEGIES)
    lines = ["| family | " + " | ".join(strategies) + " |",
             "|---|" + "---|" * len(strategies)]
    for family, matrix in results.items():
        lines.append(f"| {family} | " + " | ".join(cell(matrix[s]) for s in strategies) + " |")
    lines.append("")
    lines.append("✓ matches one process: float64 losses within 1e-9 and parameters within "
                 "1e-8 after 3 steps (SGD with momentum; AdamW in its column), bf16 against "
                 "float32 within 5e-3 (losses) and 5e-2 (parameters).  ")
    lines.append("✓ * the model computes parts in float32 itself (norms, a router's softmax): "
                 "held to 10x what reordering its sums moves one process alone.  ")
    lines += [f"({n}) {reason}  " for reason, n in notes.items()]
    return "\n".join(lines)


@pytest.mark.cluster
def test_the_readme_shows_the_matrix_as_the_test_found_it() -> None:
    if set(RESULTS) != set(FAMILY_NAMES):
        pytest.skip("the matrix test did not run for every family in this session")
    text = MATRIX_PAGE.read_text()
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    written = f"{START}\n{table(RESULTS)}\n{END}"
    if os.environ.get("MESHLAB_WRITE_MATRIX"):
        MATRIX_PAGE.write_text(before + written + after)
    assert START + rest.split(END, 1)[0] + END == written, (
        "the model matrix in docs/guides/parallelism.md differs from what the test found: "
        "rerun with MESHLAB_WRITE_MATRIX=1 to write it\n" + table(RESULTS))
