"""Pipeline actions and schedules as plain data.

An action is (stage, kind, microbatch) written ``"1F0"``: stage 1, forward, micro-batch 0.
Compute kinds: F (forward), B (full backward), I (backward for inputs), W (backward for
weights); lowering adds SEND_F/RECV_F (activations) and SEND_B/RECV_B (gradients). The
string form is torch.distributed.pipelining's, so schedules round-trip through its CSV.

A schedule is one list of actions per rank, ``None`` for an idle slot, plus where each
stage lives (``stage_to_rank``): contiguous (stage s on rank s), looped (v virtual stages
per rank, stage s on rank s % p) or V-shaped (rank r holds stages r and 2p-1-r).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from meshlab.schedules.simulate import Costs, Timeline

COMPUTE = ("F", "B", "I", "W")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class ScheduleError(ValueError):
    """A schedule that cannot run; the message shows the rank x slot grid at the fault."""


class Action(NamedTuple):
    """One step of one rank: run ``kind`` for ``microbatch`` on pipeline ``stage``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"1F0"`` -> Action(1, "F", 0)."""
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(f"{text!r} is not an action: write STAGE KIND MICROBATCH, "
                                f"e.g. '1F0', with KIND one of {', '.join(COMPUTE + COMMS)}")
        stage, kind, microbatch = match.groups()
        return cls(int(stage), kind, int(microbatch))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


def contiguous(ranks: int) -> tuple[int, ...]:
    """Stage s on rank s."""
    return tuple(range(ranks))


def looped(ranks: int, virtual: int) -> tuple[int, ...]:
    """``virtual`` stages per rank, dealt round-robin: stage s on rank s % ranks."""
    return tuple(s % ranks for s in range(ranks * virtual))


def vshape(ranks: int) -> tuple[int, ...]:
    """Two stages per rank, down then back up: rank r holds stages r and 2*ranks-1-r."""
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists (``None`` = idle slot) and the stage each rank holds."""

    actions: dict[int, list[Action | None]]
    stage_to_rank: tuple[int, ...]
    microbatches: int
    name: str = "custom"

    @property
    def ranks(self) -> int:
        return len(self.actions)

    @property
    def stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def virtual(self) -> int:
        """Stages per rank."""
        return max(1, self.stages // max(1, self.ranks))

    def stages_of(self, rank: int) -> list[int]:
        """The stages placed on ``rank``, in order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def compute_actions(self, rank: int) -> list[Action]:
        """``rank``'s actions without the idle slots."""
        return [a for a in self.actions[rank] if a is not None]

    def rows(self) -> list[list[str]]:
        """One row of action strings per rank, "" for idle: torch's CSV layout."""
        return [["" if a is None else str(a) for a in self.actions[r]]
                for r in range(self.ranks)]

    def to_csv(self) -> str:
        """torch.distributed.pipelining's compute-only CSV (one row per rank)."""
        return "".join(",".join(row) + "\n" for row in self.rows())

    def to_torch(self) -> dict[int, list[Any]]:
        """torch's ``_Action`` lists, for ``_PipelineScheduleRuntime``."""
        from torch.distributed.pipelining.schedules import _Action

        return {r: [None if a is None else _Action.from_str(str(a)) for a in self.actions[r]]
                for r in range(self.ranks)}

    def grid(self, mark: tuple[int, int] | None = None) -> str:
        """The rank x slot table; ``mark=(rank, slot)`` points at one cell."""
        from meshlab.schedules.validate import grid

        return grid(self, mark)

    def validate(self) -> Schedule:
        """Raise ScheduleError naming the first problem; return self when runnable."""
        from meshlab.schedules.validate import validate

        validate(self)
        return self

    def simulate(self, costs: Costs | None = None) -> Timeline:
        """Run the schedule against a cost model: start and end of every action."""
        from meshlab.schedules.simulate import Costs, simulate

        return simulate(self, costs or Costs())

    def lower(self) -> dict[int, list[Action]]:
        """Compute actions with the sends and receives between ranks added."""
        from meshlab.schedules.validate import lower

        return lower(self)

    def __str__(self) -> str:
        return f"{self.name}: {self.ranks} ranks, {self.stages} stages, " \
               f"{self.microbatches} micro-batches\n{self.grid()}"


def from_rows(rows: Sequence[Sequence[Any]] | dict[int, Sequence[Any]], *,
              stage_to_rank: Sequence[int] | None = None, microbatches: int | None = None,
              name: str = "custom") -> Schedule:
    """A schedule from per-rank lists of actions or strings ("" / "." / None = idle).

    The placement defaults to the one the actions imply (each stage on the rank that runs
    it); micro-batches default to one more than the largest index used.
    """
    ranks = dict(rows) if isinstance(rows, dict) else dict(enumerate(rows))
    if sorted(ranks) != list(range(len(ranks))):
        raise ScheduleError(f"ranks {sorted(ranks)} must be 0..{len(ranks) - 1}")
    actions: dict[int, list[Action | None]] = {}
    for rank in range(len(ranks)):
        actions[rank] = [_action(item) for item in ranks[rank]]
    used = [a for row in actions.values() for a in row if a is not None]
    if stage_to_rank is None:
        placed: dict[int, int] = {}
        for rank, row in actions.items():
            for a in row:
                if a is not None:
                    placed.setdefault(a.stage, rank)
        stages = max(placed, default=-1) + 1
        missing = [s for s in range(stages) if s not in placed]
        if missing:
            raise ScheduleError(f"no rank runs stage(s) {missing}: give stage_to_rank")
        stage_to_rank = [placed[s] for s in range(stages)]
    if microbatches is None:
        microbatches = max((a.microbatch for a in used), default=-1) + 1
    return Schedule(actions, tuple(stage_to_rank), microbatches, name)


def _action(item: Any) -> Action | None:
    if item is None or isinstance(item, Action):
        return item
    if isinstance(item, tuple) and len(item) == 3:
        return Action(int(item[0]), str(item[1]), int(item[2]))
    text = str(item).strip()
    if text in ("", ".", "-"):
        return None
    return Action.parse(text)


def parse(source: str | Sequence[Sequence[Any]] | dict[int, Sequence[Any]], *,
          stage_to_rank: Sequence[int] | None = None, microbatches: int | None = None,
          name: str = "custom") -> Schedule:
    """A custom schedule from a text table, torch's CSV, or per-rank lists.

    Text: one row per rank, actions separated by spaces, commas or ``|``; ``.`` or an
    empty CSV cell is an idle slot; an optional ``rank N:`` prefix and ``#`` comments are
    ignored::

        0F0 0F1 .   0B0 0B1
        .   1F0 1B0 1F1 1B1
    """
    if not isinstance(source, str):
        return from_rows(source, stage_to_rank=stage_to_rank, microbatches=microbatches,
                         name=name)
    rows = []
    for line in source.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        line = re.sub(r"^(rank\s*)?\d+\s*:", "", line).strip()
        cells = line.split(",") if "," in line else re.split(r"[\s|]+", line)
        rows.append([c.strip() for c in cells])
    if not rows:
        raise ScheduleError("the schedule text has no rows: write one row of actions per rank")
    return from_rows(rows, stage_to_rank=stage_to_rank, microbatches=microbatches, name=name)
