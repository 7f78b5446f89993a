"""A run's losses kept with what made them, and two or more runs set side by side.

``LossLog(path, layout=...)`` writes one JSON line per step (its loss, and its gradient norm
where given) after a first line naming the run: its layout, the code's version (the git
commit of the working folder, ``-dirty`` with uncommitted changes), meshlab's and torch's
versions. Each line is flushed as it is written, so a run that dies keeps its steps. Only
rank 0 writes (any rank outside a process group): give it a loss every rank agrees on (the
data-parallel mean; a pipeline's last stage sends it). ``compare_losses`` sets runs side by
side and says the first step where they differ beyond a tolerance; ``meshlab compare-losses
A B`` does so from a shell, for CI (``--assert-equal``: exit 1 unless every step is equal).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "meshlab losses 1"


def code_version(folder: Path | str = ".") -> str:
    """The git commit of ``folder``'s work tree (``-dirty`` where it has uncommitted changes),
    or "unknown" outside a git work tree."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no")
                         else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _writes() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


class LossLog:
    """Append a run's steps to ``path`` (JSON lines; rank 0 writes, see the module)."""

    def __init__(self, path: Path | str, *, layout: str, note: str = "") -> None:
        import torch

        import meshlab

        self.path, self.writes = Path(path), _writes()
        if self.writes:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            header = {"format": FORMAT, "layout": layout, "note": note,
                      "code": code_version(), "meshlab": meshlab.__version__,
                      "torch": torch.__version__}
            self.path.write_text(json.dumps(header) + "\n")

    def record(self, step: int, loss: Any, grad_norm: Any = None) -> None:
        """Step ``step``'s loss (a number or a one-element tensor) and gradient norm."""
        if not self.writes:
            return
        line = {"step": int(step), "loss": float(loss)}
        if grad_norm is not None:
            line["grad_norm"] = float(grad_norm)
        with self.path.open("a") as out:
            out.write(json.dumps(line) + "\n")


def save_losses(path: Path | str, losses: Sequence[Any], *, layout: str,
                grad_norms: Sequence[Any] | None = None, note: str = "") -> Path:
    """A finished run's losses (step 0 first) written as LossLog writes them."""
    log = LossLog(path, layout=layout, note=note)
    for step, loss in enumerate(losses):
        log.record(step, loss, None if grad_norms is None else grad_norms[step])
    return log.path


@dataclass(slots=True)
class LossRun:
    """One run's losses, as a LossLog wrote them."""

    name: str
    layout: str
    code: str
    losses: dict[int, float]
    grad_norms: dict[int, float] = field(default_factory=dict)
    versions: str = ""

    @property
    def label(self) -> str:
        return f"{self.name} ({self.layout}, code {self.code})"


def load_losses(path: Path | str) -> LossRun:
    """The run ``path`` holds; a ValueError naming the file and what it lacks otherwise."""
    path = Path(path)
    try:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno}" if isinstance(e, json.JSONDecodeError) else "it"
        raise ValueError(f"{path}: {where} is not JSON text: not a file LossLog wrote"
                         ) from None
    if not lines or not isinstance(lines[0], dict) or lines[0].get("format") != FORMAT:
        raise ValueError(f"{path}: its first line is not a {FORMAT!r} header: not a file "
                         "LossLog or save_losses wrote")
    head, steps = lines[0], lines[1:]
    try:
        return LossRun(path.stem, head["layout"], head["code"],
                       {int(s["step"]): float(s["loss"]) for s in steps},
                       {int(s["step"]): float(s["grad_norm"]) for s in steps
                        if "grad_norm" in s},
                       f"meshlab {head['meshlab']}, torch {head['torch']}")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: a line lacks or garbles {e}: each step's line holds "
                         '{"step": N, "loss": X}, as LossLog writes it') from None


def load_runs(paths: Sequence[Path | str]) -> list[LossRun]:
    """Each file's run, named by its file's stem, or by its path where two stems agree."""
    runs = [load_losses(path) for path in paths]
    names = [r.name for r in runs]
    for r, path in zip(runs, paths, strict=True):
        if names.count(r.name) > 1:
            r.name = str(path)
    return runs


@dataclass(slots=True)
class LossComparison:
    """Runs side by side: the steps all of them have, and the first beyond the tolerance."""

    runs: list[LossRun]
    tolerance: float
    steps: list[int]
    first: tuple[int, str, float] | None
    """(step, the run that differs from the first run, its relative difference)."""

    @property
    def ok(self) -> bool:
        return self.first is None and bool(self.steps)

    def rows(self) -> list[dict[str, Any]]:
        """One row per step: each run's loss, and the largest relative difference from the
        first run's."""
        base = self.runs[0]
        return [{"step": s, **{r.name: r.losses[s] for r in self.runs},
                 "largest difference": max(relative(r.losses[s], base.losses[s])
                                           for r in self.runs[1:])}
                for s in self.steps]

    def __str__(self) -> str:
        if not self.steps:
            return "no step in common: " + "; ".join(
                f"{r.name} has steps {min(r.losses, default='-')}..{max(r.losses, default='-')}"
                for r in self.runs)
        within = "equal" if self.tolerance == 0 else f"within {self.tolerance:g}"
        if self.first is None:
            return (f"{len(self.steps)} steps {within} in every run: "
                    + ", ".join(r.label for r in self.runs))
        step, name, error = self.first
        base = self.runs[0]
        other = next(r for r in self.runs if r.name == name)
        return (f"step {step}: {name}'s loss {other.losses[step]!r} differs from "
                f"{base.name}'s {base.losses[step]!r} by {error:.2e} (relative; tolerance "
                f"{self.tolerance:g}); {base.label} beside {other.label}")


def relative(a: float, b: float) -> float:
    """|a - b| over |b|; 0 where equal, infinite where either is NaN."""
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(b), 1e-30) if a == a and b == b else float("inf")


def compare_losses(runs: Sequence[LossRun], tolerance: float = 0.0) -> LossComparison:
    """``runs`` side by side over the steps every one has; the first step where a run's loss
    differs from the first run's by more than ``tolerance`` (relative; 0: bit-equal)."""
    if len(runs) < 2:
        raise ValueError(f"{len(runs)} run given: compare two or more")
    if not tolerance >= 0:  # NaN too: no difference would exceed it
        raise ValueError(f"tolerance={tolerance}: a relative difference, 0 or more")
    steps = sorted(set.intersection(*(set(r.losses) for r in runs)))
    first = next(((s, r.name, e) for s in steps for r in runs[1:]
                  if (e := relative(r.losses[s], runs[0].losses[s])) > tolerance), None)
    return LossComparison(list(runs), tolerance, steps, first)
