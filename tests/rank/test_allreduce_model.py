"""The planner's alpha-beta model of each all-reduce algorithm, and the crossovers read from
measured points. Pure: no cluster.

The model is checked against the schedules ``meshlab.measure.allreduce`` runs, costed transfer by
transfer with the same per-round cost, so what the planner predicts is the code that runs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import pytest

from meshlab.calibrate.algorithms import AllreduceSweep, crossover_below
from meshlab.calibrate.algorithms import links as round_links
from meshlab.calibrate.collectives import CollectiveFit
from meshlab.measure.allreduce import ALGORITHMS, rounds
from meshlab.plan.allreduce_formulas import (
    ALLREDUCE_ALGORITHMS,
    allreduce_crossover,
    allreduce_rounds,
    allreduce_seconds,
    allreduce_terms,
    round_seconds,
)
from meshlab.plan.estimate import estimate
from meshlab.plan.hardware import HARDWARE, Hardware, Link, load, save
from meshlab.plan.layout import Layout
from meshlab.plan.shapes import ModelShape

# a fast link inside a host, a slow one between hosts; and the other way round, so that
# either side of each round's max is exercised
LINKS = [dict(latency_s=1e-4, bandwidth_bytes_s=5e9, inter_latency_s=2e-3,
              inter_bandwidth_bytes_s=1e8),
         dict(latency_s=3e-4, bandwidth_bytes_s=1e8, inter_latency_s=1e-4,
              inter_bandwidth_bytes_s=7e8)]
SPLITS = [(p, k) for p in range(2, 10) for k in sorted({1, 2, 3, 4, p}) if k <= p]


def schedule_seconds(algorithm: str, p: int, k: int, nbytes: float, links: dict) -> float:
    """The rounds meshlab.measure.allreduce runs, each costed from its transfers: the bytes
    each rank sends and receives inside its host, and that leave and enter each host."""
    hosts = [r // k for r in range(p)]
    total = 0.0
    for step in rounds(algorithm, p, hosts):
        rank: dict[tuple[str, int], float] = defaultdict(float)
        host: dict[tuple[str, int], float] = defaultdict(float)
        for t in step.transfers:
            if t.crosses(hosts):
                host["out", hosts[t.src]] += t.fraction * nbytes
                host["in", hosts[t.dst]] += t.fraction * nbytes
            else:
                rank["out", t.src] += t.fraction * nbytes
                rank["in", t.dst] += t.fraction * nbytes
        total += round_seconds(bool(host), max(rank.values(), default=0.0),
                               max(host.values(), default=0.0), **links)
    return total


def test_the_planner_costs_the_same_algorithms_the_ranks_run() -> None:
    assert ALLREDUCE_ALGORITHMS == ALGORITHMS


@pytest.mark.parametrize("p, k", SPLITS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_closed_form_equals_the_schedule_costed_transfer_by_transfer(algorithm: str, p: int,
                                                                    k: int) -> None:
    if algorithm == "hierarchical" and p % k:
        with pytest.raises(ValueError, match="same ranks on every host"):
            allreduce_rounds(algorithm, p, k)
        return
    for links in LINKS:
        want = schedule_seconds(algorithm, p, k, 3 * 2**20, links)
        got = allreduce_seconds(algorithm, p, 3 * 2**20, ranks_per_host=k, **links)
        assert got == pytest.approx(want, rel=1e-12), (algorithm, p, k, links)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 7, 8, 16, 1000, 16384])
def test_on_one_host_each_algorithm_is_its_textbook_cost(p: int) -> None:
    a, beta = 1e-5, 1e-9  # alpha s, beta s/byte
    n = 1e6
    q = 1 << (p.bit_length() - 1)  # the largest power of two in p
    textbook = {
        "ring": 2 * (p - 1) * a + 2 * (p - 1) / p * n * beta,
        "halving_doubling": (2 * math.log2(q) * a + 2 * (q - 1) / q * n * beta if p == q else
                             (2 * math.log2(q) + 2) * a + (2 + 2 * (q - 1) / q) * n * beta),
        "tree": 2 * math.ceil(math.log2(p)) * (a + n * beta),
        "hierarchical": 2 * (p - 1) * a + 2 * (p - 1) / p * n * beta,  # one host: a ring
    }
    for algorithm, seconds in textbook.items():
        got = allreduce_seconds(algorithm, p, n, latency_s=a, bandwidth_bytes_s=1 / beta)
        assert got == pytest.approx(seconds, rel=1e-12), algorithm
        # Chan et al. 2007's lower bound holds for every algorithm
        assert got >= math.ceil(math.log2(p)) * a + 2 * (p - 1) / p * n * beta * (1 - 1e-12)


def test_sixteen_thousand_ranks_on_eight_per_host_cost_in_closed_form() -> None:
    links = LINKS[0]
    for algorithm in ALGORITHMS:
        kinds = allreduce_rounds(algorithm, 16384, 8)
        assert len(kinds) <= 2 * 14  # a few kinds of round, not 16,384 rounds walked
        assert allreduce_seconds(algorithm, 16384, 2**30, ranks_per_host=8, **links) > 0
    # ring pays 2(p-1) inter latencies; halving-doubling 2 log2 p, of which 3 x 2 inside a host
    fixed = {a: allreduce_terms(a, 16384, ranks_per_host=8, **links)[0] for a in ALGORITHMS}
    assert fixed["ring"] == pytest.approx(2 * 16383 * 2e-3)
    assert fixed["halving_doubling"] == pytest.approx(6 * 1e-4 + 22 * 2e-3)


def test_across_hosts_hierarchical_moves_fewer_bytes_over_the_host_link_than_ring() -> None:
    # 2 hosts x 2 ranks, links as fast inside a host as you like: ring sends 3/2 of the buffer
    # out of each host, hierarchical and halving-doubling 1, tree 2 (whole buffer, twice)
    slow = dict(latency_s=0.0, bandwidth_bytes_s=1e15, inter_latency_s=0.0,
                inter_bandwidth_bytes_s=1.0)
    per_byte = {a: allreduce_terms(a, 4, ranks_per_host=2, **slow)[1] for a in ALGORITHMS}
    assert per_byte == pytest.approx({"ring": 1.5, "halving_doubling": 1.0, "tree": 2.0,
                                      "hierarchical": 1.0}, rel=1e-9)


def test_crossover_is_where_ring_and_the_algorithm_take_equal_time() -> None:
    links = dict(latency_s=3e-4, bandwidth_bytes_s=1e9, inter_latency_s=1.5e-3,
                 inter_bandwidth_bytes_s=1.2e8)
    cross = allreduce_crossover(4, ranks_per_host=2, **links)
    assert cross["halving_doubling"] == cross["hierarchical"] == math.inf
    x = cross["tree"]
    ring, tree = (allreduce_seconds(a, 4, x, ranks_per_host=2, **links) for a in ("ring", "tree"))
    assert tree == pytest.approx(ring, rel=1e-12)
    assert (allreduce_seconds("tree", 4, x / 2, ranks_per_host=2, **links)
            < allreduce_seconds("ring", 4, x / 2, ranks_per_host=2, **links))
    # hosts of 3 cannot hold 4 ranks evenly: no hierarchical crossover to give
    assert "hierarchical" not in allreduce_crossover(4, ranks_per_host=3, **links)


def test_unknown_algorithm_and_bad_links_name_the_fix() -> None:
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'butterfly': use one of "
                                         "ring, halving_doubling, tree, hierarchical"):
        allreduce_seconds("butterfly", 4, 1.0, latency_s=0, bandwidth_bytes_s=1)
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        allreduce_seconds("ring", 4, 1.0, latency_s=0, bandwidth_bytes_s=0)


# -- the planner -------------------------------------------------------------------------------

TINY = ModelShape(name="tiny", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256,
                  seq_len=64)
GRADIENTS = 2 * 106_816  # bf16 gradients of TINY: one all-reduce of 213,632 bytes
# nodes of 2 ranks: a fast link inside, a slow one between
TOY = Hardware(name="toy", tflops={"bf16": 1.0, "fp32": 0.5}, memory_gib=1.0,
               memory_bandwidth_gbs=1.0, gpus_per_node=2,
               intra=Link(bandwidth_gbs=100.0, latency_us=5.0),
               inter=Link(bandwidth_gbs=1.0, latency_us=500.0))
TOY_LINKS = dict(latency_s=5e-6, bandwidth_bytes_s=1e11, inter_latency_s=5e-4,
                 inter_bandwidth_bytes_s=1e9)


def gradient_all_reduce(hw: Hardware, dp: int) -> tuple[str, float]:
    (ar,) = estimate(TINY, Layout(dp_shard=dp, zero=0), hw).collectives
    assert ar.nbytes == GRADIENTS and ar.calls == 1
    return ar.algorithm, ar.seconds


def test_without_a_measured_crossover_the_planner_costs_a_ring_as_before() -> None:
    algorithm, seconds = gradient_all_reduce(TOY, 4)
    assert algorithm == "ring"  # across the 2 nodes: the inter link, 6 hops
    assert seconds == pytest.approx(6 * 500e-6 + 1.5 * GRADIENTS / 1e9, rel=1e-12)


def test_below_a_measured_crossover_the_planner_costs_that_algorithm_on_the_nodes() -> None:
    hw = replace(TOY, allreduce_crossover_bytes={"tree": 2 * GRADIENTS})
    algorithm, seconds = gradient_all_reduce(hw, 4)
    assert algorithm == "tree"
    assert seconds == pytest.approx(allreduce_seconds("tree", 4, GRADIENTS, ranks_per_host=2,
                                                      **TOY_LINKS), rel=1e-12)
    # inside one node: one host, the intra link only
    algorithm, seconds = gradient_all_reduce(hw, 2)
    assert algorithm == "tree"
    assert seconds == pytest.approx(allreduce_seconds("tree", 2, GRADIENTS, latency_s=5e-6,
                                                      bandwidth_bytes_s=1e11), rel=1e-12)


def test_above_every_measured_crossover_the_planner_costs_a_ring() -> None:
    hw = replace(TOY, allreduce_crossover_bytes={"tree": GRADIENTS / 2})
    assert gradient_all_reduce(hw, 4) == gradient_all_reduce(TOY, 4)


def test_where_several_algorithms_beat_ring_the_planner_takes_the_fastest_modelled() -> None:
    hw = replace(TOY, allreduce_crossover_bytes={"tree": 1e9, "halving_doubling": 1e9,
                                                 "hierarchical": 1e9})
    models = {a: allreduce_seconds(a, 4, GRADIENTS, ranks_per_host=2, **TOY_LINKS)
              for a in ("tree", "halving_doubling", "hierarchical")}
    algorithm, seconds = gradient_all_reduce(hw, 4)
    assert seconds == min(models.values()) and models[algorithm] == seconds


# -- measured crossovers -----------------------------------------------------------------------


def test_measured_crossover_interpolates_in_log_size_between_the_points_around_it() -> None:
    sizes = [1024, 4096, 16384]
    # ring / other: 2 (other faster), then 1/2 (ring faster): equal halfway in log size
    assert crossover_below(sizes, [2.0, 2.0, 8.0], [1.0, 4.0, 9.0]) == pytest.approx(2048)
    assert crossover_below(sizes, [1.0, 1.0, 1.0], [0.5, 0.5, 0.5]) is None  # never crosses
    assert crossover_below(sizes, [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]) is None
    assert crossover_below(sizes, [1.0, 1.0, 1.0], [2.0, 0.5, 0.5]) is None  # the other way


def sweep(**seconds: list[float]) -> AllreduceSweep:
    return AllreduceSweep(ranks=4, hosts=[0, 0, 1, 1], backend="gloo",
                          nbytes=[4096, 65536, 2**20], seconds=seconds)


def test_sweep_says_which_algorithm_beats_ring_where_measured_and_modelled() -> None:
    s = sweep(ring=[4.0, 5.0, 6.0], halving_doubling=[1.0, 2.0, 3.0], tree=[2.0, 6.0, 12.0],
              hierarchical=[5.0, 6.0, 7.0], gloo=[3.0, 3.0, 3.0])
    s.predict(Link(latency_us=300, bandwidth_gbs=1.0), Link(latency_us=1500, bandwidth_gbs=0.12))
    assert s.fastest() == ["halving_doubling", "halving_doubling", "halving_doubling"]
    measured = s.measured()
    assert measured["halving_doubling"] is None and measured["hierarchical"] is None
    assert 4096 < measured["tree"] < 65536
    lines = s.lines()
    assert lines[0] == "halving_doubling beats ring at every size measured (4 KiB to 1 MiB); " \
                       "model: halving_doubling beats ring at every size"
    assert lines[1].startswith("tree beats ring below ") and "KiB (measured), " in lines[1]
    assert lines[1].endswith(" KiB (model)")
    assert lines[2] == "ring beats hierarchical at every size measured; model: hierarchical " \
                       "beats ring at every size"
    # the profile keeps measured crossovers, and the largest size where one won throughout
    assert s.profile_crossovers() == {"halving_doubling": 2**20, "tree": measured["tree"]}


def fit(axis: str, collective: str, alpha_s: float, beta_s_per_byte: float) -> CollectiveFit:
    return CollectiveFit(axis=axis, ranks=2, groups=[[0, 1]], collective=collective,
                         nbytes=[4096, 2**20], seconds=[1.0, 2.0], alpha_s=alpha_s,
                         beta_s_per_byte=beta_s_per_byte, residual=0.0)


def test_a_round_waits_for_a_hop_and_moves_bytes_at_the_all_reduce_bandwidth() -> None:
    fits = [fit("tp", "all_reduce", 5e-5, 1e-9), fit("tp", "send_recv", 4e-4, 3e-9),
            fit("world", "all_reduce", 2e-4, 1e-8), fit("world", "send_recv", 9e-4, 5e-8)]
    intra, inter = round_links(fits, "tp", "world")
    # latency: half a ping-pong, not the all-reduce's ring step; bandwidth: the bus bandwidth
    assert intra.latency_us == pytest.approx(400) and inter.latency_us == pytest.approx(900)
    assert intra.bandwidth_gbs == pytest.approx(fits[0].bandwidth_gbs)
    assert inter.bandwidth_gbs == pytest.approx(fits[2].bandwidth_gbs)


def test_a_sweep_takes_the_latency_across_hosts_from_its_own_ping_pong() -> None:
    s = sweep(ring=[4.0, 5.0, 6.0], halving_doubling=[1.0, 2.0, 3.0], tree=[2.0, 6.0, 12.0],
              hierarchical=[5.0, 6.0, 7.0], gloo=[3.0, 3.0, 3.0])
    s.hop = fit("hosts", "send_recv", 2e-3, 2e-8)
    s.predict(Link(latency_us=300, bandwidth_gbs=1.0), Link(latency_us=1500, bandwidth_gbs=0.12))
    assert s.model == allreduce_crossover(4, latency_s=3e-4, bandwidth_bytes_s=1e9,
                                          ranks_per_host=2, inter_latency_s=2e-3,
                                          inter_bandwidth_bytes_s=1.2e8)


def test_profile_keeps_the_measured_crossover_through_its_file(tmp_path) -> None:
    hw = replace(HARDWARE["cpu"], allreduce_crossover_bytes={"tree": 123456.5})
    assert load(save(hw, tmp_path / "x.toml")) == hw
    plain = load(save(HARDWARE["cpu"], tmp_path / "old.toml"))
    assert plain.allreduce_crossover_bytes == {}
    assert "allreduce_crossover" not in (tmp_path / "old.toml").read_text()
    with pytest.raises(ValueError, match="unknown all-reduce algorithms"):
        replace(hw, allreduce_crossover_bytes={"butterfly": 1.0})


def test_halving_doubling_sends_2_p_minus_1_over_p_only_at_powers_of_two() -> None:
    # the fold for other p: the odd member of each folded pair sends its share and the result
    from meshlab.measure.allreduce import rounds

    def sent(p: int) -> list[float]:
        steps = rounds("halving_doubling", p)
        return [sum(step.sent_by(m) for step in steps) for m in range(p)]

    for p in (2, 4, 8):
        assert sent(p) == pytest.approx([2 * (p - 1) / p] * p)
    assert sent(3) == pytest.approx([1.0, 2.0, 1.0])
    assert max(sent(6)) == pytest.approx(2.5)
