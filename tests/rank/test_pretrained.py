"""Pretrained weights straight into a parallelized model's shards, and back out as one folder.

A folder transformers' own ``save_pretrained`` wrote (in this process) loads into ZeRO-3, ZeRO-3
x TP, a pipeline and expert parallelism with exactly the file's tensors and one process's
logits (float64, within 1e-10); a folder meshlab's ``save_pretrained`` writes from the shards
loads with ``from_pretrained`` in one process, and back into the shards, bit for bit. A folder
that does not fit the model is refused naming the key and the fix; a failed save leaves
nothing behind. No rank reads the whole model while loading (its peak memory is printed).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from meshlab import Cluster
from tests.rank.families import FAMILIES_SOURCE  # the families, tiny, from configs

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency")

# (family, mesh, data_parallel, where the model is built: "cpu", or "meta" as at real size);
# GPT-2 has no pipeline split (meshlab refuses it)
CASES = [*[(f, spec, "zero3", "cpu") for f in ("Llama", "Llama (tied)")
           for spec in ("dp=4", "dp=2 tp=2", "pp=2 dp=2")],
         ("GPT-2", "dp=4", "zero3", "cpu"), ("GPT-2", "dp=2 tp=2", "zero3", "cpu"),
         ("Qwen3-MoE", "dp=4 ep=2", "none", "cpu"), ("Qwen3-MoE", "dp=4", "zero3", "cpu"),
         ("Qwen3-MoE", "dp=2 tp=2", "zero3", "cpu"), ("Mixtral", "dp=4 ep=2", "none", "cpu"),
         ("Llama (tied)", "dp=2 tp=2", "zero3", "meta"), ("Qwen3-MoE", "dp=4 ep=2", "none", "meta"),
         *[(f, "dp=2 tp=2", "zero3", "meta") for f in ("Qwen2", "Qwen3", "Mistral", "Gemma2",
                                                       "Gemma3", "Phi-3")],
         ("OLMoE", "dp=4 ep=2", "none", "meta"),
         # FSDP2 renames the class (FSDPGPTNeoXForCausalLM): transformers' renaming of
         # GPT-NeoX's keys, looked up by class name, must still apply
         ("GPT-NeoX", "dp=4", "zero3", "cpu")]
CASES_KEYS = {case[:2] + case[3:] for case in CASES}
SMALL_SHARDS = 30_000  # every other case saves in shards this small: an index and many files

# On every rank: load each case's folder, compare with the one-process reference the test
# wrote (its parameters, logits and loss), save from the shards, load that back.
CELL = '''
import torch
import meshlab.mesh
from meshlab.checkpoint.failures import CheckpointError
from meshlab.models.llama import loss_fn
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.verify.compare import full_parameters
from meshlab.pretrained import load_pretrained, save_pretrained
from torch.distributed.tensor import DTensor


def _differs(model, expected, mesh):
    """The first parameter whose gathered value is not the reference's exactly."""
    for name, value in full_parameters(model).items():
        want = expected[name]
        if value.shape != want.shape:  # this rank's experts
            n = value.shape[0]
            want = want[mesh["ep"].get_local_rank() * n:][:n]
        if not torch.equal(value, want):
            return name
    return None


def _case(i, family, spec, dp, built):
    global _model
    ref = torch.load(f"{ROOT}/{family}.pt")
    mesh = meshlab.mesh.build(spec)
    with torch.device(built):
        model = FAMILIES[family]().double()
    torch.manual_seed(1234)  # other weights than the folder's
    model = _model = parallelize(model, mesh, ParallelPlan(data_parallel=dp), seed=1234)
    load_pretrained(model, f"{ROOT}/{family}")
    loaded = _differs(model, ref["params"], mesh)
    x, y = ref["x"], ref["y"]
    if "pp" in spec:  # the last stage's output, through the pipeline: its loss
        error = abs(model.pipeline.step(x, y) - ref["loss"])
    else:
        with torch.no_grad():
            logits = model(x).logits
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        error = (logits - ref["logits"]).abs().max().item()
    # a forward without backward leaves ZeRO-3's root gathered: save must cope
    save_pretrained(model, f"{ROOT}/saved-{i}",
                    max_shard_bytes=SMALL_SHARDS if i % 2 else 5 * 10**9)
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).zero_()
    load_pretrained(model, f"{ROOT}/saved-{i}")
    return loaded, error, _differs(model, ref["params"], mesh)


_results = {}
for _i, (_family, _spec, _dp, _built) in enumerate(CASES):
    _results[(_family, _spec, _built)] = _case(_i, _family, _spec, _dp, _built)
try:  # the folder's parent is a file: every rank raises, nothing is left
    save_pretrained(_model, f"{ROOT}/a-file/out")
    _results["failed save"] = None
except CheckpointError as e:
    _results["failed save"] = str(e)
del _model
_results
'''

MEMORY = r'''
import re, torch, transformers as T
import meshlab.mesh
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.pretrained import load_pretrained


def _kb(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1))


_config = T.LlamaConfig.from_pretrained(FOLDER)
_model = parallelize(T.LlamaForCausalLM(_config), meshlab.mesh.build("dp=4"),
                     ParallelPlan(data_parallel="zero3"))
_shards = sum(p.to_local().numel() * p.element_size() for p in _model.parameters())
_before = _kb("VmRSS")
with open("/proc/self/clear_refs", "w") as _f:
    _f.write("5")  # the peak (VmHWM) starts again from now
load_pretrained(_model, FOLDER)
_peak = (_kb("VmHWM") - _before) * 1024
del _model
_peak, _shards
'''


def _family(name: str) -> Any:
    namespace: dict[str, Any] = {}
    exec(FAMILIES_SOURCE, namespace)
    return namespace["FAMILIES"][name]


def _one_process(folder: Path) -> Any:
    """``from_pretrained`` in this process, in float64, as a user would load the folder."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, experts_implementation="eager")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each family saved by transformers' save_pretrained, and beside it what one process
    loads from it: parameters, and logits and loss on a fixed batch."""
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
    for name in {case[0] for case in CASES}:
        torch.manual_seed(0)
        _family(name)().double().save_pretrained(root / name)
        reference = _one_process(root / name)
        with torch.no_grad():
            logits = reference(x).logits
        torch.save({"params": {k: v.detach() for k, v in
                               reference.named_parameters(remove_duplicate=False)},
                    "logits": logits, "x": x, "y": y,
                    "loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                              y.flatten()).item()},
                   root / f"{name}.pt")
    (root / "a-file").write_text("a file where the saved folder's parent should be")
    return root


@pytest.fixture(scope="module")
def results(module_cluster: Cluster, root: Path) -> dict[Any, Any]:
    """Every case run once on the 4 ranks: {rank: {case: (first parameter that differs after
    loading or None, logits/loss error, first that differs after save and reload)}}."""
    cluster = module_cluster
    setup = f"{FAMILIES_SOURCE}\nROOT = {str(root)!r}\nCASES = {CASES!r}\n" \
            f"SMALL_SHARDS = {SMALL_SHARDS}\n"
    return dict(cluster.run(setup + CELL, keep_values=True, timeout=240).values)


@pytest.mark.cluster
def test_a_transformers_folder_loads_into_every_layout_as_the_file_holds_it(
        results: dict[Any, Any]) -> None:
    for rank, cases in results.items():
        wrong = {case: r[0] for case, r in cases.items() if case in CASES_KEYS and r[0]}
        assert not wrong, f"rank {rank}: these parameters differ from the file's: {wrong}"


@pytest.mark.cluster
def test_sharded_logits_equal_one_process_logits(results: dict[Any, Any]) -> None:
    for rank, cases in results.items():
        far = {case: r[1] for case, r in cases.items() if case in CASES_KEYS and r[1] > 1e-10}
        assert not far, f"rank {rank}: logits (loss, with pp) differ by more than 1e-10: {far}"


@pytest.mark.cluster
def test_a_folder_saved_from_the_shards_loads_in_one_process_bit_for_bit(
        results: dict[Any, Any], root: Path) -> None:
    for i, (family, spec, _, _) in enumerate(CASES):
        saved = root / f"saved-{i}"
        assert ((saved / "model.safetensors.index.json").is_file()) == bool(i % 2), spec
        expected = torch.load(root / f"{family}.pt")["params"]
        model = _one_process(saved)
        config = json.loads((saved / "config.json").read_text())
        assert config["architectures"] == [type(model).__name__], config  # not FSDP's class
        loaded = dict(model.named_parameters(remove_duplicate=False))
        assert loaded.keys() == expected.keys(), (family, spec)
        differ = [k for k, v in expected.items() if not torch.equal(loaded[k], v)]
        assert not differ, f"{family} on {spec}: {differ}"
    tied = json.loads((root / "saved-5" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in tied["weight_map"]  # written once, as transformers does


@pytest.mark.cluster
def test_a_folder_saved_from_the_shards_loads_back_into_them(results: dict[Any, Any]) -> None:
    for rank, cases in results.items():
        wrong = {case: r[2] for case, r in cases.items() if case in CASES_KEYS and r[2]}
        assert not wrong, f"rank {rank}: after save and reload these differ: {wrong}"


@pytest.mark.cluster
def test_a_failed_save_raises_on_every_rank_and_leaves_nothing(results: dict[Any, Any],
                                                              root: Path) -> None:
    for rank, cases in results.items():
        message = cases["failed save"]
        assert message is not None, f"rank {rank} did not raise"
        assert message.startswith(f"pretrained folder {root}/a-file/out not saved: not a "
                                  "directory (ENOTDIR) creating "), message
        assert message.endswith("on rank 0; no partial folder was left"), message
    assert sorted(p.name for p in root.glob("a-file*")) == ["a-file"]
    assert not list(root.glob("saved-*.partial-*"))



@pytest.mark.cluster
def test_no_rank_reads_the_whole_model_while_loading(cluster: Cluster, tmp_path: Path) -> None:
    # 49M parameters (197 MB in float32): 2 layers, most of it the embedding and the head
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=640, intermediate_size=1920,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=8)
    folder = tmp_path / "llama-49m"
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    measured = cluster.run(f"FOLDER = {str(folder)!r}\n" + MEMORY, keep_values=True,
                           timeout=180).values
    for rank, (peak, shards) in sorted(measured.items()):
        print(f"rank {rank}: loading took at most {peak / 2**20:.1f} MB beyond its shards "
              f"({shards / 2**20:.1f} MB); the whole model is {whole / 2**20:.1f} MB")
        assert peak < whole, f"rank {rank} held {peak} bytes while loading, of {whole}"


# -- in this process: a plain model, no cluster --------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("plain") / "llama"
    torch.manual_seed(0)
    _family("Llama")().save_pretrained(folder)
    return folder


def test_a_tensor_the_folder_lacks_is_named_with_the_fix(llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from meshlab.pretrained import load_pretrained

    tensors = load_file(llama / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"has no weights for 1 of this LlamaForCausalLM's "
                                         r"tensors: model\.norm\.weight: .*AutoConfig"):
        load_pretrained(_family("Llama")(), tmp_path)


def test_a_tensor_the_model_has_no_place_for_is_named(llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from meshlab.pretrained import load_pretrained

    tensors = load_file(llama / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds 1 tensors this LlamaForCausalLM has no place "
                                         r"for: model\.layers\.0\.mlp\.extra\.weight"):
        load_pretrained(_family("Llama")(), tmp_path)


def test_a_shape_mismatch_names_both_shapes(llama: Path) -> None:
    from meshlab.pretrained import load_pretrained

    wider = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight in .* is \(64, 32\), but "
                                         r"the model's model\.embed_tokens\.weight is \(128, 32\)"
                                         r": .*AutoConfig\.from_pretrained"):
        load_pretrained(wider, llama)


def test_weights_are_cast_to_each_parameters_dtype(llama: Path) -> None:
    from safetensors.torch import load_file

    from meshlab.pretrained import load_pretrained

    model = _family("Llama")().to(torch.bfloat16)
    load_pretrained(model, llama)
    file = load_file(llama / "model.safetensors")
    assert all(torch.equal(p, file[n].to(torch.bfloat16)) for n, p in model.named_parameters())


def test_any_module_round_trips_with_its_persistent_buffers(tmp_path: Path) -> None:
    from safetensors import safe_open

    from meshlab.pretrained import load_pretrained, save_pretrained

    def make() -> torch.nn.Module:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
        model.register_buffer("scratch", torch.randn(2), persistent=False)
        return model

    torch.manual_seed(0)
    saved = make()
    saved[1].running_mean.add_(1.5)
    save_pretrained(saved, tmp_path / "plain")  # no config: weights only
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["model.safetensors"]
    keys = set(safe_open(tmp_path / "plain" / "model.safetensors", "pt").keys())
    assert "1.running_mean" in keys and "scratch" not in keys
    torch.manual_seed(1)
    loaded = make()
    load_pretrained(loaded, tmp_path / "plain")
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))
    assert not torch.equal(saved.scratch, loaded.scratch)  # not persistent: not in the folder


def test_a_folder_without_safetensors_is_named(tmp_path: Path) -> None:
    from meshlab.pretrained import load_pretrained

    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"no safetensors weights in {tmp_path} .*holds "
                                         r"pytorch_model\.bin.*save_pretrained"):
        load_pretrained(_family("Llama")(), tmp_path)
    with pytest.raises(ValueError, match=r"no folder .*/nothing: pass the folder"):
        load_pretrained(_family("Llama")(), tmp_path / "nothing")


def test_a_save_into_an_existing_folder_keeps_its_other_files(llama: Path,
                                                              tmp_path: Path) -> None:
    from meshlab.pretrained import save_pretrained

    out = tmp_path / "out"
    save_pretrained(_family("Llama")(), out, max_shard_bytes=SMALL_SHARDS)
    (out / "tokenizer.json").write_text("{}")
    model = transformers.LlamaForCausalLM.from_pretrained(llama)
    save_pretrained(model, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.safetensors", "tokenizer.json"]
    again = transformers.LlamaForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 again.state_dict().values(), strict=True))


def test_a_conversion_not_read_in_slices_runs_transformers_converter(
        llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # q, k and v stored fused, split on load by transformers' Chunk: read whole, then sliced
    from safetensors.torch import save_file
    from transformers import conversion_mapping
    from transformers.core_model_loading import Chunk, WeightConverter

    from meshlab.pretrained import load_pretrained

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4))  # q, k, v of one size
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(4):
        parts = [tensors.pop(f"model.layers.{i}.self_attn.{p}_proj.weight") for p in "qkv"]
        tensors[f"model.layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(parts)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    fused = WeightConverter("self_attn.qkv_proj.weight", ["self_attn.q_proj.weight",
                                                          "self_attn.k_proj.weight",
                                                          "self_attn.v_proj.weight"],
                            operations=[Chunk(dim=0)])
    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping",
                        lambda model, **kw: [fused])
    fresh = transformers.LlamaForCausalLM(model.config)
    load_pretrained(fresh, tmp_path)
    differ = [k for k, v in model.state_dict().items() if not torch.equal(v, fresh.state_dict()[k])]
    assert not differ


def test_a_save_failing_mid_file_names_the_os_error_and_removes_its_folder(
        tmp_path: Path) -> None:
    # files capped at 16 kB, as on a full disk (EFBIG where a full disk says ENOSPC); in a
    # process of its own, so the cap touches nothing of this one
    import subprocess
    import sys

    code = f"""
import resource, signal, transformers as T
from meshlab.checkpoint.failures import CheckpointError
from meshlab.pretrained import save_pretrained
model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.RLIM_INFINITY))
try:
    save_pretrained(model, {str(tmp_path / "out")!r})
except CheckpointError as e:
    print(e)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(rf"pretrained folder {tmp_path}/out not saved: file too large \(EFBIG\) "
                        rf"writing {tmp_path}/out\.partial-(\w+)/model\.safetensors after "
                        rf"16\.0 kB on rank 0; the partial folder {tmp_path}/out\.partial-\1 "
                        r"\(16\.0 kB written\) is removed", done.stdout.strip()), done.stdout
    assert list(tmp_path.iterdir()) == []
