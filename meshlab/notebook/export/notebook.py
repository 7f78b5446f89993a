"""A saved notebook read as a journal, and the ``meshlab export`` console command."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from meshlab.mesh import MeshSpec
from meshlab.notebook.export.journal import ExportError, Journal
from meshlab.notebook.export.script import export

TAGS = {"meshlab-skip": "skip", "meshlab-export": "export"}
"""Cell tags that make the same choice as meshlab.notebook.export.journal.MARKS."""


def read_notebook(path: str | Path) -> Journal:
    """The journal of a saved notebook: its %%mesh cells that ran without error (in execution
    order; all of them, in document order, if the notebook was saved without running)."""
    try:
        return _read(path)
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        what = f"no {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ExportError(f"{path} is not a saved Jupyter notebook meshlab can read ({what}): "
                          "open it in Jupyter and save it again, or check the file") from None


def _read(path: str | Path) -> Journal:
    from meshlab.notebook import commands

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
            if source.lstrip().startswith("%%mesh") or (auto and not source.lstrip()
                                                        .startswith("%")):
                journal.record_failure(source, number)
            continue
        tag = next((TAGS[t] for t in cell.get("metadata", {}).get("tags", []) if t in TAGS),
                   None)
        stripped = source.lstrip()
        if stripped.startswith("%%mesh") or (auto and not stripped.startswith("%")):
            if tag == "skip":
                continue
            option_line = stripped.splitlines()[0][len("%%mesh"):] \
                if stripped.startswith("%%mesh") else ""
            args = commands.parse_cell(option_line)
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
                args = commands.parse("start", rest)
                journal.world_size = args.n or journal.world_size
                journal.backend = args.backend or journal.backend
            elif sub == "init" and rest.strip():
                journal.record_mesh(MeshSpec.parse(rest), number)
            elif sub == "push":
                args = commands.parse("push", rest)
                _push_literals(journal, args.names, literals, number)
            elif sub == "pipeline":
                args = commands.parse("pipeline", rest)
                _pipeline(journal, args, number, literals)
            elif sub == "step":
                journal.record_step(number)
    return journal


def _rank_list(spec: str | None, world_size: int) -> list[int] | None:
    from meshlab.notebook.ranks import parse_ranks

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
    from meshlab.notebook.stepping import resolve

    spec = next((MeshSpec.parse(e.code) for e in reversed(journal.entries)
                 if e.kind == "mesh"), None)
    if spec is None or spec.pp < 2:
        raise ExportError(f"%mesh pipeline (In [{number}]) needs a mesh with a pp axis first")
    namespace = {k: ast.literal_eval(v) for k, v in literals.items()}
    schedule = resolve(args.schedule, ranks=spec.pp, microbatches=args.microbatches,
                       virtual=args.virtual, namespace=namespace)
    journal.record_pipeline(args.model, schedule, number, batch=args.batch, loss=args.loss)


def add_command(commands: Any) -> None:
    """``meshlab export NOTEBOOK.ipynb -o train.py [--sbatch] [--nodes N] ...``"""
    from meshlab.notebook import command_options as commands_types
    cmd = commands.add_parser("export", help="notebook -> train.py, launch.sh (job.sbatch)",
                              description="Write a saved meshlab notebook as a torchrun script.")
    cmd.add_argument("notebook", type=Path)
    cmd.add_argument("-o", "--output", type=Path, default=Path("train.py"))
    cmd.add_argument("--sbatch", action="store_true", help="also write job.sbatch")
    cmd.add_argument("--ray", action="store_true", help="also write ray_job.py (Ray)")
    cmd.add_argument("--nodes", type=commands_types.count, default=1)
    cmd.add_argument("--gpus-per-node", type=commands_types.count)
    cmd.add_argument("--cells", help="In [n] numbers to take, e.g. 3-7,9 (default: all)")
    cmd.set_defaults(run=run_command)


def run_command(args: Any, parser: Any) -> int:
    try:
        journal = read_notebook(args.notebook)
        written = export(journal, args.output, sbatch=args.sbatch, ray=args.ray,
                         nodes=args.nodes,
                         gpus_per_node=args.gpus_per_node, cells=args.cells)
    except (ExportError, ValueError, OSError) as e:
        parser.exit(2, f"meshlab export: {e}\n")
    print("wrote " + ", ".join(map(str, written)) + f"; run it with: bash {written[1]}",
          *written.notes, sep="\n")
    return 0
