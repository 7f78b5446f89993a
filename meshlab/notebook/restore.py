"""Bring a session back on fresh engines: replay its journal, from the start or from a
checkpoint it saved.

Notebook side, plain Python. The journal is the one ``%mesh export`` writes from: the
successful ``%%mesh`` cells, mesh, pushes and pipeline bindings, in order.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshlab.notebook.export.journal import Entry, Journal
from meshlab.notebook.output import MeshError
from meshlab.notebook.ranks import format_ranks

if TYPE_CHECKING:
    from meshlab.notebook.cluster import Cluster

RESTORE_POINT = "# meshlab: restore-point"
"""A comment line that makes a restart replay up to the last cell carrying it."""

DEFAULT_NAMES = ("model", "optimizer", "step")
"""What ``%mesh checkpoint save DIR`` saves when no names are given (those defined)."""


class RestoreError(ValueError):
    """The session cannot be replayed as asked; the message names the fix."""


class ReplayError(RuntimeError):
    """A restart's replay stopped at an entry that failed; the ranks keep what ran before it.
    Shown as the cell's error (not a usage line on stderr)."""

    def __init__(self, message: str, *, failed: Entry, replayed: list[Entry],
                 not_replayed: list[Entry]) -> None:
        super().__init__(message)
        self.failed, self.replayed, self.not_replayed = failed, replayed, not_replayed


@dataclass
class Replay:
    """What a restart runs on the fresh ranks, in order."""

    entries: list[Entry]
    skipped: list[Entry] = field(default_factory=list)
    """Cells before the checkpoint that trained: the checkpoint holds their effect."""
    load: Entry | None = None
    """Loading the checkpoint, run after the setup that defines what it loads into."""
    unsafe: list[Entry] = field(default_factory=list)
    """Cells left out because they would break the restored session (they destroy the
    default process group)."""


def plan(journal: Journal, *, upto: int | None = None, checkpoint: str | None = None) -> Replay:
    """The entries to run again: all (or those up to In [upto], or to the last restore
    point); with a checkpoint, its session's setup, the load, then what ran after it."""
    entries = [e for e in journal.entries if e.replayed]
    unsafe = [e for e in entries if e.kind == "cell" and destroys_default_group(e.code)]
    entries = [e for e in entries if e not in unsafe]
    marked = [e.number for e in entries if e.kind == "cell" and RESTORE_POINT in e.code]
    if upto is None and marked:
        upto = marked[-1]
    if upto is not None:
        if upto not in {e.number for e in journal.entries}:
            known = ", ".join(str(n) for n in sorted({e.number for e in journal.entries}))
            raise RestoreError(f"--upto {upto}: no recorded cell ran as In [{upto}]; "
                               f"recorded: {known or 'none'}")
        entries = [e for e in entries if e.number <= upto]
    if checkpoint is None:
        return Replay(entries, unsafe=unsafe)
    saved = read_manifest(checkpoint)
    extra = saved.get("extra") or {}
    if extra.get("session") != journal.session:
        raise RestoreError(
            f"{checkpoint} was not saved in this session, so no cell of it marks where it "
            f"was taken: `%mesh restart` replays the session, then `%mesh checkpoint load "
            f"{checkpoint}` loads it")
    cell, names = int(extra["cell"]), list(saved["names"])
    before = [e for e in entries if e.number < cell]
    setup = [e for e in before if not (e.trained and not _binds(e.code, names))]
    return Replay(setup + [e for e in entries if e.number > cell],
                  skipped=[e for e in before if e not in setup],
                  load=Entry("code", cell, load_code(checkpoint, names),
                             note=f"%mesh checkpoint load {checkpoint}"), unsafe=unsafe)


def destroys_default_group(code: str) -> bool:
    """Does the cell call ``destroy_process_group()`` on the default group (no argument, or
    None)? Replaying it would leave the restored ranks without a process group."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return "destroy_process_group()" in code
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        args = [*node.args, *(k.value for k in node.keywords if k.arg == "group")]
        if name == "destroy_process_group" and all(
                isinstance(a, ast.Constant) and a.value is None for a in args):
            return True
    return False


def replay(cluster: Cluster, steps: Replay, redo: Callable[[str, dict[str, Any]], object],
           progress: Callable[[str], None] = print, again: str = "%mesh restart") -> list[Entry]:
    """Run the plan on the cluster (``redo(verb, kwargs)`` makes an entry's Session call);
    raise ReplayError at the first entry that fails, naming it and the entries not replayed
    (what ran before it stays on the ranks). ``again``: the command that repeats this
    restart, for the way on the error names."""
    entries = list(steps.entries)
    if steps.load is not None:  # after the last setup entry that came before the save
        at = next((i for i, e in enumerate(entries) if e.number > steps.load.number),
                  len(entries))
        entries.insert(at, steps.load)
    for i, e in enumerate(entries):
        started = time.perf_counter()
        try:
            if e.kind == "mesh":
                cluster.init_mesh(e.code)
            elif e.redo:
                redo(*e.redo)
            elif e.note.startswith("%mesh push"):
                name = e.note.removeprefix("%mesh push ")
                cluster.push({name: e.value}, list(e.ranks) if e.ranks else None)
            else:
                cluster.run(e.code, list(e.ranks) if e.ranks else None, number=e.number)
        except Exception as error:
            raise ReplayError(_stopped(e, error, entries[:i], entries[i + 1:], cluster, again),
                              failed=e, replayed=entries[:i], not_replayed=entries[i + 1:]
                              ) from error
        progress(f"  In [{e.number}] {e.note or e.kind}: {time.perf_counter() - started:.2f} s")
    return entries


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A checkpoint's meshlab.json (read by ``meshlab.checkpoint.sharded.manifest``), or a
    RestoreError saying why there is none."""
    from meshlab.checkpoint.sharded import MANIFEST, CheckpointError, manifest

    folder = Path(path)
    try:
        return manifest(folder)
    except FileNotFoundError:
        raise RestoreError(f"no checkpoint at {folder}: save one with %mesh checkpoint save"
                           ) from None
    except CheckpointError:
        raise RestoreError(f"{folder} is an incomplete checkpoint (no {MANIFEST}: its save "
                           "was interrupted); use an earlier one") from None


def save_code(path: str, names: list[str], journal: Journal, number: int, *,
              background: bool = False, group_readable: bool = False) -> str:
    """The statements every rank runs for ``%mesh checkpoint save`` (and the script too)."""
    objects = ", ".join(f"{n!r}: {n}" for n in names)
    extra = {"session": journal.session, "cell": number}
    return ("import meshlab.checkpoint.sharded\n"
            f"meshlab.checkpoint.sharded.save({str(path)!r}, {{{objects}}}, extra={extra!r}"
            + (", async_save=True" if background else "")
            + (", group_readable=True" if group_readable else "") + ")")


def load_code(path: str, names: list[str], trusted: bool = False) -> str:
    """The statements every rank runs for ``%mesh checkpoint load``: load in place, rebind."""
    # a plain value (a step counter) need not exist yet: the checkpoint defines it
    return ("import meshlab.checkpoint.sharded\n"
            f"globals().update(meshlab.checkpoint.sharded.load({str(path)!r}, "
            f"{{n: globals().get(n) for n in {names!r}}}"
            + (", trusted=True))" if trusted else "))"))


def _binds(code: str, names: list[str]) -> bool:
    """Does the cell assign one of ``names`` at its top level (so it builds, not only trains)?"""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return True  # cannot tell: run it
    for node in tree.body:
        # `step += n` counts training; `model = ...` builds
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) else [])
        for target in targets:
            if any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(target)):
                return True
    return False


def _stopped(failed: Entry, error: BaseException, replayed: list[Entry], left: list[Entry],
             cluster: Cluster, again: str) -> str:
    """A failed replay: the entry and its error by rank, what was not replayed, what the ranks
    hold, and the two ways on."""
    n, dead = cluster.world_size, cluster.dead()
    ranks = f"The {n} rank{'s are' if n != 1 else ' is'} up"
    held = (f"{ranks} and hold{'s' if n == 1 else ''} the state of what was replayed before it "
            f"({_numbers(replayed)})." if replayed else
            f"{ranks}, with nothing replayed on them: it was the first entry.")
    if dead:  # a cell that kills its rank: nothing is held whole any more
        held = (f"Rank{'s' if len(dead) > 1 else ''} {format_ranks(sorted(dead))} ended ("
                + "; ".join(sorted(set(dead.values()))) + "): the others hold only part of "
                "the session.")
    lines = [f"{again} stopped at In [{failed.number}] {_label(failed)}, which failed on "
             "replay:", f"  {_first_line(error)}",
             f"Not replayed: {_numbers(left)}." if left else "Nothing after it was left to replay.",
             held]
    before = [e.number for e in replayed if e.number < failed.number]
    way = f"To go on: fix the cause and run `{again}` again"
    if before:  # --upto takes a recorded In [n]: the last one replayed before the failure
        way += (f", or `{again} --upto {max(before)}` to replay only up to In [{max(before)}] "
                "and leave out the rest (run what you need of it by hand)")
    return "\n".join([*lines, way + "."])


def _label(e: Entry) -> str:
    """An entry as the user wrote it: a cell's first line, or its %mesh command."""
    if e.kind == "cell":
        first = next((line.strip() for line in e.code.splitlines() if line.strip()), "")
        return f"`{first[:60]}{'…' if len(first) > 60 else ''}`"
    return f"({e.note} {e.code})" if e.kind == "mesh" else f"({e.note or e.kind})"


def _numbers(entries: list[Entry]) -> str:
    """``In [4], [6], [9]``: each In [n] once, the middle elided when there are many."""
    numbers = [f"[{n}]" for n in dict.fromkeys(e.number for e in entries)]
    if len(numbers) > 12:  # a long session: the ends say where, the count how much
        numbers = [*numbers[:6], "…", *numbers[-3:], f"({len(numbers)} in all)"]
    return "In " + ", ".join(numbers)


def _first_line(error: BaseException) -> str:
    """The reason: a failed cell's first line by rank, else the error's first line."""
    text = error.result.summary() if isinstance(error, MeshError) else str(error)
    lines = [line.strip() for line in text.strip().splitlines()]
    return (lines[1] if isinstance(error, MeshError) and len(lines) > 1 else
            lines[0] if lines else type(error).__name__)


__all__ = ["DEFAULT_NAMES", "RESTORE_POINT", "Replay", "ReplayError", "RestoreError",
           "destroys_default_group", "load_code", "plan", "read_manifest", "replay", "save_code"]
