"""The planner's offloading, gradient accumulation and local SGD / DiLoCo options, by hand.

The same tiny model and round-number hardware as test_plan.py; every expected value is
worked out here from the bytes each option moves or keeps, never by calling the code under
test.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshlab.plan import Layout, estimate, search
from meshlab.plan.hardware import HARDWARE, Link
from meshlab.plan.report import plan
from meshlab.plan.search import parse_constraints
from tests.rank.test_plan import COMPUTE_BOUND, TINY, TINY_MICROBATCH_S, TINY_PARAMS, TOY

LAYER = 36_992  # TINY's parameters per layer (test_plan.py counts them)
# TOY with host figures round enough to work with: 1 GB/s each way over PCIe
HOST = dataclasses.replace(COMPUTE_BOUND, pcie_gbs=1.0, host_memory_gib=1.0,
                           host_memory_bandwidth_gbs=2.0)


def test_the_options_parse_describe_and_round_trip() -> None:
    text = "dp_replicate=2 dp=4 zero=3 grad_accum=4 offload_params=1 offload_activations=1 " \
           "replica_sync=diloco sync_every=50"
    layout = Layout.parse(text)
    assert (layout.microbatches, layout.offload_params, layout.sync_every) == (4, True, 50)
    assert Layout.parse(layout.describe()) == layout


@pytest.mark.parametrize("text, match", [
    ("dp=4 zero=1 offload_params=1", r"offload_params with zero=1: .* use zero=2 or zero=3"),
    ("dp=4 replica_sync=diloco", r"and this layout has none: give dp_replicate=2 or more"),
    ("dp_replicate=2 sync_every=8", r"sync_every=8 needs "
                                    r"replica_sync=local_sgd/diloco/edit/a_edit"),
    ("dp_replicate=2 replica_sync=diloco staleness=2",
     r"staleness=2 applies to replica_sync=parameter_server only"),
    ("dp_replicate=2 pp=2 replica_sync=local_sgd", r"with pp or ep is not verified .* pp=1"),
    ("dp_replicate=2 replica_sync=sometimes", r"replica_sync must be one of every_step, "
                                              r"local_sgd, diloco"),
    ("dp_replicate=2 replica_sync=diloco sync_every=0", r"sync_every must be >= 1"),
])
def test_bad_options_name_the_fix(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Layout.parse(text)


# -- offloading ------------------------------------------------------------------------------


@pytest.mark.parametrize("zero", [2, 3])
def test_offloaded_states_move_to_the_host_byte_for_byte(zero: int) -> None:
    kept = estimate(TINY, Layout(dp_shard=4, zero=zero), HOST).memory
    moved = estimate(TINY, Layout(dp_shard=4, zero=zero, offload_params=True), HOST).memory
    # bf16: 2-byte parameter shards, 2-byte gradient shards, 12 bytes of optimizer state
    assert moved["host"] == pytest.approx((2 + 2 + 12) * TINY_PARAMS / 4)
    assert (moved["grads"], moved["optimizer"]) == (0, 0)
    # ZeRO-2 keeps its gathered parameters on the device all step; ZeRO-3 only the units
    # it gathers (the buffers, unchanged)
    assert moved["params"] == (2 * TINY_PARAMS if zero == 2 else 0)
    assert moved["buffers"] == kept["buffers"] and kept["host"] == 0


def test_offloading_copies_shards_over_pcie_every_gather() -> None:
    e = estimate(TINY, Layout(dp_shard=4, zero=3, microbatches=2, offload_params=True), HOST)
    copies = {c.what: c for c in e.collectives if c.collective == "copy"}
    up = copies["offload: parameter shards to the device"]
    down = copies["offload: gradient shards to the host"]
    # ZeRO-3 gathers every layer forward and backward of each of 2 micro-batches: the
    # 53,408-byte parameter shard crosses 4 times; each micro-batch's reduce-scatter sends
    # the gradient shard down: twice
    assert up.nbytes * up.calls == pytest.approx(4 * 2 * TINY_PARAMS / 4)
    assert down.nbytes * down.calls == pytest.approx(2 * 2 * TINY_PARAMS / 4)
    assert up.seconds == pytest.approx(4 * 53_408 / 1e9)


def test_slow_pcie_is_named_as_the_bottleneck() -> None:
    layout = Layout(dp_shard=4, zero=3, offload_params=True)
    fast = estimate(TINY, layout, dataclasses.replace(HOST, pcie_gbs=1e6))
    slow = estimate(TINY, layout, HOST)
    assert not any("bottleneck" in n for n in fast.notes)
    (note,) = [n for n in slow.notes if "bottleneck" in n]
    assert "the PCIe link is the bottleneck" in note
    # the shard goes up twice (forward and backward gathers): 106,816 bytes at 1 GB/s,
    # 107 us against the micro-batch's 77 us of compute; the rest shows in the step
    assert slow.compute_s == pytest.approx(TINY_MICROBATCH_S)
    assert slow.step_s - fast.step_s == pytest.approx(2 * 53_408 / 1e9 - TINY_MICROBATCH_S,
                                                      rel=1e-6)


def test_cpu_ranks_copy_nothing_to_offload() -> None:
    # their host memory is the device's: the states still count as offloaded, the step pays
    # no copies
    cpu = dataclasses.replace(HOST, asynchronous=False)
    layout = Layout(dp_shard=4, zero=3, offload_params=True, offload_activations=True)
    e = estimate(TINY, layout, cpu)
    assert e.memory["host"] > 0 and not [c for c in e.collectives if c.collective == "copy"]


def test_host_memory_decides_whether_an_offloaded_layout_fits() -> None:
    layout = Layout(dp_shard=4, zero=3, offload_params=True)
    assert estimate(TINY, layout, HOST).fits
    tiny_host = dataclasses.replace(HOST, host_memory_gib=1e-4)  # 107 KB: the states need 427
    e = estimate(TINY, layout, tiny_host)
    assert not e.fits and any("of host memory per GPU" in n for n in e.notes)


def test_the_offloaded_optimizer_steps_at_the_host_s_memory_bandwidth() -> None:
    kept = estimate(TINY, Layout(dp_shard=4, zero=3), HOST).optimizer_s
    moved = estimate(TINY, Layout(dp_shard=4, zero=3, offload_params=True), HOST).optimizer_s
    # 80 bytes per parameter of the shard, at 1e6 GB/s on the device, 2 GB/s on the host
    assert (kept, moved) == pytest.approx((TINY_PARAMS / 4 * 80 / 1e15,
                                           TINY_PARAMS / 4 * 80 / 2e9))


def test_offloaded_activations_leave_two_layers_on_the_device() -> None:
    kept = estimate(TINY, Layout(), HOST).memory
    moved = estimate(TINY, Layout(offload_activations=True), HOST).memory
    # TINY keeps 1,664 bytes a token a layer (test_plan's hand count); 64 tokens, 2 layers:
    # both are the two the device keeps, so nothing moves; with 8 layers, 6 move
    assert moved == kept
    deep = dataclasses.replace(TINY, layers=8)
    kept8 = estimate(deep, Layout(), HOST).memory
    moved8 = estimate(deep, Layout(offload_activations=True), HOST).memory
    assert moved8["host"] == 6 * 1664 * 64
    assert kept8["activations"] - moved8["activations"] == 6 * 1664 * 64


# -- gradient accumulation -------------------------------------------------------------------


def test_grad_accum_is_micro_batches_with_one_gradient_reduction() -> None:
    e = estimate(TINY, Layout.parse("dp=4 zero=0 grad_accum=4"), COMPUTE_BOUND)
    (ar,) = e.collectives
    assert (ar.what, ar.calls) == ("gradient all-reduce", 1)
    assert e.layout.global_batch == 4 * 4
    assert e.step_s == pytest.approx(4 * TINY_MICROBATCH_S + ar.seconds + e.optimizer_s)


# -- local SGD and DiLoCo --------------------------------------------------------------------


def replica_bytes(layout: Layout) -> float:
    """Bytes per step that cross the dp_replicate axis."""
    e = estimate(TINY, layout, TOY)
    return sum(c.nbytes * c.calls for c in e.collectives if c.axis == "dp_replicate")


def test_replicas_exchange_their_fp32_shard_once_every_h_steps() -> None:
    hsdp = replica_bytes(Layout(dp_replicate=2, dp_shard=4, zero=3))
    every = {h: replica_bytes(Layout(dp_replicate=2, dp_shard=4, zero=3,
                                     replica_sync="diloco", sync_every=h)) for h in (1, 4, 100)}
    assert hsdp == 2 * TINY_PARAMS / 4  # HSDP: the bf16 gradient shard, every step
    # DiLoCo: the fp32 pseudo-gradient shard, every H steps
    assert every == pytest.approx({h: 4 * TINY_PARAMS / 4 / h for h in (1, 4, 100)})


def test_local_sgd_over_ddp_reduces_gradients_inside_the_replica_only() -> None:
    e = estimate(TINY, Layout(dp_replicate=2, dp_shard=4, zero=0, replica_sync="local_sgd",
                              sync_every=8), TOY)
    inside = [c for c in e.collectives if c.what == "gradient all-reduce"]
    assert [(c.axis, c.ranks, c.calls) for c in inside] == [("dp_shard", 4, 1)]
    (sync,) = [c for c in e.collectives if c.axis == "dp_replicate"]
    assert (sync.ranks, sync.nbytes, sync.calls, sync.overlapped) == (
        2, 4 * TINY_PARAMS, 1 / 8, False)  # DDP: every rank holds all parameters


def test_diloco_keeps_the_synchronised_parameters_and_the_outer_momentum() -> None:
    plain = estimate(TINY, Layout(dp_replicate=2, dp_shard=4, zero=3), TOY).memory
    diloco = estimate(TINY, Layout(dp_replicate=2, dp_shard=4, zero=3, replica_sync="diloco",
                                   sync_every=10), TOY).memory
    local = estimate(TINY, Layout(dp_replicate=2, dp_shard=4, zero=3,
                                  replica_sync="local_sgd", sync_every=10), TOY).memory
    assert diloco["optimizer"] - plain["optimizer"] == pytest.approx(8 * TINY_PARAMS / 4)
    assert local["optimizer"] == plain["optimizer"]


def test_edit_moves_diloco_bytes_behind_the_next_forward() -> None:
    # EDiT's sync is DiLoCo's all-reduce run block by block inside a forward: the same bytes,
    # and on hardware that overlaps, less of it exposed
    lay = {mode: Layout(dp_replicate=2, dp_shard=4, zero=3, replica_sync=mode, sync_every=4)
           for mode in ("diloco", "edit", "a_edit")}
    assert replica_bytes(lay["edit"]) == replica_bytes(lay["diloco"]) == replica_bytes(
        lay["a_edit"])
    sync = {m: [c for c in estimate(TINY, lay[m], HARDWARE["h100-sxm"]).collectives
                if c.axis == "dp_replicate"] for m in lay}
    assert [c.overlapped for c in sync["diloco"] + sync["edit"]] == [False, True]
    exposed = {m: estimate(TINY, lay[m], HARDWARE["h100-sxm"]).exposed_by_axis["dp_replicate"]
               for m in lay}
    assert exposed["edit"] < exposed["diloco"]


def test_parameter_servers_move_an_all_reduce_worth_and_hold_a_share_of_the_states() -> None:
    plain = estimate(TINY, Layout(dp_replicate=4, dp_shard=2, zero=3), TOY).memory
    ps = {s: Layout(dp_replicate=4, dp_shard=2, zero=3, replica_sync="parameter_server",
                    staleness=s) for s in (0, 2)}
    shard = TINY_PARAMS / 2
    # each worker pushes (R-1)/R of its fp32 gradient shard and pulls as much back: the
    # all-to-all convention counts what one rank holds
    assert replica_bytes(ps[0]) == pytest.approx(2 * 4 * shard)
    memory = estimate(TINY, ps[0], TOY).memory
    assert memory["optimizer"] == pytest.approx(plain["optimizer"] / 4 + 4 * shard)
    hidden = {s: [c.overlapped for c in estimate(TINY, lay, TOY).collectives
                  if c.axis == "dp_replicate"] for s, lay in ps.items()}
    assert hidden == {0: [False, False], 2: [True, True]}  # staleness 0 waits every step


def test_search_keeps_the_options_a_constraint_names() -> None:
    assert parse_constraints("replica_sync=diloco sync_every=100 offload_params=1") == {
        "replica_sync": ("=", "diloco"), "sync_every": ("=", 100), "offload_params": ("=", True)}
    with pytest.raises(ValueError, match=r"offload_params takes = only"):
        parse_constraints("offload_params>=1")
    found = search(TINY, gpus=16, hardware=TOY, global_batch=32,
                   constraints="replica_sync=local_sgd sync_every=4 zero>=2", top=None,
                   include_unfit=True)
    layouts = list(found["estimate"].map(lambda e: e.layout))
    assert layouts and all(lay.replica_sync == "local_sgd" and lay.sync_every == 4
                           and lay.dp_replicate > 1 and lay.pp == 1 for lay in layouts)


# The planning guide's example (docs/guides/planning.md): Llama 3 8B on 1,024 H100s whose
# nodes talk over one 100 Gb/s NIC each (~1.4 GB/s per GPU, as in a cloud without InfiniBand)
SLOW_NETWORK = dataclasses.replace(HARDWARE["h100-sxm"], name="h100, 100 Gb/s per node",
                                   inter=Link(bandwidth_gbs=1.4, latency_us=30.0))


def test_diloco_changes_the_best_layout_on_a_slow_network() -> None:
    # one sequence per GPU: the batch at which DiLoCo's replicas can be plain HSDP
    every = plan("llama3-8b", gpus=1024, hardware_profile=SLOW_NETWORK, top=1,
                 global_batch=1024).best
    diloco = plan("llama3-8b", gpus=1024, hardware_profile=SLOW_NETWORK, top=1,
                  global_batch=1024, constraints="replica_sync=diloco sync_every=100").best
    # every step: the gradients' trip across nodes dominates, and the search hides it behind
    # a pipeline and TP; with DiLoCo the replicas meet every 100 steps, and plain HSDP wins
    assert every.layout.pp > 1 and every.layout.tp > 1
    assert diloco.layout.describe() == ("dp_replicate=128 dp_shard=8 zero=3 mbs=1 m=1 "
                                        "reduce_fp32=1 replica_sync=diloco sync_every=100")
    assert diloco.tokens_per_s > 1.5 * every.tokens_per_s
