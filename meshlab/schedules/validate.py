"""Check that a schedule can run, lower it to sends and receives, and print its grid.

Execution model (the one meshlab's executor and torch's runtime use): a rank walks its list
in order; sends never block (isend); a compute action waits until the input it needs has
been produced, on this rank or another. Point-to-point messages between two ranks are
matched in the order they were posted, so receives are posted in send order.
"""

from __future__ import annotations

from collections import defaultdict

from meshlab.schedules.actions import COMPUTE, Action, Schedule, ScheduleError

Key = tuple[int, str, int]  # (stage, kind, microbatch)


def grid(schedule: Schedule, mark: tuple[int, int] | None = None) -> str:
    """The rank x slot table, idle slots as ``.``; ``mark=(rank, slot)`` flags one cell."""
    rows = schedule.rows()
    width = max([len(c) for row in rows for c in row] + [3])
    slots = max((len(row) for row in rows), default=0)
    lines = ["slot    " + " ".join(f"{s:>{width}}" for s in range(slots))]
    for rank, row in enumerate(rows):
        cells = [f"{c or '.':>{width}}" for c in row]
        line = f"rank {rank:<3}" + " ".join(cells)
        if mark and mark[0] == rank:
            line += f"   <-- {row[mark[1]] or 'idle'} (slot {mark[1]})"
        lines.append(line)
    return "\n".join(lines)


def dependencies(action: Action, schedule: Schedule,
                 split: dict[tuple[int, int], str] | None = None) -> list[Key]:
    """The compute actions whose results ``action`` needs (forward before backward etc.).

    ``split`` is ``backward_kinds(schedule)``: pass it when asking for many actions (it
    reads the whole schedule).
    """
    s, m, last = action.stage, action.microbatch, schedule.stages - 1
    if split is None:
        split = backward_kinds(schedule)
    if action.kind == "F":
        return [(s - 1, "F", m)] if s > 0 else []
    if action.kind in ("B", "I"):
        need = [(s, "F", m)]
        if s < last:
            need.append((s + 1, split.get((s + 1, m), "B"), m))
        return need
    if action.kind == "W":
        return [(s, "I", m)]
    return []


def backward_kinds(schedule: Schedule) -> dict[tuple[int, int], str]:
    """For each (stage, microbatch): "I" when its backward is split into I and W, else "B"."""
    kinds: dict[tuple[int, int], str] = {}
    for row in schedule.actions.values():
        for a in row:
            if a is not None and a.kind in ("B", "I"):
                kinds[(a.stage, a.microbatch)] = a.kind
    return kinds


def _fail(schedule: Schedule, problem: str, at: tuple[int, int] | None = None) -> None:
    raise ScheduleError(f"{problem}\n\n{grid(schedule, at)}")


def _check_cells(schedule: Schedule) -> dict[Key, tuple[int, int]]:
    """Each action well-formed and on the rank its stage lives on; where each one is."""
    ranks = schedule.ranks
    for stage, rank in enumerate(schedule.stage_to_rank):
        if not 0 <= rank < ranks:
            _fail(schedule, f"stage {stage} is placed on rank {rank}, but the schedule has "
                  f"{ranks} ranks (0..{ranks - 1}): fix stage_to_rank or add a row")
    where: dict[Key, tuple[int, int]] = {}
    for rank in range(ranks):
        for slot, a in enumerate(schedule.actions[rank]):
            if a is None:
                continue
            at = (rank, slot)
            if a.kind not in COMPUTE:
                _fail(schedule, f"{a} is a communication action: write compute actions only "
                      f"({', '.join(COMPUTE)}); lowering adds the sends and receives", at)
            if not 0 <= a.stage < schedule.stages:
                _fail(schedule, f"{a}: stage {a.stage} does not exist (stages 0.."
                      f"{schedule.stages - 1})", at)
            if not 0 <= a.microbatch < schedule.microbatches:
                _fail(schedule, f"{a}: micro-batch {a.microbatch} does not exist "
                      f"(0..{schedule.microbatches - 1})", at)
            home = schedule.stage_to_rank[a.stage]
            if home != rank:
                _fail(schedule, f"{a} is on rank {rank}, but stage {a.stage} is placed on "
                      f"rank {home}", at)
            key = (a.stage, a.kind, a.microbatch)
            if key in where:
                _fail(schedule, f"{a} appears twice: rank {where[key][0]} slot "
                      f"{where[key][1]} and rank {rank} slot {slot}; remove one", at)
            where[key] = at
    return where


def _check_counts(schedule: Schedule, where: dict[Key, tuple[int, int]]) -> None:
    """Every (stage, micro-batch) has one F and one B, or one I and one W."""
    for stage in range(schedule.stages):
        for m in range(schedule.microbatches):
            home = schedule.stage_to_rank[stage]
            has = {k for k in COMPUTE if (stage, k, m) in where}
            if "F" not in has:
                _fail(schedule, f"{stage}F{m} is missing: stage {stage} never runs the "
                      f"forward of micro-batch {m}; add it to rank {home}")
            if "B" in has and has & {"I", "W"}:
                kind = "I" if "I" in has else "W"
                _fail(schedule, f"{stage}{kind}{m} and {stage}B{m} both present: a backward "
                      "is either one B or an I and a W", where[(stage, kind, m)])
            if not has & {"B", "I"}:
                _fail(schedule, f"{stage}B{m} is missing: stage {stage} never runs the "
                      f"backward of micro-batch {m}; add a B (or an I and a W) to rank {home}")
            if ("I" in has) != ("W" in has):
                have, lack = ("I", "W") if "I" in has else ("W", "I")
                _fail(schedule, f"{stage}{have}{m} has no matching {stage}{lack}{m}: a split "
                      "backward needs both I (inputs) and W (weights)",
                      where[(stage, have, m)])


def _check_order(schedule: Schedule, where: dict[Key, tuple[int, int]]) -> None:
    """Dependencies on the same rank must come earlier in its list."""
    split = backward_kinds(schedule)
    for key, (rank, slot) in where.items():
        action = Action(*key)
        for dep in dependencies(action, schedule, split):
            dep_rank, dep_slot = where[dep]
            if dep_rank == rank and dep_slot > slot:
                _fail(schedule, f"{action} comes before {Action(*dep)} on rank {rank}, but "
                      f"needs its result: move {action} after slot {dep_slot}", (rank, slot))


def slots(schedule: Schedule) -> dict[Key, int]:
    """The time slot each compute action runs in when every action takes one slot.

    An action runs no earlier than its place in its rank's list, after the rank's previous
    action, and after the actions it depends on; a deadlock raises ScheduleError naming
    what each stuck rank waits for.
    """
    split = backward_kinds(schedule)
    where = {(a.stage, a.kind, a.microbatch): (r, i)
             for r, row in schedule.actions.items() for i, a in enumerate(row) if a}
    rows = {r: [(i, a) for i, a in enumerate(row) if a] for r, row in schedule.actions.items()}
    position = dict.fromkeys(rows, 0)
    finished: dict[Key, int] = {}
    clock = dict.fromkeys(rows, 0)  # first free slot per rank
    progress = True
    while progress:
        progress = False
        for r, row in rows.items():
            while position[r] < len(row):
                index, a = row[position[r]]
                deps = dependencies(a, schedule, split)
                if any(d not in finished for d in deps):
                    break
                start = max([index, clock[r]] + [finished[d] for d in deps])
                finished[(a.stage, a.kind, a.microbatch)] = start + 1
                clock[r] = start + 1
                position[r] += 1
                progress = True
    stuck = [r for r, row in rows.items() if position[r] < len(row)]
    if stuck:
        waits = []
        for r in stuck:
            index, a = rows[r][position[r]]
            missing = [d for d in dependencies(a, schedule, split) if d not in finished]
            waits.append(f"rank {r} waits at {a} for " + ", ".join(
                f"{Action(*d)} (rank {where[d][0]} slot {where[d][1]})" for d in missing))
        first = rows[stuck[0]][position[stuck[0]]]
        _fail(schedule, "deadlock: " + "; ".join(waits) + ". Reorder so each rank's next "
              "action can start", (stuck[0], first[0]))
    return {k: v - 1 for k, v in finished.items()}


def lower(schedule: Schedule) -> dict[int, list[Action]]:
    """Per-rank lists with a SEND_F/SEND_B right after each action whose result another
    rank needs, and the matching RECV_F/RECV_B posted on that rank at the same moment (as
    torch's lowering does), so receives are posted in the order the sends happen."""
    split = backward_kinds(schedule)
    order = slots(schedule)
    consumers: dict[Key, list[Key]] = defaultdict(list)
    for key in order:
        for dep in dependencies(Action(*key), schedule, split):
            consumers[dep].append(key)
    rank_of = schedule.stage_to_rank
    lowered: dict[int, list[Action]] = {r: [] for r in range(schedule.ranks)}
    for key in sorted(order, key=lambda k: (order[k], rank_of[k[0]])):
        a, rank = Action(*key), rank_of[key[0]]
        lowered[rank].append(a)
        for stage, _, m in consumers[key]:
            if rank_of[stage] != rank:
                forward = a.kind == "F"
                lowered[rank].append(Action(a.stage, "SEND_F" if forward else "SEND_B", m))
                lowered[rank_of[stage]].append(
                    Action(stage, "RECV_F" if forward else "RECV_B", m))
    return lowered


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError with the grid and the faulty action marked, or return."""
    if schedule.ranks < 1 or schedule.microbatches < 1:
        raise ScheduleError(f"a schedule needs ranks and micro-batches, got "
                            f"{schedule.ranks} ranks, {schedule.microbatches} micro-batches")
    where = _check_cells(schedule)
    _check_counts(schedule, where)
    _check_order(schedule, where)
    slots(schedule)  # raises on deadlock
