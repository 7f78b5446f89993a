"""%mesh plan in a real IPython shell and `meshlab plan` as a real console command."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from meshlab.plan import HARDWARE, IMPLEMENTATIONS, MODELS, Layout, estimate, save
from meshlab.plan.report import Plan, default_batch, plan


def shown(cap: Any) -> str:
    """What a cell printed and displayed, as text (the plan summary is displayed)."""
    return cap.stdout + "\n".join(o.data["text/plain"] for o in cap.outputs)


def test_plan_magic_estimates_one_layout_with_a_table_and_two_charts(shell: Any) -> None:
    with capture_output() as cap:
        shell.run_line_magic("mesh", 'plan llama3-405b --gpus 2048 --layout "tp=8 pp=16 dp=16 '
                                     'zero=1 mbs=1 m=128" --tokens 15.6e12 -o chosen')
    expected = estimate(MODELS["llama3-405b"], Layout.parse(
        "tp=8 pp=16 dp=16 zero=1 mbs=1 m=128", **IMPLEMENTATIONS["meshlab"]),
        HARDWARE["h100-sxm"])
    assert "llama3-405b (405.9B parameters, gated 3-matrix FFN) on 2048 x h100-sxm" in shown(cap)
    assert f"step {expected.step_s:.3g} s" in shown(cap)
    assert "days" in shown(cap) and "GPU-hours" in shown(cap)
    table, memory, comm = cap.outputs[-3:]
    assert "pp=16 dp_shard=16 tp=8 zero=1" in table.data["text/plain"]
    assert "image/svg+xml" in memory.data and "image/svg+xml" in comm.data
    kept = shell.user_ns["chosen"]
    assert isinstance(kept, Plan) and kept.best.step_s == pytest.approx(expected.step_s)


def test_plan_magic_searches_under_constraints(shell: Any) -> None:
    with capture_output() as cap:
        shell.run_line_magic("mesh", 'plan llama3-8b --gpus 16 --where "tp<=2 zero=3" --top 3 '
                                     "-o found")
    found = shell.user_ns["found"]
    assert 1 <= len(found.estimates) <= 3
    for e in found.estimates:
        assert e.layout.gpus == 16 and e.layout.tp <= 2 and e.layout.zero == 3 and e.fits
    speeds = [e.tokens_per_s for e in found.estimates]
    assert speeds == sorted(speeds, reverse=True)
    assert found.best.layout.describe() in shown(cap)


def test_plan_magic_counts_whose_code_it_is_told(shell: Any) -> None:
    layout = '--layout "pp=16 dp=128 tp=8 zero=2 m=16"'  # Llama 3 405B's published
    with capture_output() as cap:
        shell.run_line_magic("mesh", f"plan llama3-405b --gpus 16384 {layout} -o ours")
        shell.run_line_magic("mesh", f"plan llama3-405b --gpus 16384 {layout} "
                                     "--implementation megatron -o theirs")
    ours, theirs = shell.user_ns["ours"], shell.user_ns["theirs"]
    # meshlab's loss on whole logits and the stage's fp32 gradients: no fit
    assert theirs.best.fits and not ours.best.fits
    assert "as meshlab's code holds it (does NOT fit" in shown(cap)
    assert "as megatron's code holds it (fits" in shown(cap)
    with pytest.raises(UsageError, match="megatron"):
        shell.run_line_magic("mesh", "plan llama3-8b --gpus 8 --implementation deepspeed")


def test_plan_magic_takes_a_model_config_from_the_notebook(shell: Any) -> None:
    shell.run_cell("from meshlab.models import ModelConfig\nmine = ModelConfig(n_layers=4)")
    with capture_output():
        shell.run_line_magic("mesh", "plan mine --gpus 4 --layout dp=4 --hardware cpu -o p")
    assert shell.user_ns["p"].model.layers == 4


def test_plan_magic_reads_a_transformers_configs_structure_from_the_model_it_builds(
        shell: Any) -> None:
    """GPT-NeoX names its MLP's width intermediate_size, as Llama does, but its MLP has two
    matrices: what the config does not say is read from the model built on meta."""
    pytest.importorskip("transformers")
    shell.run_cell("import transformers\nneox = transformers.GPTNeoXConfig(hidden_size=256, "
                   "intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, "
                   "vocab_size=1000)\nbuilt = transformers.AutoModelForCausalLM.from_config("
                   "neox)")
    with capture_output():
        shell.run_line_magic("mesh", "plan neox --gpus 4 --layout dp=4 --hardware cpu -o p")
    shape, built = shell.user_ns["p"].model, shell.user_ns["built"]
    assert not shape.gated_ffn and shape.layer_norm
    counted = sum(p.numel() for p in built.parameters())
    assert abs(shape.params / counted - 1) < 0.01  # biases, which the planner leaves out


def test_plan_magic_reads_a_profile_file(shell: Any, tmp_path: Any) -> None:
    path = save(HARDWARE["a100-80gb"], tmp_path / "mine.toml")
    with capture_output() as cap:
        shell.run_line_magic("mesh", f"plan gpt3-175b --gpus 1024 --hardware {path} "
                                     '--layout "tp=8 pp=16 dp=8 zero=1 mbs=1 m=64"')
    assert "on 1024 x a100-80gb" in shown(cap)


@pytest.mark.parametrize(("line", "message"), [
    ("plan llama3-9b --gpus 8", r"unknown model 'llama3-9b': choose one of llama3-8b"),
    ("plan llama3-8b --gpus 8 --hardware tpu9", r"unknown hardware 'tpu9'"),
    ('plan llama3-8b --gpus 8 --layout "tp=8 pp=2"', r"uses 16 GPUs, not 8"),
    ('plan llama3-8b --gpus 6 --layout "tp=3 dp=2"', r"tp=3 must divide heads=32"),
    ('plan llama3-8b --gpus 8 --layout "tp=8 flavour=2"', r"layout 'flavour=2'"),
    ('plan llama3-8b --gpus 8 --where "tp~8"', r"constraint 'tp~8'"),
    ("plan llama3-405b --gpus 8", r"no layout of llama3-405b on 8 h100-sxm GPUs"),
])
def test_plan_magic_bad_input_says_what_to_fix(shell: Any, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("mesh", line)


def test_plan_without_gpus_uses_the_running_cluster(shell: Any) -> None:
    with capture_output() as cap:
        shell.run_line_magic("mesh", "plan meshlab --hardware cpu --top 2")
    assert "on 4 x cpu" in shown(cap)


def test_default_batch_is_a_power_of_two_near_4m_tokens_and_one_per_node() -> None:
    # Llama 3 405B on 16,384 GPUs: 16M tokens of 8,192 (it planned 16,384 sequences, 8x)
    assert default_batch(MODELS["llama3-405b"], 16384) == 2048
    assert default_batch(MODELS["llama3-405b"], 2048) == 512  # 4M / 8192 > 2048 / 8
    assert default_batch(MODELS["llama3-8b"], 64) == 512  # 4M / 8192
    assert default_batch(MODELS["gpt3-175b"], 8) == 2048  # 4M / 2048
    assert default_batch(MODELS["meshlab"], 2) == 2**16  # 4M / 64: tiny sequences
    assert plan("llama3-8b", gpus=8, top=1).best.layout.global_batch == 512


def test_console_command_prints_the_plan_and_rejects_bad_input() -> None:
    done = subprocess.run(["meshlab", "plan", "llama3-70b", "--gpus", "64", "--top", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "llama3-70b (70.6B parameters, gated 3-matrix FFN) on 64 x h100-sxm" in done.stdout
    assert "collectives of " in done.stdout and "tokens_per_s" in done.stdout
    bad = subprocess.run(["meshlab", "plan", "llama3-70b", "--gpus", "64", "--layout", "tp=5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "meshlab plan: the layout tp=5" in bad.stderr


def test_a_search_plans_a_transformers_config_and_says_which_batch_it_took() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=4096)
    found = plan(config, gpus=64, top=1, constraints="tp=8 pp=4 zero=1")
    assert found.model.params == pytest.approx(32.76e9, rel=1e-3)  # 64 heads of 128
    assert any(n.startswith("global batch not given: 1,024 sequences of 4,096 tokens")
               for n in found.notes), found.notes
    assert not plan(config, gpus=64, top=1, constraints="tp=8 pp=4 zero=1",
                    global_batch=512).notes
