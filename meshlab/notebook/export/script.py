"""The torchrun script, launch.sh and job.sbatch written from a journal."""

from __future__ import annotations

import ast
import datetime
import io
import shlex
import sys
import textwrap
import tokenize
from dataclasses import dataclass, replace
from pathlib import Path

from meshlab.mesh import MeshSpec
from meshlab.notebook.export.journal import ExportError, Journal
from meshlab.notebook.export.ray_job import ray_job_script
from meshlab.notebook.export.selection import left_out, select
from meshlab.notebook.ranks import format_ranks
from meshlab.rank.private_files import check_target, write_private

PORT = 29500  # torchrun's default rendezvous port


@dataclass(frozen=True)
class Layout:
    """Where the script runs: nodes x processes per node, and the device kind."""

    nodes: int = 1
    per_node: int = 4
    gpus: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def layout(journal: Journal, nodes: int = 1, gpus_per_node: int | None = None) -> Layout:
    """The session's size unless --nodes / --gpus-per-node say otherwise."""
    if nodes < 1 or (gpus_per_node is not None and gpus_per_node < 1):
        raise ExportError(f"--nodes {nodes} --gpus-per-node {gpus_per_node}: both must be >= 1")
    if gpus_per_node is not None:
        return Layout(nodes, gpus_per_node, gpus=True)
    if journal.world_size % nodes:
        raise ExportError(f"{journal.world_size} ranks do not split over {nodes} nodes: give "
                          "--gpus-per-node G for a job of nodes x G ranks")
    return Layout(nodes, journal.world_size // nodes, gpus=journal.backend == "nccl")


def rescale(spec: MeshSpec, world_size: int) -> MeshSpec:
    """The mesh for another world size: data parallelism takes up the difference."""
    if world_size == spec.size:
        return spec
    if world_size % spec.size:
        raise ExportError(f"the mesh {spec} holds {spec.size} ranks, which does not divide "
                          f"{world_size}: choose --nodes / --gpus-per-node whose product is a "
                          f"multiple of {spec.size}")
    factor = world_size // spec.size
    if spec.dp_shard > 1 or spec.dp_replicate == 1:
        return replace(spec, dp_shard=spec.dp_shard * factor)
    return replace(spec, dp_replicate=spec.dp_replicate * factor)


def script(journal: Journal, where: Layout, *, cells: str | None = None,
           files: tuple[str, str, str | None, str | None] = ("train.py", "launch.sh", None,
                                                              None)) -> str:
    """The standalone torchrun script for the chosen entries."""
    entries = select(journal, cells)
    notes = left_out(journal, entries, cells)
    train, launch, sbatch, on_ray = files
    run_lines = [f"torchrun {torchrun_args(where)} {train}", f"bash {launch}"]
    if sbatch:
        run_lines.append(f"sbatch {sbatch}")
    if on_ray:
        run_lines.append(f"python {on_ray}  (on a Ray cluster)")
    numbers = sorted({e.number for e in entries if e.kind == "cell"})
    backend = journal.backend
    if where.gpus and backend == "gloo":
        backend = "auto"  # a CPU session going to GPUs: NCCL there
    mesh = next((rescale(MeshSpec.parse(e.code), where.world_size) for e in entries
                 if e.kind == "mesh"), None)
    lines = [
        f'"""Training script exported by meshlab from {journal.source} on '
        f'{datetime.date.today()}.',
        "",
        *(f"    {line}" for line in run_lines),
        "",
        f"{where.world_size} ranks ({where.nodes} node{'s' * (where.nodes > 1)} x "
        f"{where.per_node}), backend {backend}"
        + (", as in the session." if where.world_size == journal.world_size
           else f"; the session had {journal.world_size}."),
        f"Cells In {_numbers(numbers)}, in the order they ran; each runs on every rank unless",
        "it says otherwise, as under %%mesh.",
        *([f"The mesh {mesh} is the session's, its data-parallel axis scaled to the world size."]
          if mesh and journal.world_size != where.world_size else []),
        '"""',
        "",
        *(line for note in notes for line in textwrap.wrap(
            note, 95, initial_indent="# ", subsequent_indent="#   ")),
        *([""] if notes else []),
        "import torch",
        "import torch.distributed as dist",
        "",
        "from meshlab import runtime",
        "from meshlab.mesh import build as build_mesh",
        "",
        "# The bootstrap the notebook's ranks ran: process group from torchrun's environment,",
        "# one GPU per process (else the CPU), the same CPU threads per process",
        f'names = runtime.init_from_env(backend="{backend}")',
        'rank, world_size, device = names["rank"], names["world_size"], names["device"]',
    ]
    if any("breakpoint(" in e.code for e in entries):
        lines += ["# breakpoint() stopped a rank at the notebook's pdb prompt; a batch job has no",
                  "# one to answer it, so it goes on (as a replayed cell does)",
                  "import sys", "sys.breakpointhook = lambda *args, **kwargs: None"]
    for e in entries:
        lines += ["", ""]
        if e.kind == "mesh":
            spec = rescale(MeshSpec.parse(e.code), where.world_size)
            lines += [f"# In [{e.number}]: %mesh init", f'mesh = build_mesh("{spec}")']
            continue
        on = f", ranks {format_ranks(e.ranks)}" if e.ranks is not None else ""
        lines.append(f"# In [{e.number}]" + (f": {e.note}" if e.note else "") + on)
        body = python(e.code, e.number)
        lines += _only_on(body, e.ranks).splitlines()
    lines += ["", "",
              "# Every rank finishes before any closes its connections (gloo aborts a process",
              "# whose peer hangs up mid-teardown)",
              "dist.barrier()",
              "dist.destroy_process_group()", ""]
    return "\n".join(lines)


def python(code: str, number: int) -> str:
    """A cell's code as plain Python: notebook-only lines (``%magic``, ``!shell``) commented."""
    lines = code.splitlines()
    if lines and lines[0].startswith("%%mesh"):
        lines = lines[1:]
    inside = _string_continuations("\n".join(lines))
    out = []
    for i, line in enumerate(lines, 1):
        if i not in inside and line.lstrip().startswith(("%", "!")):
            line = line.replace(line.lstrip(), f"# (notebook only) {line.lstrip()}")
        out.append(line)
    text = "\n".join(out).strip("\n")
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise ExportError(f"In [{number}] is not Python on line {e.lineno}: {e.msg}; fix it or "
                          "mark it '# meshlab: skip'") from None
    return text if tree.body else text + "\npass"


def _only_on(body: str, ranks: tuple[int, ...] | None) -> str:
    """``body`` under ``if rank in ranks:``, lines inside multi-line strings left as they are."""
    if ranks is None:
        return body
    inside = _string_continuations(body)
    indented = [line if i in inside or not line.strip() else "    " + line
                for i, line in enumerate(body.splitlines(), 1)]
    return f"if rank in {tuple(ranks)!r}:\n" + "\n".join(indented)


def _string_continuations(code: str) -> set[int]:
    """Line numbers that continue a multi-line string (re-indenting them changes the string)."""
    lines: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                lines.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # python() reports the syntax error with the cell's number
    return lines


def _numbers(numbers: list[int]) -> str:
    return "[" + "], [".join(map(str, numbers)) + "]"


def torchrun_args(where: Layout) -> str:
    if where.nodes == 1:
        return f"--standalone --nproc-per-node {where.per_node}"
    return (f"--nnodes {where.nodes} --nproc-per-node {where.per_node} --rdzv-backend c10d "
            f'--rdzv-endpoint "$MASTER_ADDR:{PORT}" --rdzv-id "${{RUN_ID:-meshlab}}"')


def _python_line(python: str | None) -> str:
    """PYTHON: the interpreter that wrote the file unless the environment says otherwise."""
    return f'PYTHON="${{PYTHON:-{shlex.quote(python or sys.executable)}}}"'


TORCHRUN = '"$PYTHON" -m torch.distributed.run'
"""torchrun, run by the session's interpreter: a kernel's venv need not be on PATH."""


def launch_script(where: Layout, train: str = "train.py", python: str | None = None) -> str:
    """launch.sh: torchrun on this node, or on each node with the first one's address.

    torchrun runs as ``"$PYTHON" -m torch.distributed.run``, PYTHON defaulting to ``python``
    (the interpreter exporting: the kernel's, whose bin/ may not be on PATH)."""
    lines = ["#!/usr/bin/env bash", "# Exported by meshlab."]
    if where.nodes == 1:
        lines.append(f"# Runs {train} on {where.per_node} processes of this machine.")
    else:
        lines += [f"# Run this on each of the {where.nodes} nodes, with MASTER_ADDR set to the "
                  "first node's address", "# (and the same RUN_ID on all of them)."]
    lines += ["set -euo pipefail", 'cd "$(dirname "$0")"',
              "# torchrun, by the Python that exported this (set PYTHON to use another)",
              _python_line(python)]
    if where.nodes > 1:
        lines.append(': "${MASTER_ADDR:?set MASTER_ADDR to the first node\'s address}"')
    lines.append(f'exec {TORCHRUN} {torchrun_args(where)} {train} "$@"')
    return "\n".join(lines) + "\n"


def sbatch_script(where: Layout, train: str = "train.py", job: str = "meshlab",
                  python: str | None = None) -> str:
    """job.sbatch: one task per node, each running torchrun, rendezvous on the first node;
    torchrun as in launch.sh, ``"$PYTHON" -m torch.distributed.run``."""
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={job}",
        f"#SBATCH --nodes={where.nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={where.per_node}"] if where.gpus else []),
        f"#SBATCH --cpus-per-task={where.per_node if not where.gpus else 8 * where.per_node}",
        "#SBATCH --output=%x-%j.out",
        "# Exported by meshlab: srun starts one torchrun per node, which starts "
        f"{where.per_node} processes.",
        "set -euo pipefail",
        'cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")}"',
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# torchrun, by the Python that exported this (set PYTHON to use another)",
        _python_line(python),
        f"srun {TORCHRUN} --nnodes \"$SLURM_NNODES\" --nproc-per-node {where.per_node} \\",
        f'    --rdzv-backend c10d --rdzv-endpoint "$head_node:{PORT}" '
        '--rdzv-id "$SLURM_JOB_ID" \\',
        f"    {train}",
    ]
    return "\n".join(lines) + "\n"


class Written(list[Path]):
    """The files an export wrote (the script, launch.sh, job.sbatch if asked), and its notes:
    the failed cells it left out, and why the script may draw random numbers differently."""

    def __init__(self, files: list[Path], notes: list[str]) -> None:
        super().__init__(files)
        self.notes = notes


def export(journal: Journal, path: str | Path, *, sbatch: bool = False, ray: bool = False,
           nodes: int = 1, gpus_per_node: int | None = None, cells: str | None = None
           ) -> Written:
    """Write the script (``path``), launch.sh beside it, job.sbatch and ray_job.py if asked;
    also at the script's top, the notes returned (``Written.notes``)."""
    train = Path(path)
    if train.suffix != ".py":
        raise ExportError(f"{train}: the script's name must end in .py, e.g. train.py")
    where = layout(journal, nodes, gpus_per_node)
    launch, job = train.with_name("launch.sh"), train.with_name("job.sbatch")
    on_ray = train.with_name("ray_job.py")
    if on_ray == train:
        raise ExportError(f"{train}: ray_job.py is the Ray job's own name; call the script "
                          "train.py or another name")
    text = script(journal, where, cells=cells,
                  files=(train.name, launch.name, job.name if sbatch else None,
                         on_ray.name if ray else None))
    files = {train: (text, 0o600), launch: (launch_script(where, train.name), 0o700)}
    if sbatch:
        files[job] = (sbatch_script(where, train.name, job=train.stem), 0o600)
    if ray:
        files[on_ray] = (ray_job_script(where.nodes, where.per_node, where.gpus, PORT,
                                        train.name, on_ray.name), 0o600)
    try:
        for target in files:  # every one first: a refusal leaves nothing half written
            check_target(target)
        for target, (content, mode) in files.items():
            write_private(target, content, mode)  # only you read it: it holds your cells
    except ValueError as e:
        raise ExportError(str(e)) from None
    except OSError as e:
        raise ExportError(f"cannot write {e.filename or train.parent} ({e.strerror}): export "
                          "to a folder you can write") from None
    return Written(list(files), left_out(journal, select(journal, cells), cells))
