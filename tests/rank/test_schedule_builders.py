"""The built-in schedules, checked against torch.distributed.pipelining's own schedule classes.

torch computes every rank's ``pipeline_order`` in the schedule's constructor, so a stand-in
stage with the few attributes the constructors read is enough: no model, no process group.
Compared as per-rank rows of action strings ("" = idle slot): slot for slot where torch's grid
is time-aligned (interleaved, looped BFS and ZB-H1 with microbatches >= ranks; ZBV always), the
compute order alone elsewhere (torch's GPipe/1F1B/DualPipeV orders have no idle slots).
"""

from __future__ import annotations

from typing import Any

import pytest

from meshlab.schedules.actions import (
    Action,
    Schedule,
    ScheduleError,
    contiguous,
    looped,
    parse,
    vshape,
)
from meshlab.schedules.builders import BUILDERS, build, one_f_one_b, zb_h1

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

LOOPED = ("interleaved_1f1b", "looped_bfs")  # the schedules that take virtual=
TORCH_CLASS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "zb_h1": "ScheduleInterleavedZeroBubble",  # with one stage per rank
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def _counts(p: int) -> list[int]:
    """Micro-batch counts to try with p ranks: fewer, equal, one more, and multiples."""
    return sorted({1, p - 1, p, p + 1, 2 * p, 3 * p} - {0})


def _cases() -> list[tuple[str, int, int, int]]:
    """(name, ranks, microbatches, virtual) for every combination our builders accept."""
    cases = []
    for name in BUILDERS:
        for p in (1, 2, 3, 4):
            for m in _counts(p):
                for v in (1, 2, 3) if name in LOOPED else (1,):
                    try:
                        build(name, ranks=p, microbatches=m, virtual=v)
                    except ScheduleError:
                        continue
                    cases.append((name, p, m, v))
    return cases


CASES = _cases()


def _ids(case: tuple[str, int, int, int]) -> str:
    name, p, m, v = case
    return f"{name}-p{p}-m{m}-v{v}"


def _torch_accepts(name: str, p: int, m: int) -> bool:
    """torch's zero-bubble class wants rounds (m // p) to divide m even with one stage."""
    return name != "zb_h1" or m % max(1, m // p) == 0


class StandInStage:
    """The attributes torch's schedule constructors read from a pipeline stage."""

    def __init__(self, index: int, num_stages: int, ranks: int) -> None:
        self.stage_index = index
        self.num_stages = num_stages
        self.group_size = ranks
        self.group_rank = 0  # any rank: each one computes every rank's order
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.submod = None  # not an nn.Module, so the torch.compile check passes
        self.stage_index_to_group_rank: dict[int, int] = {}


def torch_rows(name: str, ranks: int, microbatches: int, virtual: int = 1) -> list[list[str]]:
    """torch's pipeline_order as rows of compute-action strings, "" for an idle slot.

    Non-compute actions (REDUCE_GRAD, UNSHARD, RESHARD) are dropped, DualPipeV's OVERLAP_F_B
    becomes its F then its B, and trailing idle slots are trimmed.
    """
    cls = getattr(torch_schedules, TORCH_CLASS[name])
    placement = _placement(name, ranks, virtual)
    stages = [StandInStage(s, len(placement), ranks)
              for s, r in enumerate(placement) if r == 0]
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        schedule = cls(stages[0], microbatches)
    else:
        schedule = cls(stages, microbatches)
    rows = []
    for rank in range(ranks):
        row = []
        for action in schedule.pipeline_order[rank]:
            if action is None:
                row.append("")
                continue
            for a in action.sub_actions or (action,):
                if a.computation_type.value in ("F", "B", "I", "W"):
                    row.append(str(a))
        while row and not row[-1]:
            row.pop()
        rows.append(row)
    return rows


def _placement(name: str, ranks: int, virtual: int) -> tuple[int, ...]:
    if name in ("zbv", "dualpipev"):
        return vshape(ranks)
    return looped(ranks, virtual) if name in LOOPED else contiguous(ranks)


def compute_only(rows: list[list[str]]) -> list[list[str]]:
    return [[cell for cell in row if cell] for row in rows]


def text_rows(*rows: str) -> list[list[str]]:
    """Rows written as text: actions separated by spaces, "." for an idle slot."""
    return [["" if cell == "." else cell for cell in row.split()] for row in rows]


def needs(schedule: Schedule) -> dict[Action, list[Action]]:
    """Each action's inputs: the previous stage's F, its own F, the next stage's B or I
    (a backward), its own I (a W)."""
    actions = [a for r in range(schedule.ranks) for a in schedule.compute_actions(r)]
    backward = {(a.stage, a.microbatch): a for a in actions if a.kind in ("B", "I")}
    out: dict[Action, list[Action]] = {}
    for a in actions:
        s, k = a.stage, a.microbatch
        if a.kind == "F":
            out[a] = [Action(s - 1, "F", k)] if s > 0 else []
        elif a.kind == "W":
            out[a] = [Action(s, "I", k)]
        else:
            later = [backward[s + 1, k]] if s + 1 < schedule.stages else []
            out[a] = [Action(s, "F", k), *later]
    return out


def run(schedule: Schedule, cost: dict[str, float]) -> dict[Action, tuple[float, float]]:
    """(start, end) of every action: each rank runs its list in order, an action starting
    once its rank is free and its inputs are done (no communication cost)."""
    inputs = needs(schedule)
    times: dict[Action, tuple[float, float]] = {}
    todo = {r: schedule.compute_actions(r) for r in range(schedule.ranks)}
    free = dict.fromkeys(todo, 0.0)
    while any(todo.values()):
        progressed = False
        for r, queue in todo.items():
            while queue and all(d in times for d in inputs[queue[0]]):
                a = queue.pop(0)
                start = max([free[r]] + [times[d][1] for d in inputs[a]])
                times[a] = (start, start + cost[a.kind])
                free[r] = start + cost[a.kind]
                progressed = True
        assert progressed, f"deadlock: {todo}"
    return times


def idle_time(schedule: Schedule, cost: dict[str, float]) -> float:
    times = run(schedule, cost)
    makespan = max(end for _, end in times.values())
    return schedule.ranks * makespan - sum(end - start for start, end in times.values())


def in_flight(schedule: Schedule, rank: int, until: str) -> int:
    """Most micro-batches on ``rank`` past their forward and not yet past ``until``."""
    level = peak = 0
    for a in schedule.compute_actions(rank):
        level += 1 if a.kind == "F" else -1 if a.kind == until else 0
        peak = max(peak, level)
    return peak


# torch as oracle


def _torch_time_aligned(name: str, p: int, m: int) -> bool:
    """Where torch's own idle slots make a time-aligned grid. With microbatches < ranks,
    torch's interleaved/looped grids put e.g. 3F0 in the same slot as the 2F0 it needs, and
    its zero-bubble bubble pass ignores I passes (0I0 beside 1I0); ours idle there instead."""
    return name == "zbv" or (name in (*LOOPED, "zb_h1") and m >= p)


@pytest.mark.parametrize("case", [c for c in CASES if _torch_time_aligned(*c[:3])], ids=_ids)
def test_matches_torch_slot_for_slot(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    assert build(name, ranks=p, microbatches=m, virtual=v).rows() == torch_rows(name, p, m, v)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c[0] != "1f1b" and _torch_accepts(*c[:3])], ids=_ids)
def test_matches_torch_compute_order(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    ours = build(name, ranks=p, microbatches=m, virtual=v).rows()
    assert compute_only(ours) == compute_only(torch_rows(name, p, m, v))


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "1f1b"], ids=_ids)
def test_1f1b_matches_torch_pipeline_order_but_its_last_rank(
        case: tuple[str, int, int, int]) -> None:
    # torch 2.13's Schedule1F1B.pipeline_order lists no F0 on the last rank (its
    # _step_microbatches does run it); the other ranks' orders are right.
    _, p, m, _ = case
    ours = compute_only(one_f_one_b(p, m).rows())
    assert ours[:-1] == compute_only(torch_rows("1f1b", p, m))[:-1]


@pytest.mark.parametrize(("name", "p", "m"), [
    ("1f1b", 4, 3), ("dualpipev", 2, 3), ("interleaved_1f1b", 4, 9), ("interleaved_1f1b", 3, 7),
])
def test_refuses_what_torch_refuses(name: str, p: int, m: int) -> None:
    virtual = 2 if name in LOOPED else 1
    with pytest.raises(ValueError):
        torch_rows(name, p, m, virtual)
    with pytest.raises(ScheduleError, match=f"microbatches={m}"):
        build(name, ranks=p, microbatches=m, virtual=virtual)


# 1F1B against the published order


def test_1f1b_p2_m4_is_the_published_grid() -> None:
    assert one_f_one_b(2, 4).rows() == text_rows(
        "0F0 0F1 .   0B0 0F2 0B1 0F3 0B2 .   0B3",
        ".   1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3",
    )


def test_1f1b_p4_m8_is_the_published_order() -> None:
    # rank i: min(p-1-i, m) warm-up forwards, then one forward + one backward, then backwards
    assert compute_only(one_f_one_b(4, 8).rows()) == text_rows(
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    )


def executed_by_torch_1f1b(p: int, m: int, rank: int) -> list[str]:
    """The compute order of torch's Schedule1F1B._step_microbatches on ``rank``: min(m, p -
    rank) warm-up forwards, then backward, forward, ... while forwards remain, then backwards."""
    forwards = min(m, p - rank)
    order = [f"{rank}F{k}" for k in range(forwards)]
    for k in range(m):
        order.append(f"{rank}B{k}")
        if forwards < m:
            order.append(f"{rank}F{forwards}")
            forwards += 1
    return order


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "1f1b"], ids=_ids)
def test_1f1b_matches_what_torch_executes(case: tuple[str, int, int, int]) -> None:
    _, p, m, _ = case
    assert compute_only(one_f_one_b(p, m).rows()) == [
        executed_by_torch_1f1b(p, m, r) for r in range(p)]


# ZB-H1 against the paper's claims


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_bubble_is_a_third_of_1f1b(p: int) -> None:
    # t_F = t_I = t_W = 1 against 1F1B with t_B = t_I + t_W: (p-1) vs 3(p-1) idle per rank
    zb = idle_time(zb_h1(p, 2 * p), {"F": 1, "I": 1, "W": 1})
    plain = idle_time(one_f_one_b(p, 2 * p), {"F": 1, "B": 2})
    assert zb == pytest.approx(plain / 3)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_keeps_1f1b_in_flight_micro_batches(p: int) -> None:
    # rank i holds p-i forwards awaiting their input-gradient pass, as 1F1B awaits its B
    zb, plain = zb_h1(p, 2 * p), one_f_one_b(p, 2 * p)
    for r in range(p):
        assert in_flight(zb, r, until="I") == in_flight(plain, r, until="B") == p - r


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_peak_until_weight_grads_stays_at_1f1b_peak(p: int) -> None:
    # deferred Ws keep up to i micro-batches' weight-grad inputs on rank i: no rank above p
    zb = zb_h1(p, 2 * p)
    assert max(in_flight(zb, r, until="W") for r in range(p)) == p


# properties of every schedule


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_each_pass_runs_once_on_its_stage_rank(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    schedule = build(name, ranks=p, microbatches=m, virtual=v)
    seen: dict[Action, int] = {}
    for rank in range(p):
        for a in schedule.compute_actions(rank):
            assert schedule.stage_to_rank[a.stage] == rank, f"{a} on rank {rank}"
            assert a not in seen, f"{a} twice"
            seen[a] = rank
    for stage in range(schedule.stages):
        for k in range(m):
            kinds = {a.kind for a in seen if (a.stage, a.microbatch) == (stage, k)}
            assert kinds in ({"F", "B"}, {"F", "I", "W"}), f"stage {stage} mb {k}: {kinds}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_grid_is_time_aligned(case: tuple[str, int, int, int]) -> None:
    # every input of an action is produced in an earlier slot (unit-time actions)
    name, p, m, v = case
    schedule = build(name, ranks=p, microbatches=m, virtual=v)
    slot = {a: i for r in range(p) for i, a in enumerate(schedule.actions[r]) if a}
    for a, inputs in needs(schedule).items():
        for d in inputs:
            assert slot[d] < slot[a], f"{a} in slot {slot[a]} needs {d} from slot {slot[d]}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_action_strings_round_trip(case: tuple[str, int, int, int]) -> None:
    name, p, m, v = case
    schedule = build(name, ranks=p, microbatches=m, virtual=v)
    for rank in range(p):
        for a in schedule.compute_actions(rank):
            assert Action.parse(str(a)) == a
    again = parse(schedule.to_csv(), stage_to_rank=schedule.stage_to_rank, microbatches=m)
    assert again.actions == schedule.actions


@pytest.mark.parametrize(("name", "placement"), [
    ("gpipe", contiguous(4)), ("1f1b", contiguous(4)), ("zb_h1", contiguous(4)),
    ("interleaved_1f1b", looped(4, 2)), ("looped_bfs", looped(4, 2)),
    ("zbv", vshape(4)), ("dualpipev", vshape(4)),
])
def test_placement_and_name(name: str, placement: tuple[int, ...]) -> None:
    schedule = build(name, ranks=4, microbatches=8, virtual=2 if name in LOOPED else 1)
    assert schedule.stage_to_rank == placement
    assert schedule.name == name
    assert schedule.microbatches == 8


# errors


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'zb_h2'") as info:
        build("zb_h2", ranks=2, microbatches=4)
    for name in BUILDERS:
        assert name in str(info.value)


def test_names_are_case_insensitive() -> None:
    assert build("ZBV", ranks=2, microbatches=4).name == "zbv"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ranks": 0}, "ranks=0"),
    ({"ranks": -1}, "ranks=-1"),
    ({"ranks": 2.0}, "ranks=2.0"),
    ({"microbatches": 0}, "microbatches=0"),
    ({"virtual": 0}, "virtual=0"),
])
def test_bad_sizes_name_the_value(kwargs: dict[str, Any], message: str) -> None:
    args = {"ranks": 2, "microbatches": 4, "virtual": 2, **kwargs}
    with pytest.raises(ScheduleError, match=message):
        build("interleaved_1f1b", **args)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb_h1", "zbv", "dualpipev"])
def test_virtual_is_refused_where_placement_is_fixed(name: str) -> None:
    with pytest.raises(ScheduleError, match=r"virtual=3 .*interleaved_1f1b or looped_bfs"):
        build(name, ranks=2, microbatches=8, virtual=3)


def test_v_shapes_accept_their_own_two_stages_per_rank() -> None:
    assert build("zbv", ranks=2, microbatches=4, virtual=2).virtual == 2


def test_1f1b_needs_as_many_micro_batches_as_ranks() -> None:
    with pytest.raises(ScheduleError, match="microbatches=4 or more, or use gpipe"):
        build("1f1b", ranks=4, microbatches=3)


def test_interleaved_refusal_suggests_a_count_that_works() -> None:
    with pytest.raises(ScheduleError, match=r"rounds.*microbatches=8") as info:
        build("interleaved_1f1b", ranks=4, microbatches=9, virtual=2)
    assert "pass microbatches=8" in str(info.value)
    build("interleaved_1f1b", ranks=4, microbatches=8, virtual=2)
