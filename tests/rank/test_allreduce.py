"""All-reduce algorithms on send/recv: the schedules as data (simulated on plain lists), and
run on 4 real gloo ranks, equal to ``dist.all_reduce`` (float64: exactly on integer values,
to 1e-12 on random ones)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from meshlab import Cluster
from meshlab.measure.allreduce import ALGORITHMS, Round, rounds
from meshlab.measure.comms import CommRecord


def _hosts(p: int) -> list[int] | None:
    """Equal hosts for p members: two when p is even, else none given (one host)."""
    return [m * 2 // p for m in range(p)] if p % 2 == 0 and p > 2 else None


def _simulate(schedule: list[Round], p: int) -> list[list[Counter[int]]]:
    """Walk the rounds on lists: member m's chunk c starts as {m: 1}; a round's sends read
    the chunks as the round began, then receivers add or copy."""
    chunks = schedule[0].transfers[0].chunks if schedule else 1
    held = [[Counter({m: 1}) for _ in range(chunks)] for m in range(p)]
    for step in schedule:
        sent = [(t, [Counter(held[t.src][c]) for c in range(t.start, t.stop)])
                for t in step.transfers]
        for t, values in sent:
            for c, value in zip(range(t.start, t.stop), values, strict=True):
                held[t.dst][c] = held[t.dst][c] + value if t.reduce else value
    return held


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("p", range(1, 10))
def test_simulated_rounds_leave_every_member_with_the_sum(algorithm: str, p: int) -> None:
    schedule = rounds(algorithm, p, _hosts(p) if algorithm == "hierarchical" else None)
    everyone = Counter(range(p))
    for m, chunks in enumerate(_simulate(schedule, p)):
        assert all(c == everyone for c in chunks), f"member {m}: {chunks}"


def test_hierarchical_on_hosts_of_two_is_simulated_exactly() -> None:
    for hosts in ([0, 0, 1, 1], [0, 1, 0, 1], [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]):
        held = _simulate(rounds("hierarchical", len(hosts), hosts), len(hosts))
        assert all(c == Counter(range(len(hosts))) for chunks in held for c in chunks), hosts


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_ring_takes_2_p_minus_1_rounds(p: int) -> None:
    assert len(rounds("ring", p)) == 2 * (p - 1)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_halving_doubling_takes_2_log2_p_rounds(p: int) -> None:
    assert len(rounds("halving_doubling", p)) == 2 * int(math.log2(p))


def test_non_power_of_two_halving_doubling_adds_a_fold_and_an_unfold() -> None:
    assert [len(rounds("halving_doubling", p)) for p in (3, 5, 6, 7)] == [4, 6, 6, 6]


def test_tree_takes_2_ceil_log2_p_rounds_of_the_whole_buffer() -> None:
    for p in range(2, 10):
        schedule = rounds("tree", p)
        assert len(schedule) == 2 * math.ceil(math.log2(p))
        assert all(t.fraction == 1 for r in schedule for t in r.transfers)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_bandwidth_optimal_algorithms_send_2_p_minus_1_over_p(algorithm: str, p: int) -> None:
    schedule = rounds(algorithm, p)
    for m in range(p):
        assert sum(r.sent_by(m) for r in schedule) == pytest.approx(2 * (p - 1) / p)


def test_hierarchical_crosses_hosts_only_in_its_middle_rounds() -> None:
    hosts = [0, 0, 1, 1]
    schedule = rounds("hierarchical", 4, hosts)
    crossing = [any(t.crosses(hosts) for t in r.transfers) for r in schedule]
    assert crossing == [False, True, True, False]  # 2(L-1) inside, 2(H-1) across
    assert [r.leaving(hosts, 0) for r in schedule] == [0, 2, 2, 0]


def test_hierarchical_on_one_host_or_one_rank_per_host_is_a_ring() -> None:
    assert rounds("hierarchical", 4, [0, 0, 0, 0]) == rounds("ring", 4)
    assert rounds("hierarchical", 4, [0, 1, 2, 3]) == rounds("ring", 4)


def test_unknown_algorithm_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'rings'.*ring, halving_doubling, tree, hierarchical"):
        rounds("rings", 4)


def test_hierarchical_refuses_hosts_of_unequal_size_naming_the_counts() -> None:
    with pytest.raises(ValueError, match=r"\{0: 3, 1: 1\}.*as many ranks from each host"):
        rounds("hierarchical", 4, [0, 0, 0, 1])


def test_comms_table_names_the_algorithm_of_a_send() -> None:
    from meshlab.notebook.tables.comms import comms_frame

    records = [CommRecord("send", [0, 1], 8, 8, algorithm="tree"),
               CommRecord("all_reduce", [0, 1], 8, 8, algorithm="gloo")]
    assert set(comms_frame({0: records}, None, 2)["op"]) == {"send (tree)", "all_reduce"}


CELL = """
from meshlab.measure.allreduce import ALGORITHMS, all_reduce
from meshlab.measure.comms import CommTracer

three = dist.new_group([0, 1, 2])
groups = {"world": None, "tp": mesh["tp"].get_group(), "dp": mesh["dp"].get_group()}
if rank < 3:
    groups["0-2"] = three
out = {"int": [], "random": [], "hosts": None, "unequal": "", "tree": None, "plain": None,
       "strided": None, "cases": 0}
for name, group in groups.items():
    for n in (1, 7, 1000):
        gen = torch.Generator().manual_seed(1000 * rank + n)
        ints = torch.randint(-1000, 1000, (n,), generator=gen).double()
        values = torch.randn(n, generator=gen, dtype=torch.float64)
        want_ints, want = ints.clone(), values.clone()
        dist.all_reduce(want_ints, group=group)
        dist.all_reduce(want, group=group)
        for algorithm in ALGORITHMS:
            out["cases"] += 1
            if not torch.equal(all_reduce(ints.clone(), group, algorithm=algorithm), want_ints):
                out["int"].append((name, n, algorithm))
            error = (all_reduce(values.clone(), group, algorithm=algorithm) - want).abs().max()
            if error > 1e-12:
                out["random"].append((name, n, algorithm, float(error)))
x = torch.arange(12.0, dtype=torch.float64).reshape(3, 4) * (rank + 1)
want = x.clone(); dist.all_reduce(want)
out["hosts"] = torch.equal(all_reduce(x.clone(), algorithm="hierarchical", hosts=[0, 0, 1, 1]),
                           want)
strided = x.t()  # not contiguous: summed through a copy, written back in place
out["strided"] = torch.equal(all_reduce(strided, algorithm="halving_doubling"), want.t()) \\
    and torch.equal(x, want)
try:
    all_reduce(x.clone(), algorithm="hierarchical", hosts=[0, 0, 0, 1])
except ValueError as e:
    out["unequal"] = str(e)
with CommTracer() as tracer:
    all_reduce(torch.ones(8), algorithm="tree")
out["tree"] = sorted({(r.op, r.algorithm) for r in tracer.records})
with CommTracer() as tracer:
    dist.all_reduce(torch.ones(8))
out["plain"] = [(r.op, r.algorithm) for r in tracer.records]
out
"""


@pytest.fixture(scope="module")
def results(module_cluster: Cluster) -> dict[int, Any]:
    """Every case run once on the 4 ranks: {rank: what the cell found}."""
    cluster = module_cluster
    cluster.init_mesh("dp=2 tp=2")
    return dict(cluster.run(CELL, keep_values=True, timeout=120).values)


@pytest.mark.cluster
def test_every_algorithm_sums_integers_exactly_as_dist_all_reduce(
        results: dict[int, Any]) -> None:
    assert {r: v["int"] for r, v in results.items()} == {r: [] for r in range(4)}
    # world, tp and dp for every rank, the 3-rank group on ranks 0-2: 3 sizes, 4 algorithms
    assert [v["cases"] for _, v in sorted(results.items())] == [48, 48, 48, 36]


@pytest.mark.cluster
def test_every_algorithm_sums_random_float64_within_1e_12(results: dict[int, Any]) -> None:
    assert {r: v["random"] for r, v in results.items()} == {r: [] for r in range(4)}


@pytest.mark.cluster
def test_hierarchical_on_two_given_hosts_equals_dist_all_reduce(
        results: dict[int, Any]) -> None:
    assert all(v["hosts"] for v in results.values())


@pytest.mark.cluster
def test_a_strided_tensor_is_summed_in_place(results: dict[int, Any]) -> None:
    assert all(v["strided"] for v in results.values())


@pytest.mark.cluster
def test_hierarchical_refuses_unequal_hosts_on_the_ranks(results: dict[int, Any]) -> None:
    assert "{0: 3, 1: 1}" in results[0]["unequal"] and "another algorithm" in results[0]["unequal"]


@pytest.mark.cluster
def test_the_tracer_names_the_algorithm_or_the_backend(results: dict[int, Any]) -> None:
    for value in results.values():
        assert value["tree"] and {algorithm for _, algorithm in value["tree"]} == {"tree"}
        assert {op for op, _ in value["tree"]} <= {"send", "recv"}
        assert value["plain"] == [("all_reduce", "gloo")]
