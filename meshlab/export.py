"""The session journal, and the torchrun script, launch.sh and job.sbatch written from it.

Notebook side, without IPython at import (the console command ``meshlab export`` reads saved
notebooks with it). The script it writes imports ``meshlab.runtime`` and ``meshlab.mesh``, the
engine-side modules the cluster's ranks run, plus whatever the cells import: never IPython,
ipyparallel or widgets, so it runs under plain ``torchrun``.
"""

from __future__ import annotations

import ast
import datetime
import io
import json
import os
import re
import tokenize
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from meshlab.mesh import MeshSpec
from meshlab.ranks import format_ranks
from meshlab.schedules import BUILDERS, Schedule

MARKS = {"# meshlab: skip": "skip", "# meshlab: export": "export"}
"""Comment lines that take a cell out of the export, or put it in (then only marked cells go)."""
TAGS = {"meshlab-skip": "skip", "meshlab-export": "export"}
"""The same choice as a notebook cell tag."""
PORT = 29500  # torchrun's default rendezvous port


class ExportError(ValueError):
    """The session cannot be written as a script as it stands; the message says what to do."""


@dataclass(frozen=True)
class Entry:
    """One thing the session did on the ranks that the script must do too."""

    kind: str
    """"cell", "mesh" (code is the spec), or "code" (statements meshlab wrote for a magic)."""
    number: int
    """The notebook's In [number] it ran in (the order, and what --cells selects)."""
    code: str
    ranks: tuple[int, ...] | None = None
    """A cell run on these ranks only; None for all."""
    mark: str | None = None
    """"skip" or "export" when the user marked the cell."""
    note: str = ""
    """What the entry came from, for the comment above it in the script."""
    problem: str | None = None
    """Why this entry cannot be written (say, a pushed value with no literal form)."""


@dataclass
class Journal:
    """What a session ran on its ranks that succeeded, in order, with the cluster's shape."""

    world_size: int
    backend: str = "auto"
    source: str = field(default_factory=lambda: _notebook_name() or "a meshlab session")
    entries: list[Entry] = field(default_factory=list)

    def record_cell(self, code: str, number: int, ranks: list[int] | None = None,
                    mark: str | None = None) -> None:
        """A %%mesh cell that succeeded on every rank it ran on."""
        lines = [line.strip() for line in code.splitlines()]
        mark = mark or next((m for line, m in MARKS.items() if line in lines), None)
        taken = tuple(ranks) if ranks is not None and len(ranks) < self.world_size else None
        self.entries.append(Entry("cell", number, code, taken, mark))

    def record_mesh(self, spec: MeshSpec | str, number: int) -> None:
        self.entries.append(Entry("mesh", number, str(spec), note="%mesh init"))

    def record_push(self, values: dict[str, Any], number: int,
                    ranks: list[int] | None = None) -> None:
        """%mesh push: the values become literals in the script."""
        for name, value in values.items():
            text, problem = repr(value), None
            try:
                same = ast.literal_eval(text) == value
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                same = False
            if not same:
                problem = (f"%mesh push {name} (In [{number}]): a {type(value).__name__} has no "
                           f"literal form for the script: build {name} in a %%mesh cell instead, "
                           "or leave out the cells that use it with --cells")
            taken = tuple(ranks) if ranks is not None and len(ranks) < self.world_size else None
            self.entries.append(Entry("code", number, f"{name} = {text}", taken,
                                      note=f"%mesh push {name}", problem=problem))

    def record_pipeline(self, model: str, schedule: Schedule, number: int, *,
                        batch: str = "batch", loss: str | None = None,
                        name: str = "pipeline") -> None:
        """%mesh pipeline: the same bind() call on the ranks."""
        if schedule.name in BUILDERS:
            made = (f'build("{schedule.name}", ranks={schedule.ranks}, '
                    f"microbatches={schedule.microbatches}, virtual={schedule.virtual})")
            imports = "from meshlab.schedules import build"
        else:  # the user's own: its table, exactly
            made = (f"parse({schedule.to_csv()!r}, stage_to_rank={schedule.stage_to_rank}, "
                    f"microbatches={schedule.microbatches}, name={schedule.name!r})")
            imports = "from meshlab.schedules import parse"
        loss_arg = f", loss_fn={loss}" if loss else ""
        code = (f"{imports}\nfrom meshlab.schedules.execute import bind\n"
                f"{name} = bind({model}, mesh, {made}, batch={batch}{loss_arg})")
        self.entries.append(Entry("code", number, code, note=f"%mesh pipeline {model}"))

    def record_step(self, number: int, name: str = "pipeline") -> None:
        """%mesh step: in a script, the first step of a binding runs the whole step."""
        bound = next((e for e in reversed(self.entries) if e.note.startswith("%mesh pipeline")),
                     None)
        stepped = bound and any(e.note == "%mesh step" for e in
                                self.entries[self.entries.index(bound):])
        if bound and not stepped:
            self.entries.append(Entry("code", number, f"{name}.advance(None)  # the whole step",
                                      note="%mesh step"))


def _notebook_name() -> str | None:
    """The notebook this kernel serves, where Jupyter says (JupyterLab sets the variable)."""
    path = os.environ.get("JPY_SESSION_NAME")
    return Path(path).name if path else None


# -- selecting -------------------------------------------------------------------------------

def parse_cells(spec: str) -> list[tuple[int, int | None]]:
    """``"3-7,9,12-"`` -> [(3, 7), (9, 9), (12, None)]: In [n] numbers, ranges inclusive."""
    ranges: list[tuple[int, int | None]] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = re.fullmatch(r"(\d+)(?:(-)(\d*))?", part)
        if not match:
            raise ExportError(f"--cells {spec!r}: {part!r} is not N, N-M or N- (In [n] numbers)")
        first = int(match[1])
        last = first if not match[2] else int(match[3]) if match[3] else None
        if last is not None and last < first:
            raise ExportError(f"--cells {spec!r}: {part!r} runs backwards; write {last}-{first}")
        ranges.append((first, last))
    if not ranges:
        raise ExportError(f"--cells {spec!r} selects nothing: give In [n] numbers like 3-7,9")
    return ranges


def select(journal: Journal, cells: str | None = None) -> list[Entry]:
    """The entries the script repeats: the chosen cells, and the mesh in force before them."""
    ranges = parse_cells(cells) if cells else [(0, None)]

    def chosen(e: Entry) -> bool:
        return any(a <= e.number and (b is None or e.number <= b) for a, b in ranges)

    entries = [e for e in journal.entries if chosen(e) and e.mark != "skip"]
    if any(e.mark == "export" for e in entries):
        entries = [e for e in entries if e.kind != "cell" or e.mark == "export"]
    if not any(e.kind == "cell" for e in entries):
        raise ExportError("no %%mesh cell to export: run some (only those that succeed on every "
                          "rank are recorded), or widen --cells")
    if entries[0].kind != "mesh":  # the script needs the mesh the first cell saw
        first = journal.entries.index(entries[0])
        in_force = [e for e in journal.entries[:first] if e.kind == "mesh"]
        entries = in_force[-1:] + entries
    for e in entries:
        if e.problem:
            raise ExportError(e.problem)
    return entries


# -- writing ---------------------------------------------------------------------------------

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
           files: tuple[str, str, str | None] = ("train.py", "launch.sh", None)) -> str:
    """The standalone torchrun script for the chosen entries."""
    entries = select(journal, cells)
    train, launch, sbatch = files
    run_lines = [f"torchrun {torchrun_args(where)} {train}", f"bash {launch}"]
    if sbatch:
        run_lines.append(f"sbatch {sbatch}")
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


def launch_script(where: Layout, train: str = "train.py") -> str:
    """launch.sh: torchrun on this node, or on each node with the first one's address."""
    lines = ["#!/usr/bin/env bash", "# Exported by meshlab."]
    if where.nodes == 1:
        lines.append(f"# Runs {train} on {where.per_node} processes of this machine.")
    else:
        lines += [f"# Run this on each of the {where.nodes} nodes, with MASTER_ADDR set to the "
                  "first node's address", "# (and the same RUN_ID on all of them)."]
    lines += ["set -euo pipefail", 'cd "$(dirname "$0")"']
    if where.nodes > 1:
        lines.append(': "${MASTER_ADDR:?set MASTER_ADDR to the first node\'s address}"')
    lines.append(f'exec torchrun {torchrun_args(where)} {train} "$@"')
    return "\n".join(lines) + "\n"


def sbatch_script(where: Layout, train: str = "train.py", job: str = "meshlab") -> str:
    """job.sbatch: one task per node, each running torchrun, rendezvous on the first node."""
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
        f"srun torchrun --nnodes \"$SLURM_NNODES\" --nproc-per-node {where.per_node} \\",
        f'    --rdzv-backend c10d --rdzv-endpoint "$head_node:{PORT}" '
        '--rdzv-id "$SLURM_JOB_ID" \\',
        f"    {train}",
    ]
    return "\n".join(lines) + "\n"


def export(journal: Journal, path: str | Path, *, sbatch: bool = False, nodes: int = 1,
           gpus_per_node: int | None = None, cells: str | None = None) -> list[Path]:
    """Write the script (``path``), launch.sh beside it, and job.sbatch if asked."""
    train = Path(path)
    if train.suffix != ".py":
        raise ExportError(f"{train}: the script's name must end in .py, e.g. train.py")
    where = layout(journal, nodes, gpus_per_node)
    launch, job = train.with_name("launch.sh"), train.with_name("job.sbatch")
    text = script(journal, where, cells=cells,
                  files=(train.name, launch.name, job.name if sbatch else None))
    train.parent.mkdir(parents=True, exist_ok=True)
    train.write_text(text)
    launch.write_text(launch_script(where, train.name))
    launch.chmod(0o755)
    written = [train, launch]
    if sbatch:
        job.write_text(sbatch_script(where, train.name, job=train.stem))
        written.append(job)
    return written


# -- from a saved notebook -------------------------------------------------------------------

def read_notebook(path: str | Path) -> Journal:
    """The journal of a saved notebook: its %%mesh cells that ran without error (in execution
    order; all of them, in document order, if the notebook was saved without running)."""
    from IPython.core.magic_arguments import parse_argstring

    from meshlab.magics import SUBCOMMANDS, cell_arguments

    nb = json.loads(Path(path).read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    ran = [c for c in cells if c.get("execution_count")]
    if ran:
        cells = sorted(ran, key=lambda c: c["execution_count"])
    journal = Journal(world_size=4, source=Path(path).name)
    literals: dict[str, str] = {}  # names plain cells assign literals to, for %mesh push
    auto = False
    for position, cell in enumerate(cells, 1):
        source = "".join(cell["source"])
        number = cell.get("execution_count") or position
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            continue
        tag = next((TAGS[t] for t in cell.get("metadata", {}).get("tags", []) if t in TAGS),
                   None)
        stripped = source.lstrip()
        if stripped.startswith("%%mesh") or (auto and not stripped.startswith("%")):
            if tag == "skip":
                continue
            option_line = stripped.splitlines()[0][len("%%mesh"):] \
                if stripped.startswith("%%mesh") else ""
            args = parse_argstring(cell_arguments, option_line)
            ranks = _rank_list(args.ranks, journal.world_size)
            journal.record_cell(source, number, ranks, mark=tag)
            continue
        literals.update(_literal_assignments(source))  # `lr = 0.01` then `%mesh push lr`
        for line in source.splitlines():
            words = line.strip().split(maxsplit=2)
            if len(words) < 2 or words[0] != "%mesh":
                continue
            sub, rest = words[1], words[2] if len(words) > 2 else ""
            if sub == "auto":
                auto = rest.strip() == "on"
            elif sub == "start":
                args = parse_argstring(SUBCOMMANDS["start"], rest)
                journal.world_size = args.n or journal.world_size
                journal.backend = args.backend or journal.backend
            elif sub == "init" and rest.strip():
                journal.record_mesh(MeshSpec.parse(rest), number)
            elif sub == "push":
                args = parse_argstring(SUBCOMMANDS["push"], rest)
                _push_literals(journal, args.names, literals, number)
            elif sub == "pipeline":
                args = parse_argstring(SUBCOMMANDS["pipeline"], rest)
                _pipeline(journal, args, number, literals)
            elif sub == "step":
                journal.record_step(number)
    return journal


def _rank_list(spec: str | None, world_size: int) -> list[int] | None:
    from meshlab.ranks import parse_ranks

    return parse_ranks(spec.strip("'\""), world_size) if spec else None


def _literal_assignments(source: str) -> dict[str, str]:
    """``name = <literal>`` at the top level of a plain cell (its magic lines aside)."""
    source = "\n".join("pass" if line.lstrip().startswith(("%", "!")) else line
                       for line in source.splitlines())
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a cell with magics
        return {}
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            try:
                ast.literal_eval(node.value)
            except ValueError:
                continue
            found[node.targets[0].id] = ast.get_source_segment(source, node.value) or ""
    return found


def _push_literals(journal: Journal, names: list[str], literals: dict[str, str],
                   number: int) -> None:
    for name in names:
        if name not in literals:
            raise ExportError(f"%mesh push {name} (In [{number}]): no earlier cell assigns "
                              f"{name} a literal value; assign it in a %%mesh cell instead")
        journal.record_push({name: ast.literal_eval(literals[name])}, number)


def _pipeline(journal: Journal, args: Any, number: int, literals: dict[str, str]) -> None:
    from meshlab.stepping import resolve

    spec = next((MeshSpec.parse(e.code) for e in reversed(journal.entries)
                 if e.kind == "mesh"), None)
    if spec is None or spec.pp < 2:
        raise ExportError(f"%mesh pipeline (In [{number}]) needs a mesh with a pp axis first")
    namespace = {k: ast.literal_eval(v) for k, v in literals.items()}
    schedule = resolve(args.schedule, ranks=spec.pp, microbatches=args.microbatches,
                       virtual=args.virtual, namespace=namespace)
    journal.record_pipeline(args.model, schedule, number, batch=args.batch, loss=args.loss)


def main(argv: list[str] | None = None) -> int:
    """``meshlab export NOTEBOOK.ipynb -o train.py [--sbatch] [--nodes N] ...``"""
    import argparse

    parser = argparse.ArgumentParser(
        prog="meshlab", description="Write a saved meshlab notebook as a torchrun script.")
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("export", help="notebook -> train.py, launch.sh (job.sbatch)")
    cmd.add_argument("notebook", type=Path)
    cmd.add_argument("-o", "--output", type=Path, default=Path("train.py"))
    cmd.add_argument("--sbatch", action="store_true", help="also write job.sbatch")
    cmd.add_argument("--nodes", type=int, default=1)
    cmd.add_argument("--gpus-per-node", type=int)
    cmd.add_argument("--cells", help="In [n] numbers to take, e.g. 3-7,9 (default: all)")
    args = parser.parse_args(argv)
    try:
        journal = read_notebook(args.notebook)
        written = export(journal, args.output, sbatch=args.sbatch, nodes=args.nodes,
                         gpus_per_node=args.gpus_per_node, cells=args.cells)
    except (ExportError, ValueError, OSError) as e:
        parser.exit(2, f"meshlab export: {e}\n")
    print("wrote " + ", ".join(map(str, written)) + f"; run it with: bash {written[1]}")
    return 0
