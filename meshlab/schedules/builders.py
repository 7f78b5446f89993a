"""The built-in schedules: one builder per schedule, giving torch.distributed.pipelining's order.

``build("1f1b", ranks=4, microbatches=8)`` or ``one_f_one_b(4, 8)`` give a Schedule.

Oracle: torch 2.13's schedule classes, whose ``pipeline_order`` each builder reproduces action
for action (their REDUCE_GRAD/UNSHARD/RESHARD bookkeeping left out, DualPipeV's overlapped
F+B pairs written as the F then the B). ``zb_h1`` is ScheduleInterleavedZeroBubble with one
stage per rank, the handcrafted ZB-H1 of Qi et al. 2023 ("Zero Bubble Pipeline Parallelism");
unlike torch it takes any micro-batch count (torch's rounds check is moot with one stage).
``one_f_one_b`` follows the order Schedule1F1B *executes* (``_step_microbatches``: rank i runs
min(p-i, m) forwards before its first backward), the published 1F1B, because torch's
``Schedule1F1B.pipeline_order`` drops F0 on the last rank.

Idle slots: every grid is time-aligned for unit-time actions. A rank idles (``None``) until
all it needs from other ranks finished in an earlier slot (torch's ``_add_bubbles_to_actions``
rule); the idle slots torch's orders write on purpose (interleaved, looped BFS, ZB-H1, ZBV)
are kept, so with microbatches >= ranks those grids equal torch's slot for slot (with fewer,
torch's grids run an action in the same slot as its input; ours idle a slot more). torch's
GPipe, 1F1B and DualPipeV orders carry no idle slots; ours have those the alignment needs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from meshlab.schedules.actions import Action, Schedule, ScheduleError, contiguous, looped, vshape

Row = list[Action | None]


def gpipe(ranks: int, microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward (fill, then drain)."""
    p, m = _check(ranks, microbatches)
    rows: dict[int, Row] = {}
    for r in range(p):  # all forwards (fill), then all backwards (drain)
        rows[r] = [Action(r, "F", k) for k in range(m)]
        rows[r] += [Action(r, "B", k) for k in range(m)]
    return _finish("gpipe", rows, contiguous(p), m)


def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): rank i holds at most p-i micro-batches in flight."""
    p, m = _check(ranks, microbatches)
    if m < p:
        raise ScheduleError(f"1f1b with ranks={p} needs microbatches >= ranks (torch's "
                            f"Schedule1F1B refuses fewer), got microbatches={m}: pass "
                            f"microbatches={p} or more, or use gpipe")
    rows: dict[int, Row] = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row: Row = [Action(r, "F", k) for k in range(warmup)]  # warm-up: forwards only
        for k in range(m - warmup):  # steady state: one forward, then one backward
            row += [Action(r, "F", warmup + k), Action(r, "B", k)]
        row += [Action(r, "B", k) for k in range(m - warmup, m)]  # cool-down: backwards
        rows[r] = row
    return _finish("1f1b", rows, contiguous(p), m)


def interleaved_1f1b(ranks: int, microbatches: int, *, virtual: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021): ``virtual`` looped stages per rank, depth
    first: micro-batches go through a rank's stages in rounds of ``microbatches // rounds``
    (torch's flexible variant; rounds = max(1, microbatches // ranks))."""
    p, m = _check(ranks, microbatches)
    v, n = _virtual(virtual), _round(m, p, "interleaved_1f1b")
    rows: dict[int, Row] = {}
    for r in range(p):
        fwd, bwd = _depth_first(r, p, m, v, n, "F"), _depth_first(r, p, m, v, n, "B")
        warmup = min((v - 1) * n + 2 * (p - 1 - r), m * v)
        row: Row = [None] * r + fwd[:warmup]  # start staggered, then warm-up forwards
        if warmup:  # wait for the first backward: v*p forwards down, two slots a hop back
            row += [None] * (v * p + 2 * (p - 1 - r) - warmup - r)
        for k in range(m * v - warmup):  # steady state: one forward, then one backward
            row += [fwd[warmup + k], bwd[k]]
        for b in bwd[m * v - warmup:]:  # cool-down: backwards, in step with the 1F1B ranks
            row += [None, b]
        rows[r] = row
    return _finish("interleaved_1f1b", rows, looped(p, v), m)


def looped_bfs(ranks: int, microbatches: int, *, virtual: int) -> Schedule:
    """Looped BFS (Lamy-Poirier 2022): ``virtual`` looped stages per rank, breadth first:
    all micro-batches through one local stage before the next, backwards in reverse."""
    p, m = _check(ranks, microbatches)
    v = _virtual(virtual)
    rows: dict[int, Row] = {}
    for r in range(p):
        mine = range(r, p * v, p)
        rows[r] = ([None] * r  # start staggered
                   + [Action(s, "F", k) for s in mine for k in range(m)]
                   + [None] * (2 * (p - 1 - r))  # wait for the first backward, two slots a hop
                   + [Action(s, "B", k) for s in reversed(mine) for k in reversed(range(m))])
    return _finish("looped_bfs", rows, looped(p, v), m)


def zb_h1(ranks: int, microbatches: int) -> Schedule:
    """ZB-H1 zero bubble: 1F1B with each B split into I (input grads) and W (weight grads);
    rank i defers its Ws by i to fill the cool-down bubble. Forwards-to-I in flight stay at
    1F1B's p-i per rank; counting until W, no rank exceeds 1F1B's peak (p, on rank 0)."""
    p, m = _check(ranks, microbatches)
    rows: dict[int, Row] = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        row: Row = [None] * r + [Action(r, "F", k) for k in range(warmup)]  # warm-up
        row += [None] * (p - 1 - r)  # wait for the first I
        for k in range(m):  # steady state F I (W), then cool-down I (W): W lags I by r
            if warmup + k < m:
                row.append(Action(r, "F", warmup + k))
            row.append(Action(r, "I", k))
            if k >= r:
                row.append(Action(r, "W", k - r))
        row += [Action(r, "W", k) for k in range(max(0, m - r), m)]  # the deferred Ws
        rows[r] = row
    return _finish("zb_h1", rows, contiguous(p), m)


def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZBV zero bubble (Qi et al. 2023, section 6): two stages per rank in a V (rank r holds
    stages r and 2p-1-r), I and W split; zero bubble when t_F = t_I = t_W. Written for at
    least 2p-1 micro-batches; with fewer, the missing ones leave idle slots (as torch)."""
    p, m = _check(ranks, microbatches)
    n = max(2 * p - 1, m)
    rows: dict[int, Row] = {}
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        nxt = _Next()
        row: Row = [None] * r  # start staggered
        row += [nxt(down, "F") for _ in range(2 * (p - r) - 1)]  # warm-up: down the V
        for _ in range(r):  # then alternate up and down
            row += [nxt(up, "F"), nxt(down, "F")]
        for _ in range(p - r):  # first backwards on the way up, W right after I
            row += [nxt(up, "F"), nxt(up, "I"), *nxt.weight(up)]
        while nxt.count[up, "F"] < nxt.count[down, "F"] or nxt.count[down, "F"] < n:
            if nxt.count[down, "F"] < n:  # steady state: F I W down, F I W up
                row.append(nxt(down, "F"))
            row += [nxt(down, "I"), *nxt.weight(down)]
            row += [nxt(up, "F"), nxt(up, "I"), *nxt.weight(up)]
        for _ in range(r):  # cool-down: Is first, Ws deferred
            row += [nxt(down, "I"), nxt(up, "I")]
        for _ in range(p - r):
            row += [nxt(down, "I"), *nxt.weight(down)]
        row += nxt.weights_of(up) + nxt.weights_of(down)  # then the deferred Ws
        rows[r] = [a if a is not None and a.microbatch < m else None for a in row]
    return _finish("zbv", rows, vshape(p), m)


def dualpipev(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V, as torch's ScheduleDualPipeV):
    two stages per rank; in the steady state a forward of one stage runs beside a backward of
    the other (torch overlaps them in one OVERLAP_F_B; here the F, then the B)."""
    p, m = _check(ranks, microbatches)
    if m < 2 * p:
        raise ScheduleError(f"dualpipev with ranks={p} has {2 * p} stages and needs "
                            f"microbatches >= {2 * p} (torch's ScheduleDualPipeV refuses "
                            f"fewer), got microbatches={m}: pass microbatches={2 * p} or more")
    rows: dict[int, Row] = {}
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        nxt = _Next()
        row: Row = [nxt(down, "F") for _ in range(2 * (p - r - 1))]  # warm-up down the V
        for _ in range(r + 1):  # then alternate down and up
            row += [nxt(down, "F"), nxt(up, "F")]
        for _ in range(p - r - 1):  # first backwards on the way up, I then a pending W
            row += [nxt(up, "I"), *nxt.weight(), nxt(up, "F")]
        for _ in range(m - 2 * p + r + 1):  # steady state: F down + B up, F up + B down
            row += [nxt(down, "F"), nxt(up, "B"), nxt(up, "F"), nxt(down, "B")]
        for _ in range(p - r - 1):  # cool-down: B up, F up + B down
            row += [nxt(up, "B"), nxt(up, "F"), nxt(down, "B")]
        split = False  # then backwards only, the second half split into I and W
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            row.append(nxt(up, "I" if split else "B"))
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            row.append(nxt(down, "I" if split else "B"))
        for _ in range(p - r - 1):
            row += [*nxt.weight(), nxt(down, "I" if split else "B")]
        for _ in range(r + 1):  # the Ws still pending
            row += nxt.weight()
        rows[r] = row
    return _finish("dualpipev", rows, vshape(p), m)


BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "looped_bfs": looped_bfs,
    "zb_h1": zb_h1,
    "zbv": zbv,
    "dualpipev": dualpipev,
}
# Facts about the schedules, read by builders, the stepping executor and the planner alike.
TAKES_VIRTUAL = frozenset({"interleaved_1f1b", "looped_bfs"})
"""The schedules that take ``virtual=`` stages per rank."""
V_SHAPED = frozenset({"zbv", "dualpipev"})
"""Two stages per rank in a V (rank r holds stages r and 2p-1-r), whatever ``virtual`` says."""
BREADTH_FIRST = frozenset({"gpipe", "looped_bfs"})
"""Every micro-batch's forward before the first backward: all are in flight at once."""
SPLIT_BACKWARD = frozenset({"zb_h1", "zbv", "dualpipev"})
"""A backward in two halves, the input's then the weights' (zero bubble): the builders' with
a W pass, by name, for a layout (a plan's own schedule is read by its actions)."""


def canonical(name: str) -> str:
    """A schedule's key in BUILDERS (any case, - or _), or a ScheduleError naming them."""
    key = name.strip().lower().replace("-", "_")
    if key not in BUILDERS:
        raise ScheduleError(f"unknown schedule {name!r}: choose one of {', '.join(BUILDERS)}")
    return key


def stages_per_rank(name: str, virtual: int = 1) -> int:
    """Stages each rank holds under schedule ``name`` with ``virtual`` asked for."""
    key = canonical(name)
    return 2 if key in V_SHAPED else virtual if key in TAKES_VIRTUAL else 1


def build(name: str, *, ranks: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule ``name`` (a key of BUILDERS, any case) for ``ranks`` x ``microbatches``;
    ``virtual`` stages per rank for interleaved_1f1b and looped_bfs."""
    key = canonical(name)
    if key in TAKES_VIRTUAL:
        return BUILDERS[key](ranks, microbatches, virtual=virtual)
    check_virtual(key, virtual)
    return BUILDERS[key](ranks, microbatches)


def check_virtual(name: str, virtual: int, *, said: str | None = None) -> None:
    """Refuse ``virtual`` stages per rank on a schedule that places its own (``said``: how
    the caller's user wrote the schedule, for the message)."""
    key = canonical(name)
    fixed = stages_per_rank(key)
    if key in TAKES_VIRTUAL or virtual in (1, fixed):
        return
    per = "1 stage" if fixed == 1 else f"{fixed} stages"
    leave = "virtual=1" + (f" (or {fixed})" if fixed > 1 else "")
    raise ScheduleError(f"{said or key} places {per} per rank, so virtual={virtual} does not "
                        f"apply: leave {leave}, or use {' or '.join(sorted(TAKES_VIRTUAL))} "
                        f"for {virtual} stages per rank")


class _Next:
    """Hands out the next micro-batch of each stage's forwards and backwards (B and I share a
    count) and remembers the W each I leaves owed, oldest first."""

    def __init__(self) -> None:
        self.count: dict[tuple[int, str], int] = defaultdict(int)
        self.owed: list[Action] = []

    def __call__(self, stage: int, kind: str) -> Action:
        key = (stage, "F" if kind == "F" else "B")
        action = Action(stage, kind, self.count[key])
        self.count[key] += 1
        if kind == "I":
            self.owed.append(Action(stage, "W", action.microbatch))
        return action

    def weight(self, stage: int | None = None) -> list[Action]:
        """The oldest owed W (of ``stage``, if given) as a 0- or 1-item list."""
        for w in self.owed:
            if stage is None or w.stage == stage:
                self.owed.remove(w)
                return [w]
        return []

    def weights_of(self, stage: int) -> list[Action]:
        """All Ws still owed for ``stage``."""
        mine = [w for w in self.owed if w.stage == stage]
        self.owed = [w for w in self.owed if w.stage != stage]
        return mine


def _depth_first(rank: int, p: int, m: int, v: int, n: int, kind: str) -> list[Action]:
    """A rank's m*v forwards (or backwards, stages reversed): n micro-batches per stage in
    turn, looping over its v stages, then the next n micro-batches."""
    out = []
    for k in range(m * v):
        local = (k // n) % v
        stage = (local if kind == "F" else v - 1 - local) * p + rank
        out.append(Action(stage, kind, k // (n * v) * n + k % n))
    return out


def _finish(name: str, rows: dict[int, Row], placement: tuple[int, ...], m: int) -> Schedule:
    """Time-align the rows, drop trailing idle slots, and wrap them in a Schedule."""
    aligned = _align(rows, len(placement))
    for row in aligned.values():
        while row and row[-1] is None:
            row.pop()
    return Schedule(aligned, placement, m, name)


def _align(rows: dict[int, Row], stages: int) -> dict[int, Row]:
    """Slot by slot, each rank takes its next action if all it needs finished in an earlier
    slot, else idles; idle slots already in a row are kept."""
    done: set[Action] = set()
    at = dict.fromkeys(rows, 0)
    out: dict[int, Row] = {r: [] for r in rows}
    while any(at[r] < len(rows[r]) for r in rows):
        finished, moved = [], False
        for r, row in rows.items():
            if at[r] == len(row):
                continue
            a = row[at[r]]
            if a is None or _ready(a, done, stages):
                out[r].append(a)
                at[r] += 1
                moved = True
                if a is not None:
                    finished.append(a)
            else:
                out[r].append(None)
        if not moved:
            stuck = {r: str(rows[r][at[r]]) for r in rows if at[r] < len(rows[r])}
            raise ScheduleError(f"builder bug: ranks deadlock at their next actions {stuck}")
        done.update(finished)
    return out


def _ready(a: Action, done: set[Action], stages: int) -> bool:
    # plain tuples: an Action is a NamedTuple, equal to (and hashed as) its fields, and the
    # planner's search asks this about a million times
    s, kind, k = a
    if kind == "F":
        return s == 0 or (s - 1, "F", k) in done
    if kind == "W":
        return (s, "I", k) in done
    if s == stages - 1:
        return (s, "F", k) in done
    return (s + 1, "B", k) in done or (s + 1, "I", k) in done


def _check(ranks: int, microbatches: int) -> tuple[int, int]:
    for what, value in (("ranks", ranks), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{what}={value!r}: pass a whole number >= 1")
    return ranks, microbatches


def _virtual(virtual: int) -> int:
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ScheduleError(f"virtual={virtual!r}: stages per rank must be a whole number "
                            f">= 1 (2 or more to loop)")
    return virtual


def _round(m: int, p: int, name: str) -> int:
    """Micro-batches per round: torch runs max(1, m // p) rounds of equal size."""
    rounds = max(1, m // p)
    if m % rounds:
        fit = min((k for k in range(1, m + p + 1) if k % max(1, k // p) == 0),
                  key=lambda k: abs(k - m))
        raise ScheduleError(f"{name} with ranks={p} runs microbatches // ranks = {rounds} "
                            f"rounds, which must divide microbatches={m} (torch requires it): "
                            f"pass microbatches={fit} (nearest that fits) or any multiple of "
                            f"ranks")
    return m // rounds
