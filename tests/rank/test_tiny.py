"""A plan proved on a tiny copy of the user's own model before the real one trains
(meshlab.verify.tiny): the same class, shrunk, two steps beside one process; a plan that
breaks the model is refused there, naming what failed, before anything is split."""

from __future__ import annotations

from typing import Any

import pytest

from meshlab import Cluster
from meshlab.notebook.output import MeshError
from tests.rank.families import FAMILIES_SOURCE

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")


def test_the_tiny_copy_keeps_the_class_and_scales_what_acts_on_the_sequence() -> None:
    from meshlab.verify.tiny import SEQ, TinySize, tiny_copy

    real = transformers.Gemma3TextConfig(vocab_size=256000, hidden_size=2304,
                                         intermediate_size=9216, num_hidden_layers=26,
                                         num_attention_heads=8, num_key_value_heads=4,
                                         head_dim=256, sliding_window=4096)
    with __import__("torch").device("meta"):
        model = transformers.Gemma3ForCausalLM(real)
    tiny = tiny_copy(model, TinySize(layers=4, hidden=32, heads=8, kv_heads=4, vocab=64,
                                     experts=4))()
    config = tiny.config
    assert type(tiny) is transformers.Gemma3ForCausalLM
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (4, 32, 64)
    assert config.head_dim == 4 and config.sliding_window == SEQ // 4  # it acts within 16
    assert len(config.layer_types) == 4  # recomputed for the copy's layers
    assert sum(p.numel() for p in tiny.parameters()) < 100_000


def test_a_model_without_a_config_is_asked_for_a_factory() -> None:
    from torch import nn

    from meshlab.verify.tiny import TinySize, tiny_copy

    with pytest.raises(ValueError, match=r"check='tiny' shrinks a model's config, and "
                                         r"Linear has none: pass check=factory"):
        tiny_copy(nn.Linear(2, 2), TinySize(2, 8, 2, 2, 8, 2))


PROVE = """
import meshlab.mesh
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.verify.tiny import TinySize
{setup}
_model = parallelize({model}, mesh, ParallelPlan({plan}), check={check})
_model.tiny_proof.notes[0]
"""


@pytest.mark.cluster
@pytest.mark.parametrize("mesh, model, plan, check, setup", [
    ("dp=2 tp=2", "FAMILIES['Llama']()", "data_parallel='zero3'", "'tiny'", ""),
    ("pp=2 dp=2", "CellGPT(layers=8)", "data_parallel='zero3'",
     "lambda size: CellGPT(vocab=size.vocab, dim=size.hidden, heads=size.heads, "
     "layers=size.layers)", ""),
], ids=["llama-tp", "cell-gpt-pp"])
def test_a_plan_is_proved_on_a_tiny_copy_first(cluster: Cluster, mesh: str, model: str,
                                               plan: str, check: str, setup: str) -> None:
    cluster.init_mesh(mesh)
    cell = FAMILIES_SOURCE + PROVE.format(model=model, plan=plan, check=check, setup=setup)
    result = cluster.run(cell, keep_values=True)
    for said in result.values.values():
        assert said.startswith("proved equal on a tiny copy of "), said


@pytest.mark.cluster
def test_a_tp_plan_that_breaks_the_models_forward_is_refused_on_the_copy(cluster: Cluster
                                                                         ) -> None:
    # StableLM sizes its attention heads from its config: a colwise q/k/v split breaks its
    # own view(...) (it crashed inside the real model's forward, in training)
    cluster.init_mesh("dp=2 tp=2")
    plan = ("data_parallel='zero3', tp_plan={f'model.layers.*.self_attn.{p}_proj': 'colwise' "
            "for p in 'qkv'} | {'model.layers.*.self_attn.o_proj': 'rowwise'}")
    with pytest.raises(MeshError) as e:
        cluster.run(FAMILIES_SOURCE + PROVE.format(model="FAMILIES['StableLM']()", plan=plan,
                                                   check="'tiny'", setup=""))
    said = " ".join(str(e.value).split())
    assert "ValueError: a tiny copy of StableLmForCausalLM" in said, said
    assert "training it failed (RuntimeError: shape" in said and "fix the plan" in said


@pytest.mark.cluster
def test_mesh_prove_says_what_the_tiny_copy_showed(shell: Any) -> None:
    from IPython.utils.capture import capture_output

    shell.run_line_magic("mesh", "init dp=2 tp=2")
    assert shell.run_cell("%%mesh\nimport transformers as T\nfrom meshlab.parallel import "
                          "ParallelPlan\nm = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=128, "
                          "hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
                          "num_attention_heads=4, num_key_value_heads=2))\n"
                          "p = ParallelPlan(data_parallel='zero3')").success
    with capture_output() as cap:
        shell.run_line_magic("mesh", "prove m p")
    assert "proved equal on a tiny copy of LlamaForCausalLM" in cap.stdout, cap.stdout
