"""``meshlab plan`` in a terminal: a model of one's own (TOML file or flags), --batch with a
layout, the assumed ZeRO stage, --json, and a reader that leaves early.

Plain Python, no cluster. The console command runs as a real subprocess of this checkout
(``python -m meshlab.notebook.cli``); the library calls behind it run in-process.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from meshlab.dry_run.shape_from_config import shape_from_config_file
from meshlab.notebook.cli import main
from meshlab.plan import Layout, ModelShape, model_shape
from meshlab.plan.report import plan
from meshlab.plan.shapes import load_model

REPO = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "meshlab.notebook.cli", "plan"]

# Llama-2-7B-like, with grouped-query attention: 5.9B parameters
MY_TOML = """\
name = "my-model"
layers = 32
hidden = 4096
heads = 32
kv_heads = 8
ffn = 11008
vocab = 32000
seq_len = 4096
"""
MY_SHAPE = ModelShape(name="my-model", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=11008,
                      vocab=32000, seq_len=4096)
SHAPE_FLAGS = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
               "--ffn", "11008", "--vocab", "32000", "--seq", "4096"]


def console(*args: str) -> subprocess.CompletedProcess[str]:
    """``meshlab plan ARGS`` as a user runs it, from this checkout."""
    return subprocess.run([*COMMAND, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def my_toml(tmp_path: Path) -> Path:
    path = tmp_path / "my.toml"
    path.write_text(MY_TOML)
    return path


# --- a model from a TOML file ----------------------------------------------------------

def test_a_model_file_reads_as_the_shape_it_describes(my_toml: Path) -> None:
    assert load_model(my_toml) == MY_SHAPE
    assert model_shape(str(my_toml)) == MY_SHAPE  # what %mesh plan my.toml passes
    assert model_shape(my_toml) == MY_SHAPE


def test_a_model_file_without_a_name_is_named_for_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text("layers = 2\nhidden = 64\nheads = 4\nffn = 128\nvocab = 256\n"
                    "seq_len = 64\nexperts = 4\ntop_k = 2\ngated_ffn = false\n")
    assert load_model(path) == ModelShape(name="tiny", layers=2, hidden=64, heads=4, ffn=128,
                                          vocab=256, seq_len=64, experts=4, top_k=2,
                                          gated_ffn=False)


@pytest.mark.parametrize(("text", "message"), [
    (MY_TOML.replace("hidden", "hiden"), "unknown key 'hiden': did you mean hidden?"),
    ("layers = 32\nhidden = 4096\n",
     "missing heads, ffn, vocab, seq_len: add each as a whole number, e.g. heads = 32"),
    (MY_TOML.replace("layers = 32", 'layers = "32"'),
     'layers = "32" is a string, not a whole number: write e.g. layers = 32'),
    (MY_TOML.replace("layers = 32", "layers = true"),
     "layers = true is a boolean, not a whole number"),
    (MY_TOML.replace("ffn = 11008", "ffn = 11008.0"), "ffn = 11008.0 is a decimal number"),
    (MY_TOML + "gated_ffn = 1\n", "gated_ffn = 1 is a whole number, not true or false"),
    ("layers = \n", "bad.toml is not valid TOML ("),
    (MY_TOML.replace("layers = 32", "layers = 0"), "layers = 0 must be at least 1"),
    (MY_TOML.replace("layers = 32", "layers = -4"), "layers = -4 must be at least 1"),
])
def test_a_model_file_names_its_mistake_and_the_fix(tmp_path: Path, text: str,
                                                     message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad\.toml") as raised:
        load_model(path)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_missing_model_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read the model file .*nope\.toml \(No such "
                                         r"file or directory\): check the path"):
        model_shape(str(tmp_path / "nope.toml"))


# --- one source of the model -----------------------------------------------------------

def test_the_console_plans_a_model_given_as_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *SHAPE_FLAGS, "--gpus", "8", "--layout", "tp=8 zero=1"]) == 0
    assert capsys.readouterr().out.startswith(
        "custom (5.9B parameters, gated 3-matrix FFN) on 8 x h100-sxm")


@pytest.mark.parametrize(("args", "message"), [
    ([], "which model? name a preset (llama3-8b, "),
    (["llama3-8b", "--model", "my.toml"],
     "the model is given 2 ways (the preset 'llama3-8b' and --model my.toml): keep one"),
    (["llama3-8b", "--layers", "32"], "the model is given 2 ways (the preset 'llama3-8b' and "
                                      "--layers flags)"),
    (["--hidden", "4096", "--heads", "32"],
     "a model from flags needs --layers --ffn --vocab --seq too (given: --hidden --heads)"),
    ([*SHAPE_FLAGS, "--top-k", "2"], "--top-k 2 needs --experts N"),
    (["--model", "nope.toml"], "cannot read the model file nope.toml"),
    (["--model", "nope.json"], "no model config at nope.json: give a transformers config.json"),
    (["llama3-8b", "--plain-ffn"], "--plain-ffn describe a model given as shape flags"),
])
def test_the_console_wants_exactly_one_model(args: list[str], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--gpus", "8", *args])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("meshlab plan: ") and message in err and err.count("\n") == 1


# --- a GPT: two matrices in its feed-forward, learned positions, tied embeddings ---------

# GPT-3 6.7B (Brown et al. 2020, Table 2.1: 32 layers, d_model 4096, 32 heads, context 2048)
GPT_FLAGS = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn", "16384",
             "--vocab", "50257", "--seq", "2048"]


def test_a_gpt_from_flags_counts_two_matrices_where_it_says_so(
        capsys: pytest.CaptureFixture[str]) -> None:
    structure = ["--plain-ffn", "--tied-embeddings", "--learned-positions"]
    assert main(["plan", *GPT_FLAGS, *structure, "--gpus", "8", "--layout", "tp=8"]) == 0
    # the paper's 6.7B (biases and LayerNorms, which the planner leaves out, are 0.01%)
    assert capsys.readouterr().out.startswith(
        "custom (6.7B parameters, plain 2-matrix FFN) on 8 x h100-sxm")
    assert main(["plan", *GPT_FLAGS, "--gpus", "8", "--layout", "tp=8"]) == 0
    assert capsys.readouterr().out.startswith(  # the default says its assumption
        "custom (9.0B parameters, gated 3-matrix FFN)")


def test_a_transformers_config_plans_the_model_it_builds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file ``config.save_pretrained`` writes (or its folder), read as the model its own
    family's code builds: GPT-2's Conv1D MLP is plain, Llama's is gated."""
    transformers = pytest.importorskip("transformers")
    gpt = transformers.GPT2Config(n_embd=4096, n_layer=32, n_head=32, n_positions=2048)
    llama = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                     num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, vocab_size=32000,
                                     max_position_embeddings=4096)
    gpt.save_pretrained(tmp_path / "gpt-6.7b")
    llama.save_pretrained(tmp_path / "my-llama")
    assert main(["plan", "--model", str(tmp_path / "gpt-6.7b"), "--gpus", "8",
                 "--layout", "tp=8"]) == 0
    assert capsys.readouterr().out.startswith(
        "gpt-6.7b (6.7B parameters, plain 2-matrix FFN) on 8 x h100-sxm")
    assert main(["plan", str(tmp_path / "my-llama" / "config.json"), "--gpus", "8",
                 "--layout", "tp=8"]) == 0
    assert capsys.readouterr().out.startswith(
        "my-llama (5.9B parameters, gated 3-matrix FFN) on 8 x h100-sxm")
    shape = shape_from_config_file(tmp_path / "my-llama")
    assert dataclasses.replace(shape, name=MY_SHAPE.name, head_dim=0) == MY_SHAPE


def test_a_config_transformers_cannot_read_is_refused_with_the_fix(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nonsense"}))
    with pytest.raises(ValueError, match="transformers does not know model_type 'nonsense'"):
        shape_from_config_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read .*config\.json as JSON"):
        shape_from_config_file(tmp_path)


# --- --batch with --layout -------------------------------------------------------------

def test_batch_sets_the_microbatches_of_a_layout_that_gives_none() -> None:
    layout = plan("llama3-8b", gpus=8, layout="tp=4 dp=2 mbs=2", global_batch=64).best.layout
    assert (layout.micro_batch, layout.microbatches, layout.dp) == (2, 16, 2)  # 2 x 16 x 2
    assert layout.global_batch == 64


def test_batch_that_agrees_with_the_layouts_microbatches_is_taken() -> None:
    layout = plan("llama3-8b", gpus=8, layout="tp=4 dp=2 m=8", global_batch=16).best.layout
    assert layout.microbatches == 8


def test_batch_that_disagrees_with_the_layouts_microbatches_names_both() -> None:
    with pytest.raises(ValueError, match=r"--batch 64 disagrees with the layout's mbs=1 x m=8 "
                                         r"x dp=2 = 16 sequences: pass --batch 16, or drop m= "
                                         "from the layout"):
        plan("llama3-8b", gpus=8, layout="tp=4 dp=2 m=8", global_batch=64)


def test_batch_that_mbs_times_dp_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--batch 30 is not a multiple of the layout's mbs=4 "
                                         r"x dp=2 = 8 sequences: pass --batch 24"):
        plan("llama3-8b", gpus=8, layout="tp=4 dp=2 mbs=4", global_batch=30)


# --- the ZeRO stage is always said -----------------------------------------------------

def test_a_layout_that_gives_zero_needs_no_note() -> None:
    result = plan("llama3-8b", gpus=8, layout="dp=8 zero=1")
    assert "dp_shard=8 zero=1 mbs=1 m=1 reduce_fp32=1: " in result.text()
    assert "zero not given" not in result.text() and result.notes == []


def test_the_summary_says_whose_code_the_layouts_settings_count() -> None:
    def said(**options: Any) -> str:
        return plan("llama3-8b", gpus=8, **options).text().splitlines()[1]

    assert "as meshlab's code holds it" in said(layout="tp=4 dp=2")
    assert "as megatron's code holds it" in said(layout="tp=4 dp=2", implementation="megatron")
    # a Layout states every setting: its defaults are Megatron's
    assert "as megatron's code holds it" in said(layout=Layout.parse("tp=4 dp=2"))
    assert "as its settings count it" in said(layout="tp=4 dp=2 loss_parallel=1")
    with pytest.raises(ValueError, match="implementation='deepspeed': expected one of "
                                         "meshlab, megatron"):
        said(implementation="deepspeed")


def test_searched_layouts_state_their_zero_stage() -> None:
    result = plan("meshlab", gpus=4, top=5)
    assert all(" zero=" in f" {layout}" for layout in result.table()["layout"])
    # the one note says which batch a search took, none which zero
    assert [n[:23] for n in result.notes] == ["global batch not given:"]


def test_the_console_plans_a_model_file_and_says_which_zero_it_assumed(my_toml: Path) -> None:
    done = console("--model", str(my_toml), "--gpus", "8", "--layout", "tp=8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("my-model (5.9B parameters, gated 3-matrix FFN) on 8 x h100-sxm")
    assert "tp=8 zero=3 mbs=1 m=1: " in done.stdout
    assert ("zero not given: zero=3 assumed (FSDP: parameters, gradients and optimizer states "
            "sharded); pass zero=0..3 in the layout to choose") in done.stdout
    assert "collectives of tp=8 zero=3 mbs=1 m=1:" in done.stdout


# --- a reader that leaves early --------------------------------------------------------

def test_the_console_ends_quietly_when_the_reader_closes_the_pipe() -> None:
    proc = subprocess.Popen([*COMMAND, "llama3-8b", "--gpus", "8", "--top", "2"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()  # long before the planner prints its first line
    _, err = proc.communicate(timeout=300)
    assert (proc.returncode, err) == (1, "")


def test_the_console_piped_into_head_prints_one_line_and_no_traceback() -> None:
    line = shlex.join([*COMMAND, "llama3-8b", "--gpus", "8", "--top", "2"])
    done = subprocess.run(f"{line} | head -1", shell=True, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.startswith("llama3-8b (8.0B parameters, gated 3-matrix FFN)") and \
        done.stdout.count("\n") == 1
    assert done.stderr == ""


# --- json output -----------------------------------------------------------------------

def test_the_console_plans_a_model_from_flags_as_json() -> None:
    done = console(*SHAPE_FLAGS, "--gpus", "8", "--top", "3", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)  # the whole of stdout is one JSON object
    assert list(out) == ["model", "gpus", "hardware", "implementation", "usable_gib",
                         "global_batch", "seq_len", "tokens", "best", "layouts", "collectives",
                         "notes"]
    assert out["implementation"] == "meshlab"
    assert out["model"] == {**dataclasses.asdict(dataclasses.replace(MY_SHAPE,
                                                                     name="custom")),
                            "params": MY_SHAPE.params}
    assert (out["gpus"], out["hardware"], out["tokens"]) == (8, "h100-sxm", None)
    best, layouts = out["best"], out["layouts"]
    assert len(layouts) == 3 and layouts[0]["layout"] == best["layout"]
    assert best["settings"]["zero"] in (0, 1, 2, 3) and f"zero={best['settings']['zero']}" \
        in best["layout"]
    assert best["memory_gib"]["total"] == pytest.approx(sum(
        best["memory_gib"][p] for p in ("params", "grads", "optimizer", "activations",
                                        "buffers")))
    assert best["tokens_per_step"] == out["global_batch"] * 4096
    assert set(layouts[0]) == {"layout", "fits", "memory_gib", "step_s", "bubble",
                               "exposed_comm_s", "tokens_per_s", "tflops_per_gpu", "mfu",
                               "hw_tflops_per_gpu", "hfu", "days", "gpu_hours"}
    seconds = [c["seconds"] for c in out["collectives"]]
    assert seconds and seconds == sorted(seconds, reverse=True)
    assert set(out["collectives"][0]) == {"axis", "what", "collective", "ranks", "link",
                                          "calls", "mib_each", "seconds", "overlapped"}


@pytest.mark.parametrize("value", ["nan", "inf", "-1.0"])
def test_a_hardware_file_with_nonsense_numbers_names_the_key(tmp_path: Path, value: str) -> None:
    # NaN in a calibrated profile printed "MFU nan%"
    from meshlab.plan import HARDWARE
    from meshlab.plan.hardware import load, save

    path = save(HARDWARE["h100-sxm"], tmp_path / "hw.toml")
    text = path.read_text()
    line = next(x for x in text.splitlines() if x.startswith("bf16 = "))
    path.write_text(text.replace(line, f"bf16 = {value}", 1))
    shown = re.escape(str(float(value)))
    with pytest.raises(ValueError, match=rf"hw\.toml: tflops\.bf16 = {shown} is not a finite "
                                         r"number >= 0: measure it again"):
        load(path)
