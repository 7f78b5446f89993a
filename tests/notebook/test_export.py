"""%mesh export and `meshlab export`: a session's cells as a torchrun script that reproduces it.

The equivalence tests train interactively on the shared 4-rank cluster, export, run the
script with real torchrun (IPython, ipyparallel and widgets made unimportable), and compare
every step's loss exactly.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from IPython.core.error import UsageError

from meshlab.mesh import MeshSpec
from meshlab.notebook.export import (
    ExportError,
    Journal,
    Layout,
    export,
    launch_script,
    parse_cells,
    python,
    read_notebook,
    rescale,
    sbatch_script,
    script,
    select,
)

REPO = Path(__file__).resolve().parents[2]


# -- the journal and the script, without a cluster ----------------------------------------

def test_cells_spec_takes_numbers_ranges_and_open_ranges() -> None:
    assert parse_cells("3-7, 9,12-") == [(3, 7), (9, 9), (12, None)]
    for bad, message in [("7-3", "runs backwards; write 3-7"), ("a", "'a' is not N, N-M"),
                         (",", "selects nothing")]:
        with pytest.raises(ExportError, match=message):
            parse_cells(bad)


def test_notebook_only_lines_become_comments_and_strings_keep_their_text() -> None:
    code = '%%mesh --ranks 0\n%time x = 1\ntable = """\n%not a magic\n  kept\n"""\n!ls\n'
    assert python(code, 3) == ('# (notebook only) %time x = 1\ntable = """\n%not a magic\n'
                               '  kept\n"""\n# (notebook only) !ls')
    with pytest.raises(ExportError, match=r"In \[4\] is not Python on line 1"):
        python("def f(:\n", 4)


def journal(*cells: tuple[int, str], mesh: str | None = "dp=4") -> Journal:
    j = Journal(world_size=4, backend="gloo")
    if mesh:
        j.record_mesh(MeshSpec.parse(mesh), 1)
    for number, code in cells:
        j.record_cell(code, number)
    return j


def test_a_cell_on_some_ranks_runs_under_an_if_with_its_strings_untouched() -> None:
    j = journal()
    j.record_cell('rows = """\n0F0 0B0\n"""\nprint(rows)', 2, ranks=[0, 2])
    j.record_cell("x = 1", 3, ranks=[0, 1, 2, 3])  # every rank: no if
    text = script(j, Layout(1, 4))
    assert '# In [2], ranks 0,2\nif rank in (0, 2):\n    rows = """\n0F0 0B0\n"""\n' \
           '    print(rows)\n' in text
    assert "# In [3]\nx = 1\n" in text
    ast.parse(text)


def test_marks_choose_cells_and_the_mesh_in_force_comes_first() -> None:
    j = journal((2, "a = 1"), (3, "# meshlab: skip\nb = 2"), (4, "c = 3"))
    assert [e.code for e in select(j)] == ["dp_shard=4", "a = 1", "c = 3"]
    assert [e.code for e in select(j, "4")] == ["dp_shard=4", "c = 3"]
    j.record_cell("  # meshlab: export\nd = 4", 5)
    assert [e.code for e in select(j)] == ["dp_shard=4", "  # meshlab: export\nd = 4"]
    with pytest.raises(ExportError, match="no %%mesh cell to export"):
        select(journal())


def test_pushed_values_become_literals_or_a_clear_error() -> None:
    import torch

    j = journal((2, "x = lr * 2"))
    j.record_push({"lr": 0.01, "sizes": [1, (2, 3)], "name": "a'b"}, 1)
    text = script(j, Layout(1, 4))
    assert "lr = 0.01\n" in text and "sizes = [1, (2, 3)]\n" in text
    assert "name = \"a'b\"\n" in text
    j.record_push({"weights": torch.ones(2)}, 3)
    with pytest.raises(ExportError, match=r"%mesh push weights \(In \[3\]\): a Tensor has no "
                                          r"literal form.*build weights in a %%mesh cell"):
        script(j, Layout(1, 4))


def test_a_bigger_job_scales_the_data_parallel_axis_or_says_why_not() -> None:
    assert str(rescale(MeshSpec.parse("dp=2 tp=2"), 16)) == "dp_shard=8 tp=2"
    assert str(rescale(MeshSpec.parse("dp_replicate=2 tp=2"), 8)) == "dp_replicate=4 tp=2"
    with pytest.raises(ExportError, match="holds 4 ranks, which does not divide 6"):
        rescale(MeshSpec.parse("dp=2 tp=2"), 6)
    text = script(journal((2, "pass"), mesh="dp=2 tp=2"), Layout(2, 8, gpus=True))
    assert 'mesh = build_mesh("dp_shard=8 tp=2")' in text
    assert "data-parallel axis scaled to the world size" in text
    assert 'runtime.init_from_env(backend="auto")' in text  # NCCL on the GPUs, not gloo


def test_a_bound_pipeline_becomes_the_same_bind_and_its_steps_one_whole_step() -> None:
    from meshlab.schedules import build, parse

    j = journal(mesh="pp=2 dp=2")
    j.record_pipeline("model", build("1f1b", ranks=2, microbatches=4), 2)
    for number in (3, 4, 5):  # %mesh step 1, step 1, step --all
        j.record_step(number)
    j.record_cell("print(pipeline.loss)", 6)
    mine = parse("0F0 0B0\n.   1F0 1B0", name="mine")
    j.record_pipeline("model", mine, 7, batch="other", loss="my_loss")
    j.record_step(8)
    text = script(j, Layout(1, 4))
    assert ('pipeline = bind(model, mesh, build("1f1b", ranks=2, microbatches=4, virtual=1), '
            "batch=batch)\n") in text
    assert text.count("pipeline.advance(None)  # the whole step") == 2
    assert text.index("# In [3]: %mesh step") < text.index("print(pipeline.loss)")
    assert "# In [4]" not in text and "# In [5]" not in text  # later slots of the same step
    bound = text.split("# In [7]: %mesh pipeline model\n")[1].split("\n\n")[0]
    namespace: dict[str, Any] = {}
    exec(bound.split("pipeline = bind(")[0], namespace)  # the imports
    call = bound.split("bind(model, mesh, ")[1].rsplit(", batch=other", 1)[0]
    rebuilt = eval(call, namespace)
    assert (rebuilt.actions, rebuilt.stage_to_rank, rebuilt.name) == (
        mine.actions, mine.stage_to_rank, "mine")
    assert bound.endswith(", batch=other, loss_fn=my_loss)")


def test_a_failed_cell_that_later_cells_need_is_named() -> None:
    j = journal((3, "%%mesh\nimport torch\nlr = 0.1"), (6, "%%mesh\nopt = make(model, lr)"),
                (7, "%%mesh\nprint(opt, model)"))
    j.record_failure("%%mesh\nmodel = build()\nboom()", 5)
    with pytest.raises(ExportError, match=r"In \[5\] failed and defines `model`, used by "
                                          r"In \[6\], In \[7\]: re-run it .* --cells"):
        script(j, Layout(1, 4))
    assert "opt = make" not in script(j, Layout(1, 4), cells="1-3")  # leaving them out works
    # a failed cell whose names nothing later needs, or re-run successfully, goes unmentioned
    j.record_cell("%%mesh\nmodel = build()", 8)
    j.record_cell("%%mesh\nprint(model)", 9)
    assert "print(model)" in script(j, Layout(1, 4), cells="1-3,8-")
    quiet = journal((6, "%%mesh\nx = 1"))
    quiet.record_failure("%%mesh\nraise ValueError", 5)
    assert "x = 1" in script(quiet, Layout(1, 4))


def test_a_comms_cell_exports_its_code_without_the_tracing() -> None:
    text = script(journal((2, "%%mesh --comms\ndist.all_reduce(x)")), Layout(1, 4))
    assert "dist.all_reduce(x)" in text
    assert "--comms" not in text and "comms" not in text.split("# In [2]")[1]


def test_a_breakpoint_exports_as_going_on_where_no_one_can_answer(tmp_path: Path) -> None:
    text = script(journal((2, "%%mesh\nx = 1\nbreakpoint()\ny = x")), Layout(1, 4))
    assert "sys.breakpointhook = lambda *args, **kwargs: None" in text
    assert text.index("sys.breakpointhook") < text.index("# In [2]")
    path = tmp_path / "hook.py"  # the hook as written makes breakpoint() a no-op
    path.write_text("import sys\nsys.breakpointhook = lambda *args, **kwargs: None\n"
                    "breakpoint()\nprint('went on')\n")
    ran = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=60)
    assert ran.stdout == "went on\n", ran.stderr
    assert "breakpointhook" not in script(journal((2, "%%mesh\nx = 1")), Layout(1, 4))


def test_launch_files_follow_torchrun_and_slurm_conventions() -> None:
    one = launch_script(Layout(1, 4))
    assert ('exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 4 train.py'
            in one)
    assert f'PYTHON="${{PYTHON:-{sys.executable}}}"' in one  # the kernel's, not PATH's torchrun
    many = launch_script(Layout(2, 8, gpus=True))
    assert "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d" in many
    assert '"${MASTER_ADDR:?set MASTER_ADDR' in many
    job = sbatch_script(Layout(2, 8, gpus=True))
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --gpus-per-node=8",
                 'srun "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_NNODES"',
                 f'PYTHON="${{PYTHON:-{sys.executable}}}"',
                 '--rdzv-endpoint "$head_node:29500" --rdzv-id "$SLURM_JOB_ID"']:
        assert line in job
    assert "--gpus-per-node" not in sbatch_script(Layout(1, 4))
    subprocess.run(["bash", "-n"], input=job, text=True, check=True)


def test_a_saved_notebook_gives_its_successful_mesh_cells_in_execution_order(
        tmp_path: Path) -> None:
    def cell(source: str, count: int | None, error: bool = False,
             tags: list[str] | None = None) -> Any:
        c = nbformat.v4.new_code_cell(source, execution_count=count)
        c.outputs = [nbformat.v4.new_output("error", ename="E", evalue="", traceback=[])] \
            if error else []
        c.metadata["tags"] = tags or []
        return c

    nb = nbformat.v4.new_notebook(cells=[
        cell("%load_ext meshlab\n%mesh start 2", 1),
        cell("%mesh init tp=2", 2),
        cell("lr = 0.5", 3),
        cell("%%mesh\nb = 2", 6),  # ran after the next one
        cell("%mesh push lr", 4),
        cell("%%mesh --ranks 1\na = 1", 5),
        cell("%%mesh\nraise ValueError", 7, error=True),
        cell("%%mesh\nc = 3", 8, tags=["meshlab-skip"]),
        cell("%mesh auto on", 9),
        cell("d = 4", 10),
        cell("%mesh auto off", 11),
        cell("e = 5", 12),  # a notebook cell again
    ])
    path = tmp_path / "session.ipynb"
    nbformat.write(nb, path)
    j = read_notebook(path)
    assert (j.world_size, j.source) == (2, "session.ipynb")
    assert [(e.number, e.kind, e.code.splitlines()[-1], e.ranks) for e in select(j)] == [
        (2, "mesh", "tp=2", None), (4, "code", "lr = 0.5", None), (5, "cell", "a = 1", (1,)),
        (6, "cell", "b = 2", None), (10, "cell", "d = 4", None)]


def test_the_console_command_writes_the_files_or_exits_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "job" / "train.py"
    done = subprocess.run(["meshlab", "export", str(REPO / "notebooks/07-export-to-batch.ipynb"),
                           "-o", str(out), "--sbatch"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["job.sbatch", "launch.sh", "train.py"]
    ast.parse(out.read_text())
    empty = tmp_path / "empty.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), empty)
    done = subprocess.run(["meshlab", "export", str(empty)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.returncode == 2 and "no %%mesh cell to export" in done.stderr
    # a broken notebook: one line naming it, not a bare KeyError
    for text, said in [('{"cells": [{"source": "x"}]}', "(no 'cell_type')"),
                       ("{not json", "(JSONDecodeError: ")]:
        broken = tmp_path / "broken.ipynb"
        broken.write_text(text)
        done = subprocess.run(["meshlab", "export", str(broken)], capture_output=True,
                              text=True, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.startswith(
            f"meshlab export: {broken} is not a saved Jupyter notebook meshlab can read {said}"
        ), done.stderr
        assert "Traceback" not in done.stderr


def test_export_names_a_script_without_py(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"must end in \.py"):
        export(journal((2, "pass")), tmp_path / "train.sh")


# -- equivalence on the live cluster -------------------------------------------------------

TRAIN = """%%mesh
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank, train
from meshlab.verify.loss_curves import LossLog

torch.manual_seed(0)
cfg = ModelConfig()
plan = ParallelPlan(data_parallel=strategy)
model = parallelize(Transformer(cfg), mesh, plan)
optimizer = build_optimizer(model, mesh, plan, lr=lr)
dp_rank, dp_ranks = data_rank(mesh)
batches = [local_batch(step=s, batch=8, seq=16, vocab=cfg.vocab_size, rank=dp_rank,
                       ranks=dp_ranks) for s in range(4)]
losses = train(model, optimizer, batches, average_over=mesh["dp"].get_group(),
               log=LossLog(losses_file, layout=f"{strategy} on {mesh_axes}"))
if rank == 0:  # one writer: four processes' lines interleave on torchrun's stdout
    print("losses", losses)
"""

BLOCKED = ("IPython", "ipyparallel", "ipywidgets", "anywidget")


def run_exported(launch: Path, blockers: Path) -> str:
    """Run launch.sh with the notebook stack unimportable; its stdout."""
    for name in BLOCKED:
        (blockers / name).mkdir(parents=True, exist_ok=True)
        (blockers / name / "__init__.py").write_text(
            f"raise ImportError('the exported script imported {name}')\n")
    env = {**os.environ, "PYTHONPATH": f"{blockers}{os.pathsep}{REPO}"}
    done = subprocess.run(["bash", str(launch)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return done.stdout


@pytest.mark.cluster
@pytest.mark.parametrize("mesh, strategy", [("dp=4", "ddp"), ("dp=2 tp=2", "zero3")])
def test_the_exported_script_reproduces_the_sessions_losses(
        shell: Any, tmp_path: Path, mesh: str, strategy: str) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session
    session.journal = Journal(4, session.cluster.backend)  # this session only
    # the run's losses kept by LossLog, the notebook's and then the script's, in one file
    losses_file = str(tmp_path / "losses.jsonl")
    shell.user_ns.update(lr=0.01, strategy=strategy, losses_file=losses_file, mesh_axes=mesh)
    for cell in [f"%mesh init {mesh}", "%mesh push lr strategy losses_file mesh_axes", TRAIN,
                 "%%mesh --ranks 0\nprint('rank 0 is done')", "%mesh status",
                 "%%mesh\n# meshlab: skip\nprint('not in the script')",
                 f"%mesh export {tmp_path / 'train.py'}"]:
        assert shell.run_cell(cell, store_history=True).success, cell
    interactive = shell.run_line_magic("mesh", "pull losses")
    assert len(set(map(tuple, interactive.values()))) == 1  # averaged over dp: one curve

    kept = Path(losses_file).rename(tmp_path / "notebook.jsonl")  # the script writes anew
    text = (tmp_path / "train.py").read_text()
    assert "not in the script" not in text and "status" not in text
    out = run_exported(tmp_path / "launch.sh", tmp_path / "blockers")
    printed = [ast.literal_eval(line.removeprefix("losses ")) for line in out.splitlines()
               if line.startswith("losses ")]
    assert out.count("rank 0 is done") == 1
    assert printed == [interactive[0]], (printed, interactive)
    # the same held by the saved curves: `meshlab compare-losses --assert-equal` as CI runs it
    done = subprocess.run(["meshlab", "compare-losses", str(kept), losses_file,
                           "--assert-equal"], capture_output=True, text=True)
    assert done.returncode == 0 and "4 steps equal in every run: notebook (" in done.stdout, \
        done.stdout + done.stderr
    assert f"{strategy} on {mesh}, code " in done.stdout
    shell.run_line_magic("mesh", f"losses {kept} {losses_file} -o comparison")
    assert shell.user_ns["comparison"].ok and shell.user_ns["comparison"].steps == [0, 1, 2, 3]


def test_export_with_nothing_recorded_names_the_fix(shell: Any, tmp_path: Path) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session
    session.journal = Journal(4, "gloo")
    with pytest.raises(UsageError, match="no %%mesh cell to export: run some"):
        shell.run_line_magic("mesh", f"export {tmp_path / 'train.py'}")
    with pytest.raises(UsageError, match="argument --nodes: '0' is not a whole number above 0"):
        shell.run_line_magic("mesh", f"export {tmp_path / 'train.py'} --nodes 0")


def test_the_journal_numbers_a_cell_as_jupyter_shows_it(shell: Any) -> None:
    # IPython 9.18 counts a cell up before running it, 8.x after: In [n] either way
    session = shell.magics_manager.registry["MeshMagics"].session
    result = shell.run_cell("number_inside = get_ipython().magics_manager.registry["
                            "'MeshMagics'].session.cell_number()", store_history=True)
    assert result.success and result.execution_count is not None
    assert shell.user_ns["number_inside"] == result.execution_count
    assert session.cell_number() == result.execution_count  # the last stored cell


def test_export_names_a_failed_cell_a_later_cell_needs(shell: Any, tmp_path: Path) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session
    session.journal = Journal(4, "gloo")
    assert not shell.run_cell("%%mesh\nfailed_model = 1\nraise ValueError('no')",
                              store_history=True).success
    failed = shell.execution_count - 1
    assert shell.run_cell("%%mesh\nprint(failed_model)", store_history=True).success
    with pytest.raises(UsageError, match=rf"In \[{failed}\] failed and defines `failed_model`"):
        shell.run_line_magic("mesh", f"export {tmp_path / 'train.py'}")
    assert not (tmp_path / "train.py").exists()


def test_launch_sh_runs_torchrun_by_the_exporting_python_without_it_on_path(
        tmp_path: Path) -> None:
    # a kernel registered from a virtual environment: its bin/ (torchrun) is not on PATH
    export(journal((2, "%%mesh\nx = 1")), tmp_path / "train.py", sbatch=True)
    # one write(2) per rank: the four share the pipe, and print's pieces could interleave
    (tmp_path / "train.py").write_text(
        "import os\nos.write(1, f\"rank {os.environ['RANK']}\\n\".encode())\n")
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["bash", str(tmp_path / "launch.sh")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split("\n"))[-4:] == [f"rank {r}" for r in range(4)]
    subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], check=True)


def test_a_saved_notebook_names_a_failed_cell_a_later_cell_needs(tmp_path: Path) -> None:
    failed = nbformat.v4.new_code_cell("%%mesh\nmodel = build()", execution_count=2)
    failed.outputs = [nbformat.v4.new_output("error", ename="E", evalue="", traceback=[])]
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%mesh init dp=4", execution_count=1), failed,
        nbformat.v4.new_code_cell("%%mesh\nprint(model)", execution_count=3)])
    nbformat.write(nb, tmp_path / "s.ipynb")
    with pytest.raises(ExportError, match=r"In \[2\] failed and defines `model`, used by In \[3\]"):
        select(read_notebook(tmp_path / "s.ipynb"))
