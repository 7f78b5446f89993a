"""Checkpoints: sharded save/load of named objects on every rank, complete or refused.

A round trip resumes training with exactly the losses of an uninterrupted run; a checkpoint
saved by FSDP2 on 4 ranks loads into tensor parallel on 2 with the same full parameters and
optimizer states; a save interrupted by an error or a killed rank leaves the previous
checkpoint (or nothing) at its path, and a half-written folder is refused as incomplete. A failed
save says in its first line what the OS said (ENOSPC, EFBIG), about which file, after how many
bytes, and removes its partial folder; a background save's failure is raised under its own path.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from meshlab import Cluster, MeshError
from meshlab.checkpoint.sharded import MANIFEST, CheckpointError, load, manifest, save

SETUP = """
from meshlab.checkpoint import sharded as checkpoint
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank, full_parameters, train
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

cfg = ModelConfig(dim=32, ffn_hidden=64, vocab_size=64)
plan = ParallelPlan({plan})
model = parallelize(Transformer(cfg), mesh, plan)
optimizer = build_optimizer(model, mesh, plan, lr=0.01)
step = 0

def fit(n):
    global step
    dp_rank, dp_ranks = data_rank(mesh)
    batches = [local_batch(step=step + s, batch=8, seq=16, vocab=cfg.vocab_size, rank=dp_rank,
                           ranks=dp_ranks) for s in range(n)]
    group = mesh["dp"].get_group() if dp_ranks > 1 else None
    step += n
    return train(model, optimizer, batches, average_over=group)

def full_state():
    # every parameter and optimizer state whole, under the plain model's names
    optim = get_optimizer_state_dict(model, optimizer,
                                     options=StateDictOptions(full_state_dict=True))
    states = {{f"{{fqn}}.{{k}}": v.clone() for fqn, s in optim["state"].items()
              for k, v in s.items()}}
    return {{k: v.clone() for k, v in full_parameters(model).items()}}, states
"""

# one process without torch.distributed: DCP says it assumes so (pytest resets the filter
# meshlab.checkpoint.sharded sets for this)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

OBJECTS = "{'model': model, 'optimizer': optimizer, 'step': step}"
# rank 2 may write only the first 4 kB of a file, as on a full disk: the write past it fails
# with EFBIG (SIGXFSZ ignored, or the kernel kills the rank), where a full disk gives ENOSPC
FILE_SIZE_LIMIT = """
import resource, signal
limit = resource.getrlimit(resource.RLIMIT_FSIZE)
on_xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
if rank == 2:
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limit[1]))
"""
NO_FILE_SIZE_LIMIT = """
resource.setrlimit(resource.RLIMIT_FSIZE, limit)
signal.signal(signal.SIGXFSZ, on_xfsz)
"""
RELOAD = "globals().update(checkpoint.load({path!r}, {{n: globals().get(n) for n in " \
         "['model', 'optimizer', 'step']}}))"


def values(cluster: Cluster, code: str, rank: int = 0) -> Any:
    return cluster.run(code, keep_values=True).values[rank]


def assert_equal_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    for got, want in zip(a, b, strict=True):
        assert got.keys() == want.keys()
        unequal = [k for k in want if not torch.equal(got[k], want[k])]
        assert not unequal, f"differ: {unequal}"


# -- without a cluster -------------------------------------------------------------------------

def test_a_missing_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {tmp_path}/nothing"):
        load(tmp_path / "nothing", {"step": None})


def test_a_file_where_the_checkpoint_should_be_is_no_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(FileNotFoundError, match=f"no checkpoint at {tmp_path}/file"):
        manifest(tmp_path / "file")


def test_a_folder_without_manifest_is_an_interrupted_save(tmp_path: Path) -> None:
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".metadata").write_bytes(b"")  # DCP finished, meshlab.json never came
    with pytest.raises(CheckpointError, match=r"incomplete checkpoint.*interrupted.*earlier"):
        load(tmp_path / "half", {"step": None})
    with pytest.raises(CheckpointError, match="incomplete"):
        manifest(tmp_path / "half")


def test_a_short_write_is_named_by_the_os_error_behind_it() -> None:
    # torch.save on a full device raises its own RuntimeError ("unexpected pos ..."), no errno
    from meshlab.checkpoint.failures import ReportingFileSystem

    full = r"^no space left on device \(ENOSPC\) writing /dev/full after 0 B$"
    with pytest.raises(CheckpointError, match=full), \
            ReportingFileSystem().create_stream("/dev/full", "wb") as stream:
        torch.save(torch.zeros(1000), stream)


def test_a_folder_that_cannot_be_made_is_named_with_the_os_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("a file where the checkpoint's folder should be")
    target = tmp_path / "file" / "ckpt"
    with pytest.raises(CheckpointError) as failed:
        save(target, {"step": 1})
    assert re.fullmatch(rf"checkpoint {target} not saved: not a directory \(ENOTDIR\) creating "
                        rf"{target}\.partial-\w+ on rank 0; no partial folder was left",
                        str(failed.value).splitlines()[0])


def test_one_process_round_trip_and_manifest(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    save(tmp_path / "c", {"model": model, "optimizer": optimizer, "step": 7,
                          "counters": {"epoch": 1}}, extra={"note": "unit"})
    info = manifest(tmp_path / "c")
    assert info["names"] == ["model", "optimizer", "step", "counters"]
    assert info["kinds"] == {"model": "module", "optimizer": "optimizer", "step": "value",
                             "counters": "value"}
    assert info["optimizers"] == {"optimizer": "model"}
    assert (info["world_size"], info["torch"], info["extra"]) == (1, torch.__version__,
                                                                  {"note": "unit"})
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    out = load(tmp_path / "c", {"model": fresh, "optimizer": fresh_opt, "step": None,
                                "counters": None})
    assert out["model"] is fresh and out["step"] == 7 and out["counters"] == {"epoch": 1}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(),
                                                     strict=True))
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no partial or old folder


def test_a_changed_truncated_or_added_shard_is_refused_naming_the_file(tmp_path: Path) -> None:
    # a shard altered in 1,024 places loaded without a word; a truncated one gave 9-17 KB of
    # DCP tracebacks naming no file
    model = torch.nn.Linear(32, 32, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    save(tmp_path / "c", {"model": model})
    shard = next((tmp_path / "c").glob("*.distcp"))
    blob = shard.read_bytes()
    one, two = torch.tensor(1.0).numpy().tobytes(), torch.tensor(2.0).numpy().tobytes()
    assert blob.count(one) >= 1024
    cases = [(blob.replace(one, two), r"__0_0\.distcp changed since it was saved"),
             (blob[: len(blob) // 2], r"__0_0\.distcp changed since it was saved"),
             (b"", r"__0_0\.distcp changed since it was saved")]
    for altered, said in cases:
        shard.write_bytes(altered)
        with pytest.raises(CheckpointError, match=rf"^not loaded: .*{said} \(its SHA-256"):
            load(tmp_path / "c", {"model": torch.nn.Linear(32, 32, bias=False)})
    shard.write_bytes(blob)
    (tmp_path / "c" / "planted.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"planted\.distcp was not part of the checkpoint"):
        load(tmp_path / "c", {"model": torch.nn.Linear(32, 32, bias=False)})
    (tmp_path / "c" / "planted.distcp").unlink()
    fresh = torch.nn.Linear(32, 32, bias=False)
    load(tmp_path / "c", {"model": fresh})
    assert torch.equal(fresh.weight, torch.ones(32, 32))


def test_a_checkpoint_is_private_unless_asked_and_a_damaged_manifest_is_named(
        tmp_path: Path) -> None:
    # its files were 0644 (DCP's, under the default umask): weights and pickled values
    model = torch.nn.Linear(4, 4)
    for name, readable, modes in [("mine", False, (0o700, 0o600)),
                                  ("ours", True, (0o750, 0o640))]:
        save(tmp_path / name, {"model": model, "step": 3}, group_readable=readable)
        files = list((tmp_path / name).iterdir())
        assert len(files) == 3 and (tmp_path / name).stat().st_mode & 0o777 == modes[0]
        assert {f.name: f.stat().st_mode & 0o777 for f in files} == dict.fromkeys(
            [f.name for f in files], modes[1])
    # a cut or foreign manifest: one line naming it, not a JSONDecodeError
    record = tmp_path / "mine" / MANIFEST
    text = record.read_text()
    for damaged, why in [(text[: len(text) // 2], "Unterminated string"),
                         ("", "Expecting value"), ("[]", "not a meshlab manifest")]:
        record.write_text(damaged)
        with pytest.raises(CheckpointError, match=rf"^{record} is damaged \({why}.*load an "
                                                  "earlier checkpoint$"):
            load(tmp_path / "mine", {"model": torch.nn.Linear(4, 4), "step": None})


def test_wrong_objects_are_refused_with_the_fix(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer 'optimizer' updates parameters of none.*"
                                         r"pass the model too"):
        save(tmp_path / "c", {"optimizer": optimizer})
    with pytest.raises(ValueError, match="must be JSON"):
        save(tmp_path / "c", {"step": 1}, extra={"when": object()})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="exists and is not a checkpoint"):
        save(tmp_path / "data", {"step": 1})
    save(tmp_path / "c", {"model": model, "step": 1})
    with pytest.raises(CheckpointError, match=r"holds no 'optimizer': it holds model, step"):
        load(tmp_path / "c", {"optimizer": optimizer})
    with pytest.raises(CheckpointError, match=r"nothing to load 'model' into.*build it first"):
        load(tmp_path / "c", {"model": None})


# -- on the shared 4-rank cluster --------------------------------------------------------------

@pytest.mark.cluster
def test_fsdp_round_trip_resumes_with_the_same_loss(cluster: Cluster, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    cluster.init_mesh("dp=4")
    cluster.run(SETUP.format(plan="data_parallel='zero3'") + "fit(2)")
    cluster.run(f"checkpoint.save({path!r}, {OBJECTS})")
    after = values(cluster, "fit(1)")
    cluster.run(RELOAD.format(path=path))
    assert cluster.pull("step") == {0: 2, 1: 2, 2: 2, 3: 2}
    assert values(cluster, "fit(1)") == after  # bit for bit
    assert manifest(path)["world_size"] == 4


@pytest.mark.cluster
def test_a_forward_only_cell_changes_neither_memory_nor_save(cluster: Cluster,
                                                             tmp_path: Path) -> None:
    # FSDP2 keeps the root gathered after a forward without backward (issue 17): measuring
    # activations, or any forward-only cell, must leave the figures and the save working
    path = str(tmp_path / "ckpt")
    cluster.init_mesh("dp=4")
    cluster.run(SETUP.format(plan="data_parallel='zero3'") + "fit(1)\n"
                "x = local_batch(step=0, batch=8, seq=16, vocab=cfg.vocab_size, rank=0, "
                "ranks=1)[0]")
    before, _, _ = cluster.memory("model", "optimizer")
    measured, _, acts = cluster.memory("model", "optimizer", "x")
    after, _, _ = cluster.memory("model", "optimizer")
    assert measured == before and after == before and all(d > 0 for d, _ in acts.values())
    cluster.run("model(x)")  # a forward without backward, then a save
    cluster.run(f"checkpoint.save({path!r}, {OBJECTS})")
    assert cluster.memory("model", "optimizer")[0] == before
    assert manifest(path)["names"] == ["model", "optimizer", "step"]


@pytest.mark.cluster
def test_async_save_holds_the_state_of_when_it_was_called(cluster: Cluster,
                                                          tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    cluster.init_mesh("dp=4")
    cluster.run(SETUP.format(plan="data_parallel='ddp'") + "fit(2)\nsaved = full_state()")
    # training goes on (collectives on the default group) while the ranks write
    cluster.run(f"checkpoint.save({path!r}, {OBJECTS}, async_save=True)\nfit(2)\n"
                "checkpoint.wait()")
    cluster.run(RELOAD.format(path=path) + "\nloaded = full_state()")
    assert cluster.pull("step") == {0: 2, 1: 2, 2: 2, 3: 2}
    for r in range(4):
        assert_equal_state(cluster.pull("loaded", [r])[r], cluster.pull("saved", [r])[r])


@pytest.mark.cluster
def test_a_save_failing_on_one_rank_keeps_the_previous_checkpoint(cluster: Cluster,
                                                                  tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    cluster.init_mesh("dp=4")
    cluster.run(SETUP.format(plan="data_parallel='zero3'") + "fit(1)\n"
                f"checkpoint.save({path!r}, {OBJECTS})\nsaved = full_state()\nfit(1)")
    with pytest.raises(MeshError, match="disk full on rank 2"):
        cluster.run("import torch.distributed.checkpoint.filesystem as fs\n"
                    "write = fs._write_item\n"
                    "def failing(*args):\n"
                    "    raise OSError('disk full on rank 2')\n"
                    "fs._write_item = failing if rank == 2 else write\n"
                    f"try:\n    checkpoint.save({path!r}, {OBJECTS})\n"
                    "finally:\n    fs._write_item = write")
    assert not list(Path(path).parent.glob("ckpt.partial-*"))  # removed by the failed save
    cluster.run(RELOAD.format(path=path) + "\nloaded = full_state()")
    assert cluster.pull("step") == {0: 1, 1: 1, 2: 1, 3: 1}
    assert_equal_state(cluster.pull("loaded", [0])[0], cluster.pull("saved", [0])[0])
    cluster.run(f"checkpoint.save({path!r}, {OBJECTS})")  # the next save clears the leftovers
    assert [p.name for p in Path(path).parent.iterdir()] == ["ckpt"]


@contextlib.contextmanager
def writes_limited_on_rank_2(shell: Any) -> Iterator[Any]:
    """The shell's session, a ZeRO-3 model trained a step on dp=4, and rank 2's files capped
    (lifted again on the way out)."""
    from meshlab.notebook.export import Journal

    session = shell.magics_manager.registry["MeshMagics"].session
    session.journal = Journal(4, "gloo")
    session.cluster.init_mesh("dp=4")
    session.cluster.run(SETUP.format(plan="data_parallel='zero3'") + "fit(1)\n" + FILE_SIZE_LIMIT)
    try:
        yield session
    finally:
        session.cluster.run(NO_FILE_SIZE_LIMIT)


@pytest.mark.cluster
def test_a_save_past_the_file_size_limit_says_efbig_and_removes_its_partial_folder(
        shell: Any, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with writes_limited_on_rank_2(shell) as session, pytest.raises(MeshError) as failed:
        session.checkpoint("save", path)
    # every rank raises the same error; its first line says it all
    lines = failed.value.result.summary().splitlines()
    assert re.fullmatch(rf"  \[ranks 0-3\] CheckpointError: checkpoint {path} not saved: file "
                        rf"too large \(EFBIG\) writing {path}\.partial-(\w+)/__2_0\.distcp after "
                        rf"4\.0 kB on rank 2; the partial folder {path}\.partial-\1 \(\d+\.\d kB "
                        r"written\) is removed", lines[1]), lines[1]
    assert f"nothing was saved at {path}" in lines[2]
    assert list(tmp_path.iterdir()) == []
    assert len(str(failed.value)) < 3000  # not DCP's every traceback of every rank


@pytest.mark.cluster
def test_a_failed_background_save_is_reported_under_its_own_path(shell: Any,
                                                                 tmp_path: Path) -> None:
    d2, d3 = tmp_path / "D2", tmp_path / "D3"
    # the limit holds until the background save is over: the next save waits for it
    with writes_limited_on_rank_2(shell) as session:
        assert session.checkpoint("save", d2, background=True).startswith("saving")
        with pytest.raises(MeshError) as failed:
            session.checkpoint("save", d3)
    lines = failed.value.result.summary().splitlines()
    assert re.fullmatch(rf"  \[ranks 0-3\] CheckpointError: checkpoint {d2} not saved: file "
                        rf"too large \(EFBIG\) writing {d2}\.partial-\w+/__2_0\.distcp after "
                        r"4\.0 kB on rank 2; .* is removed", lines[1]), lines[1]
    assert f"saving {d3} did not start: run it again" in str(failed.value)
    assert list(tmp_path.iterdir()) == []
    # D3 was not to blame: saved again, it saves
    session.checkpoint("save", d3)
    assert manifest(d3)["names"] == ["model", "optimizer", "step"]


# -- clusters of their own ---------------------------------------------------------------------

@pytest.mark.cluster
def test_fsdp_on_4_ranks_loads_into_tp_on_2(cluster: Cluster, test_profile: Path,
                                             tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    cluster.init_mesh("dp=4")
    cluster.run(SETUP.format(plan="data_parallel='zero3'") + "fit(2)\n"
                f"checkpoint.save({path!r}, {OBJECTS})\nsaved = full_state()")
    saved = cluster.pull("saved", [0])[0]
    next_loss = values(cluster, "fit(1)")[0]
    with Cluster(2, profile=test_profile) as pair:
        pair.init_mesh("tp=2")
        pair.run(SETUP.format(plan="data_parallel='none'") + RELOAD.format(path=path)
                 + "\nloaded = full_state()")
        placements = values(pair, "str(model.layers['0'].attention.wq.weight.placements)")
        assert placements == "(Shard(dim=0),)"  # really tensor parallel, not replicated
        for r in range(2):
            assert_equal_state(pair.pull("loaded", [r])[r], saved)
        assert pair.pull("step") == {0: 2, 1: 2}
        loss = values(pair, "fit(1)")[0]
    # the same step on other ranks sums in another order: fp32 agrees to ~1e-7
    assert loss == pytest.approx(next_loss, rel=1e-5)


@pytest.mark.cluster
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(test_profile: Path,
                                                               tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    with Cluster(2, profile=test_profile) as pair:
        pair.init_mesh("dp=2")
        pair.run(SETUP.format(plan="data_parallel='ddp'") + "fit(1)\n"
                 f"checkpoint.save({path!r}, {OBJECTS})\nsaved = full_state()\nfit(1)")
        saved = pair.pull("saved", [0])[0]
        with pytest.raises(MeshError):
            pair.run("import os, torch.distributed.checkpoint.filesystem as fs\n"
                     "write = fs._write_item\n"
                     "def dying(*args):\n"
                     "    result = write(*args)\n"
                     "    os.kill(os.getpid(), 9)  # after its first shard\n"
                     "if rank == 1:\n    fs._write_item = dying\n"
                     f"checkpoint.save({path!r}, {OBJECTS})", timeout=60)
    partial = list(tmp_path.glob("ckpt.partial-*"))
    assert len(partial) == 1 and list(partial[0].glob("*.distcp"))
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        load(partial[0], {"step": None})

    # the previous checkpoint is whole: load it here, in one process, into the plain model
    from meshlab.models import ModelConfig, Transformer

    model = Transformer(ModelConfig(dim=32, ffn_hidden=64, vocab_size=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    assert load(path, {"model": model, "optimizer": optimizer, "step": None})["step"] == 1
    for name, value in model.named_parameters():
        assert torch.equal(value, saved[0][name]), name
    state = optimizer.state_dict()["state"]
    names = [n for n, _ in model.named_parameters()]
    for i, s in state.items():
        for k, v in s.items():
            assert torch.equal(v, saved[1][f"{names[i]}.{k}"]), (names[i], k)
    assert json.loads((Path(path) / MANIFEST).read_text())["world_size"] == 2


def test_an_optimizer_pairs_with_its_fsdp_model_after_a_forward_only(tmp_path: Path) -> None:
    # A forward without backward leaves FSDP2's root gathered: the module's parameters are
    # then not the optimizer's; save must reshard first instead of asking for the model.
    import torch.distributed as dist
    from torch import nn

    from meshlab.checkpoint.sharded import _models_of

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already in this process")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 16))
        fully_shard(model[1], mesh=mesh)
        fully_shard(model, mesh=mesh)  # the root holds model[0]'s parameters itself
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(3, 16))
        objects = {"model": model, "opt": opt}
        assert _models_of(objects, {"model": "module", "opt": "optimizer"}) == {"opt": "model"}
    finally:
        dist.destroy_process_group()
