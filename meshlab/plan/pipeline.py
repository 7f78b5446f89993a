"""Pipeline time of one step: the schedule simulated (meshlab.schedules) with the stage
times of one micro-batch; its bubble and the micro-batches it keeps in flight."""

from __future__ import annotations

from functools import lru_cache

from meshlab.schedules import BREADTH_FIRST, Costs, build, stages_per_rank
from meshlab.schedules.simulate import Timeline, simulate

SIMULATED_ACTIONS = 512  # forwards per step simulated exactly; longer steps extrapolated
# Interleaved 1F1B runs its micro-batches in rounds (torch requires the rounds to divide
# them): the extrapolation keeps to whole rounds of p, and its makespan repeats every 2p.
_ROUNDS = "interleaved_1f1b"


def pipeline_time(schedule: str, pp: int, microbatches: int, virtual: int, t_f: float,
                  t_b: float, hop: float) -> tuple[float, float, float]:
    """(seconds, bubble fraction, peak micro-batch chunks in flight) of one step: ``t_f`` and
    ``t_b`` the forward and backward of one micro-batch on one stage, ``hop`` one send."""
    if pp == 1:
        return microbatches * (t_f + t_b), 0.0, 1.0
    if t_f <= 0:
        return 0.0, 0.0, 1.0
    # Simulate in units of t_F, rounded so that similar layouts share one simulation. Long
    # steps are simulated up to SIMULATED_ACTIONS (at least 2p micro-batches past the
    # warm-up, a multiple of p): from there the makespan repeats its increments every p
    # micro-batches (2p interleaved), hop waits included, so it is extrapolated from two
    # simulations a period apart, the later at the same phase as ``microbatches``.
    backward, comm = round(t_b / t_f, 1), float(f"{hop / t_f:.1g}")
    fit = SIMULATED_ACTIONS // (pp * virtual) // pp * pp
    period = 2 * pp if schedule == _ROUNDS else pp
    m1 = min(microbatches, max(2 * pp + period, fit))
    if microbatches > m1:
        phase = (microbatches - m1) % period
        # interleaved runs whole rounds of p micro-batches: keep m1 one it can build
        m1 += phase - phase % pp if schedule == _ROUNDS else phase
    makespan, inflight = _simulate(schedule, pp, m1, virtual, backward, comm)
    if microbatches > m1:
        before = _simulate(schedule, pp, m1 - period, virtual, backward, comm)[0]
        makespan += (microbatches - m1) * (makespan - before) / period
    makespan *= (1 + t_b / t_f) / (1 + backward)  # undo the rounding: keep layouts ordered
    if schedule in BREADTH_FIRST:  # all micro-batches in flight
        inflight *= microbatches / m1
    bubble = 1 - microbatches * (1 + t_b / t_f) / makespan  # the busy time, unrounded
    return makespan * t_f, bubble, inflight


@lru_cache(maxsize=4096)
def _simulate(schedule: str, pp: int, microbatches: int, virtual: int, backward: float,
              comm: float) -> tuple[float, float]:
    """(makespan in units of t_F, peak micro-batch chunks in flight on the first rank)."""
    timeline = _timeline(schedule, pp, microbatches, virtual, backward, comm)
    return timeline.makespan, float(timeline.peak_inflight(0))


def inflight_of(schedule: str, pp: int, microbatches: int, virtual: int, rank: int) -> int:
    """Most micro-batch chunks pipeline rank ``rank`` holds activations for at once."""
    if pp == 1:
        return 1
    return _step(schedule, pp, microbatches, virtual).peak_inflight(rank)


def accumulating_of(schedule: str, pp: int, microbatches: int, virtual: int,
                    rank: int) -> int:
    """Most stages pipeline rank ``rank`` accumulates weight gradients for at once (all its
    stages, unless the schedule runs each one's backwards before the next one's: interleaved
    1F1B with as many micro-batches as ranks)."""
    if pp == 1:
        return 1
    return _step(schedule, pp, microbatches, virtual).peak_accumulating(rank)


@lru_cache(maxsize=256)
def _step(schedule: str, pp: int, microbatches: int, virtual: int) -> Timeline:
    """The schedule's order of work (a backward twice a forward, no hops): the one
    simulation a planner's search asks of each schedule for memory, however many layouts."""
    return _timeline(schedule, pp, microbatches, virtual, 2.0, 0.0)


def _timeline(schedule: str, pp: int, microbatches: int, virtual: int, backward: float,
              comm: float) -> Timeline:
    """The schedule simulated in units of t_F."""
    built = build(schedule, ranks=pp, microbatches=microbatches,
                  virtual=stages_per_rank(schedule, virtual))
    # the builders' schedules are validated by their own tests: the planner runs thousands
    return simulate(built, Costs(forward=1.0, backward=backward, comm=comm), validated=True)
