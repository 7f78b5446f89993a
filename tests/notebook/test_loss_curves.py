"""Saved loss curves (meshlab.verify.loss_curves) and `meshlab compare-losses`: files written
as a run writes them, read back, set side by side; bad files refused naming the file. The
curves of real runs (a notebook's and its exported script's) are compared in
test_export.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from meshlab.notebook.tables.losses import losses_views
from meshlab.verify.loss_curves import LossLog, code_version, compare_losses, load_runs, save_losses


def cli(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["meshlab", "compare-losses", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd)


def test_a_run_is_kept_with_its_layout_and_code_and_read_back(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    assert code_version(tmp_path) == "unknown"  # outside a work tree
    git("init", "-q")
    (tmp_path / "train.py").write_text("print(1)\n")
    git("add", "train.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    commit = code_version(tmp_path)
    assert len(commit) == 12 and "-" not in commit
    (tmp_path / "train.py").write_text("print(2)\n")
    assert code_version(tmp_path) == commit + "-dirty"

    log = LossLog(tmp_path / "runs" / "a.jsonl", layout="ddp on dp=4")
    log.record(0, 4.25, grad_norm=1.5)
    log.record(1, 3.75)  # a step without its norm; the file holds every step as written
    (run,) = load_runs([tmp_path / "runs" / "a.jsonl"])
    assert (run.name, run.layout, run.losses, run.grad_norms) == (
        "a", "ddp on dp=4", {0: 4.25, 1: 3.75}, {0: 1.5})
    assert run.versions.startswith("meshlab 0.1.0, torch 2.13.0")


def test_runs_side_by_side_name_the_first_step_apart(tmp_path: Path) -> None:
    save_losses(tmp_path / "a" / "run.jsonl", [4.0, 3.5, 3.0, 2.5], layout="ddp on dp=4")
    save_losses(tmp_path / "b" / "run.jsonl", [4.0, 3.5, 3.0 * (1 + 1e-9)], layout="tp")
    save_losses(tmp_path / "nan.jsonl", [4.0, float("nan")], layout="fp16")
    a, b, nan = load_runs([tmp_path / "a" / "run.jsonl", tmp_path / "b" / "run.jsonl",
                           tmp_path / "nan.jsonl"])
    assert a.name.endswith("a/run.jsonl")  # two files of one name: named by their paths
    exact = compare_losses([a, b])
    assert exact.steps == [0, 1, 2] and exact.first == (2, b.name, pytest.approx(1e-9))
    assert str(exact).startswith(f"step 2: {b.name}'s loss {b.losses[2]!r} differs from")
    assert compare_losses([a, b], tolerance=1e-8).ok
    assert compare_losses([a, nan], tolerance=1.0).first == (1, "nan", float("inf"))
    with pytest.raises(ValueError, match="1 run given: compare two or more"):
        compare_losses([a])
    with pytest.raises(ValueError, match="tolerance=-1: a relative difference"):
        compare_losses([a, b], tolerance=-1)
    with pytest.raises(ValueError, match="tolerance=nan: a relative difference"):
        compare_losses([a, b], tolerance=float("nan"))

    verdict, table, chart = losses_views(exact)
    assert str(verdict) == str(exact) and list(table.frame["step"]) == [0, 1, 2]
    spec = chart.spec()
    assert len(spec["hconcat"]) == 2
    assert spec["hconcat"][1]["layer"][0]["encoding"]["y"]["scale"]["type"] == "log"


def test_compare_losses_exits_1_for_ci_and_refuses_bad_files_naming_them(tmp_path: Path
                                                                         ) -> None:
    save_losses(tmp_path / "a.jsonl", [4.0, 3.5], layout="ddp", grad_norms=[2.0, 1.0])
    save_losses(tmp_path / "b.jsonl", [4.0, 3.5000001], layout="zero3")
    done = cli("a.jsonl", "b.jsonl", "--grad-norms", cwd=tmp_path)
    assert done.returncode == 0 and "a: ddp, code " in done.stdout
    assert "(grad norms)" in done.stdout and "step 1: b's loss 3.5000001" in done.stdout
    done = cli("a.jsonl", "b.jsonl", "--assert-equal", cwd=tmp_path)
    assert done.returncode == 1 and "step 1: b's loss" in done.stdout
    assert cli("a.jsonl", "b.jsonl", "--tolerance", "1e-6", cwd=tmp_path).returncode == 0
    (tmp_path / "bad.jsonl").write_text('{"format": "meshlab losses 1", "layout": "x", '
                                        '"code": "y", "meshlab": 1, "torch": 2}\n{"step": 0}\n')
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    for args, said in [
            (["a.jsonl"], "1 run given (a.jsonl): give two or more"),
            (["a.jsonl", "missing.jsonl"], "missing.jsonl: cannot read it (No such file"),
            (["a.jsonl", "binary"], "binary: it is not JSON text"),
            (["a.jsonl", "bad.jsonl"], "bad.jsonl: a line lacks or garbles 'loss'"),
            (["a.jsonl", "b.jsonl", "--assert-equal", "--tolerance", "0"], "give one"),
            (["a.jsonl", "b.jsonl", "--tolerance", "-1"], "--tolerance -1.0: a relative"),
            (["a.jsonl", "b.jsonl", "--tolerance", "nan"], "--tolerance nan: a relative")]:
        done = cli(*args, cwd=tmp_path)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr
