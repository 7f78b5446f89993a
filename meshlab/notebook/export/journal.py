"""The session journal: what a session ran on its ranks that succeeded (and which cells
failed, and whether each drew random numbers). Notebook side, plain Python (no IPython);
which of it to export is meshlab.notebook.export.selection's."""

from __future__ import annotations

import ast
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshlab.mesh import MeshSpec
from meshlab.notebook.ranks import format_ranks
from meshlab.schedules import BUILDERS, Schedule

MARKS = {"# meshlab: skip": "skip", "# meshlab: export": "export"}
"""Comment lines that take a cell out of the export, or put it in (then only marked cells go)."""


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
    redo: tuple[str, dict[str, Any]] | None = None
    """The Session call a restart makes instead of running ``code`` (pipeline, step)."""
    replayed: bool = True
    """False: a restart leaves it out (a checkpoint save would overwrite a newer one)."""
    trained: bool = False
    """The cell stepped an optimizer: a restore from a later checkpoint need not run it."""
    value: Any = field(default=None, compare=False, repr=False)
    """A pushed value itself: what a restart pushes again."""
    drew: tuple[str, ...] | None = None
    """The random generators a cell drew from on some rank (torch, cuda, random: their state
    changed; meshlab.rank.rng_state), () for none; None where no one knows (a saved notebook,
    a rank that did not answer)."""


@dataclass
class Journal:
    """What a session ran on its ranks that succeeded, in order, with the cluster's shape."""

    world_size: int
    backend: str = "auto"
    source: str = field(default_factory=lambda: _notebook_name() or "a meshlab session")
    entries: list[Entry] = field(default_factory=list)
    session: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Names this session in the checkpoints it saves (a restore replays only its own)."""
    failed: list[Entry] = field(default_factory=list)
    """%%mesh cells that failed: never exported or replayed; export names those it leaves out,
    refuses when a later exported cell reads a name one would have defined, and warns when
    one drew random numbers that the script, without it, draws differently after it."""

    def record_cell(self, code: str, number: int, ranks: list[int] | None = None,
                    mark: str | None = None, trained: bool = False,
                    drew: tuple[str, ...] | None = None) -> None:
        """A %%mesh cell that succeeded on every rank it ran on."""
        lines = [line.strip() for line in code.splitlines()]
        mark = mark or next((m for line, m in MARKS.items() if line in lines), None)
        taken = tuple(ranks) if ranks is not None and len(ranks) < self.world_size else None
        self.entries.append(Entry("cell", number, code, taken, mark, trained=trained,
                                  drew=drew))

    def record_failure(self, code: str, number: int,
                       drew: tuple[str, ...] | None = None) -> None:
        """A %%mesh cell that failed on some rank: kept apart from ``entries``."""
        self.failed.append(Entry("cell", number, code, drew=drew))

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
                                      note=f"%mesh push {name}", problem=problem, value=value))

    def record_pipeline(self, model: str, schedule: Schedule, number: int, *,
                        batch: str = "batch", loss: str | None = None,
                        name: str = "pipeline") -> None:
        """%mesh pipeline: the same bind() call on the ranks; a restart binds it again."""
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
        redo = ("pipeline", {"model": model, "schedule": schedule, "batch": batch, "loss": loss})
        self.entries.append(Entry("code", number, code, note=f"%mesh pipeline {model}",
                                  redo=redo))

    def record_step(self, number: int, slots: int | None = 1, name: str = "pipeline") -> None:
        """%mesh step: in a script, the first step of a binding runs the whole step; a restart
        steps the same ``slots`` again (None: the rest of the step)."""
        bound = next((e for e in reversed(self.entries) if e.note.startswith("%mesh pipeline")),
                     None)
        stepped = bound and any(e.note == "%mesh step" for e in
                                self.entries[self.entries.index(bound):])
        code = f"{name}.advance(None)  # the whole step" if bound and not stepped else ""
        self.entries.append(Entry("code", number, code, note="%mesh step",
                                  redo=("step", {"slots": slots})))

    def record_checkpoint(self, code: str, number: int, action: str, path: str) -> None:
        """%mesh checkpoint save|load: the same call in the script; a restart loads again but
        never saves again (it would overwrite a newer checkpoint with older state)."""
        self.entries.append(Entry("code", number, code, note=f"%mesh checkpoint {action} {path}",
                                  replayed=action != "save"))

    def record_throttle(self, number: int, ranks: list[int] | None, factor: float) -> None:
        """%mesh throttle: a restart throttles the same ranks again; no code, so an export
        leaves it out (a straggler is an experiment, not part of the training)."""
        what = f"{format_ranks(ranks)} --factor {factor:g}" if ranks is not None else "off"
        self.entries.append(Entry("code", number, "", note=f"%mesh throttle {what}",
                                  redo=("throttle", {"ranks": ranks, "factor": factor})))


def _notebook_name() -> str | None:
    """The notebook this kernel serves, where Jupyter says (JupyterLab sets the variable)."""
    path = os.environ.get("JPY_SESSION_NAME")
    return Path(path).name if path else None
