"""Schedules as data: parsing, validation errors, and the simulator against the published
bubble formulas. No cluster: pure Python."""

from __future__ import annotations

import pytest

from meshlab.schedules import Action, Costs, Schedule, ScheduleError, build, parse

UNIT = Costs(forward=1, backward=1)  # t_F = t_B, no communication


def test_actions_round_trip_through_their_strings() -> None:
    for text in ["1F0", "2I3", "0W1", "12B10", "3SEND_F2", "0RECV_B7"]:
        assert str(Action.parse(text)) == text
    with pytest.raises(ScheduleError, match=r"'1X0' is not an action: write STAGE KIND"):
        Action.parse("1X0")


def test_a_text_table_a_csv_and_rows_give_the_same_schedule() -> None:
    table = """
    # 1F1B on two ranks
    rank 0: 0F0 0F1 .   0B0 0F2 0B1 0B2
    rank 1: .   1F0 1B0 1F1 1B1 1F2 1B2
    """
    from_table = parse(table)
    from_csv = parse(from_table.to_csv())
    from_rows = parse([["0F0", "0F1", None, "0B0", "0F2", "0B1", "0B2"],
                       [".", "1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]])
    from_dict = parse({1: from_rows.actions[1], 0: from_rows.actions[0]})
    assert from_table.actions == from_csv.actions == from_rows.actions == from_dict.actions
    assert from_table.stage_to_rank == (0, 1) and from_table.microbatches == 3
    from_table.validate()


def test_csv_cells_are_torch_actions() -> None:
    from torch.distributed.pipelining.schedules import _Action

    schedule = build("zbv", ranks=2, microbatches=4)
    for row in schedule.to_csv().splitlines():
        for cell in row.split(","):
            assert cell == "" or str(_Action.from_str(cell)) == cell
    assert schedule.to_torch()[0][0] == _Action.from_str("0F0")


BROKEN = {
    "missing": ("0F0 0B0\n1F0", "1B0 is missing: stage 1 never runs the backward"),
    "duplicate": ("0F0 0F0 0B0\n1F0 1B0", "0F0 appears twice"),
    "order": ("0F0 0B0\n1B0 1F0", "1B0 comes before 1F0 on rank 1, but needs its result"),
    "deadlock": ("0F0 0B0 0F1 0B1\n1F0 1F1 1B1 1B0",
                 r"deadlock: rank 0 waits at 0B0 for 1B0 \(rank 1 slot 3\); rank 1 waits at "
                 r"1F1 for 0F1"),
    "wrong rank": ("0F0 1F0 1B0 0B0\n.", "1F0 is on rank 0, but stage 1 is placed on rank 1"),
    "split": ("0F0 0I0\n1F0 1B0", "0I0 has no matching 0W0"),
    "comms": ("0F0 0SEND_F0 0B0\n1F0 1B0", "0SEND_F0 is a communication action"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_schedules_name_the_fault_and_show_the_grid(case: str) -> None:
    text, message = BROKEN[case]
    placement = (0, 1) if case == "wrong rank" else None
    with pytest.raises(ScheduleError, match=message) as error:
        parse(text, stage_to_rank=placement).validate()
    assert "rank 0 " in str(error.value) and "slot" in str(error.value)  # the grid
    if case not in ("missing",):
        assert "<--" in str(error.value)  # the faulty cell marked


def test_a_stage_on_a_rank_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ScheduleError, match=r"stage 1 is placed on rank 2, but the schedule "
                                            r"has 2 ranks \(0..1\)"):
        parse("0F0 0B0\n1F0 1B0", stage_to_rank=(0, 2)).validate()


def test_a_microbatch_outside_the_step_is_refused() -> None:
    with pytest.raises(ScheduleError, match="micro-batch 5 does not exist"):
        parse("0F5 0B5\n1F5 1B5", microbatches=2).validate()


@pytest.mark.parametrize("p, m", [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 4, 8, 16)
                                  if m >= p])  # 1F1B needs m >= p
def test_1f1b_bubble_is_the_published_formula(p: int, m: int) -> None:
    timeline = build("1f1b", ranks=p, microbatches=m).simulate(UNIT)
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert timeline.makespan == 2 * (m + p - 1)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16)])
def test_gpipe_has_1f1b_bubble_but_holds_every_microbatch(p: int, m: int) -> None:
    gpipe = build("gpipe", ranks=p, microbatches=m).simulate(UNIT)
    one_f_one_b = build("1f1b", ranks=p, microbatches=m).simulate(UNIT)
    assert gpipe.bubble_fraction == pytest.approx(one_f_one_b.bubble_fraction)
    assert [gpipe.peak_inflight(r) for r in range(p)] == [m] * p
    assert [one_f_one_b.peak_inflight(r) for r in range(p)] == [p - r for r in range(p)]


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2)])
def test_interleaving_divides_the_bubble_by_v(p: int, m: int, v: int) -> None:
    plain = build("1f1b", ranks=p, microbatches=m).simulate(UNIT)
    interleaved = build("interleaved_1f1b", ranks=p, microbatches=m, virtual=v).simulate(UNIT)
    for rank in range(p):
        idle_plain = plain.makespan - plain.busy(rank)
        idle = interleaved.makespan - interleaved.busy(rank)
        assert idle == pytest.approx(idle_plain / v)
    assert interleaved.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_a_rank_accumulates_every_stage_at_once_unless_their_backwards_run_one_by_one() -> None:
    # interleaved 1F1B runs micro-batches in rounds of p: with m = p one round, so each of a
    # rank's stages runs all its backwards before the next begins (FSDP2 reduces and frees
    # its gradients in between); with more rounds all its stages accumulate together
    def accumulating(m: int, v: int) -> list[int]:
        timeline = build("interleaved_1f1b", ranks=4, microbatches=m, virtual=v).simulate(UNIT)
        return [timeline.peak_accumulating(r) for r in range(4)]

    assert accumulating(4, 2) == accumulating(4, 4) == [1] * 4
    assert accumulating(8, 2) == [2] * 4 and accumulating(16, 4) == [4] * 4
    one = build("1f1b", ranks=4, microbatches=8).simulate(UNIT)
    assert [one.peak_accumulating(r) for r in range(4)] == [1] * 4


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_has_a_third_of_the_1f1b_bubble(p: int, m: int) -> None:
    one_f_one_b = build("1f1b", ranks=p, microbatches=m).simulate(Costs(forward=1, backward=2))
    zb = build("zb_h1", ranks=p, microbatches=m).simulate(
        Costs(forward=1, backward_input=1, backward_weight=1))
    idle = sum(zb.makespan - zb.busy(r) for r in range(p))
    idle_1f1b = sum(one_f_one_b.makespan - one_f_one_b.busy(r) for r in range(p))
    assert idle == pytest.approx(idle_1f1b / 3)
    # the same peak activation memory as 1F1B
    assert max(zb.peak_inflight(r) for r in range(p)) == p


def test_communication_delays_every_hop() -> None:
    gpipe = build("gpipe", ranks=2, microbatches=1)
    # F on rank 0, hop, F + B on rank 1, hop, B on rank 0
    assert gpipe.simulate(Costs(forward=1, backward=2, comm=0.5)).makespan == 6 + 2 * 0.5


def test_uneven_stages_are_costed_per_stage() -> None:
    schedule = build("gpipe", ranks=2, microbatches=1)
    timeline = schedule.simulate(Costs(forward=1, backward=2, stage_scale=(1.0, 3.0)))
    assert timeline.makespan == 1 + 3 + 6 + 2
    with pytest.raises(ScheduleError, match="stage_scale has 1 values, the schedule has 2"):
        schedule.simulate(Costs(stage_scale=(1.0,)))


def test_timeline_frames_have_one_row_per_action() -> None:
    schedule = build("zb_h1", ranks=2, microbatches=3)
    timeline = schedule.simulate()
    frame = timeline.to_frame()
    assert len(frame) == 2 * 3 * 3 and set(frame["kind"]) == {"F", "I", "W"}
    assert list(frame.columns) == ["rank", "slot", "stage", "kind", "microbatch", "action",
                                   "start", "end"]
    per_rank = timeline.per_rank
    assert list(per_rank["rank"]) == [0, 1]
    assert (per_rank["busy"] + per_rank["idle"] == timeline.makespan).all()


def test_costs_parse_full_or_split_backward() -> None:
    assert Costs.parse("1,2").of("B") == 2 and Costs.parse("1,2").of("I") == 1
    split = Costs.parse("1,1.5,0.5")
    assert (split.of("I"), split.of("W"), split.of("B")) == (1.5, 0.5, 2.0)
    with pytest.raises(ValueError, match="give F,B"):
        Costs.parse("fast")


def test_lowering_adds_a_send_and_its_receive_for_every_hop() -> None:
    schedule: Schedule = build("1f1b", ranks=2, microbatches=2)
    lowered = schedule.lower()
    assert [str(a) for a in lowered[0]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0",
                                            "0B0", "0RECV_B1", "0B1"]
    # a receive is posted when its send happens: 1RECV_F1 as rank 0 runs 0F1, before 1F0
    assert [str(a) for a in lowered[1]] == ["1RECV_F0", "1RECV_F1", "1F0", "1B0", "1SEND_B0",
                                            "1F1", "1B1", "1SEND_B1"]
