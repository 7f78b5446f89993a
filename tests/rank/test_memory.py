"""Memory estimates checked against the papers' own numbers, and measure() on real modules."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshlab.measure.memory import MemoryReport, activation_bytes_per_layer, measure, zero_bytes

GB = 1e9  # the ZeRO paper's GB is decimal


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage: int, expected_gb: float) -> None:
    # Figure 1: a 7.5B-parameter model, Adam (K = 12), 64-way data parallel.
    got = zero_bytes(int(7.5e9), dp=64, stage=stage)
    assert round(got["total"] / GB, 1) == expected_gb
    assert got["total"] == got["params"] + got["grads"] + got["optimizer"]


def test_zero_exact_terms() -> None:
    psi, n = 7_500_000_000, 64
    s1 = zero_bytes(psi, dp=n, stage=1)
    assert s1 == {"params": 2 * psi, "grads": 2 * psi, "optimizer": 12 * psi / n,
                  "total": 4 * psi + 12 * psi / n}  # 31.40625 GB
    s2 = zero_bytes(psi, dp=n, stage=2)
    assert s2["total"] == 2 * psi + 14 * psi / n  # 16.640625 GB
    assert zero_bytes(psi, dp=n, stage=3)["total"] == 16 * psi / n  # 1.875 GB
    # dp = 1 leaves nothing to shard: every stage costs the same.
    assert {zero_bytes(psi, dp=1, stage=s)["total"] for s in range(4)} == {16 * psi}
    fp32 = zero_bytes(10, dp=2, stage=3, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert fp32 == {"params": 20.0, "grads": 20.0, "optimizer": 40.0, "total": 80.0}


@pytest.mark.parametrize("kwargs, match", [
    ({"dp": 8, "stage": 4}, r"stage must be one of \(0, 1, 2, 3\), got 4"),
    ({"dp": 8, "stage": -1}, r"stage .* got -1"),
    ({"dp": 0, "stage": 1}, r"dp .* must be >= 1, got 0"),
])
def test_zero_rejects_bad_stage_and_dp(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        zero_bytes(1000, **kwargs)


def test_zero_rejects_negative_params() -> None:
    with pytest.raises(ValueError, match=r"params must be >= 0, got -1"):
        zero_bytes(-1, dp=8, stage=0)


# s=2048, b=1, h=4096, a=32, t=8: s*b*h = 2**23 and 5*a*s/h = 80, so every value is exact.
CFG = {"seq": 2048, "batch": 1, "hidden": 4096, "heads": 32}
SBH = 2048 * 1 * 4096


@pytest.mark.parametrize("tp, sp, recompute, by_hand", [
    (1, False, "none", SBH * (34 + 80)),  # no parallelism
    (8, False, "none", SBH * (10 + 24 / 8 + 80 / 8)),  # tensor parallel: 23 sbh
    (8, True, "none", SBH / 8 * (34 + 80)),  # tensor + sequence parallel
    (8, False, "selective", SBH * (10 + 24 / 8)),  # TP + selective recompute: 13 sbh
    (8, True, "selective", SBH * 34 / 8),  # TP + SP + selective recompute
    (1, False, "selective", SBH * 34),
    (1, False, "full", 2 * SBH),
    (8, False, "full", 2 * SBH),
    (8, True, "full", 2 * SBH / 8),
])
def test_korthikanti_table_2(tp: int, sp: bool, recompute: str, by_hand: float) -> None:
    got = activation_bytes_per_layer(**CFG, tp=tp, sequence_parallel=sp, recompute=recompute)
    assert got == by_hand


def test_korthikanti_relations() -> None:
    none = activation_bytes_per_layer(**CFG)
    sp = activation_bytes_per_layer(**CFG, tp=8, sequence_parallel=True)
    assert sp == none / 8
    odd = activation_bytes_per_layer(**CFG, tp=3, sequence_parallel=True)
    assert odd == pytest.approx(none / 3, rel=1e-12)
    for tp, seq_par in [(1, False), (8, False), (8, True)]:
        def at(recompute: str, tp: int = tp, seq_par: bool = seq_par) -> float:
            return activation_bytes_per_layer(**CFG, tp=tp, sequence_parallel=seq_par,
                                              recompute=recompute)
        assert at("full") < at("selective") < at("none")
    # TP alone leaves 10*s*b*h replicated, so it saves less than TP + SP.
    assert sp < activation_bytes_per_layer(**CFG, tp=8) < none


def test_korthikanti_tp_one_ignores_sequence_parallel() -> None:
    for recompute in ("none", "selective", "full"):
        plain = activation_bytes_per_layer(**CFG, recompute=recompute)
        assert activation_bytes_per_layer(**CFG, tp=1, recompute=recompute) == plain
        assert activation_bytes_per_layer(**CFG, tp=1, sequence_parallel=True,
                                          recompute=recompute) == plain


def test_korthikanti_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"recompute must be one of .*'none'.* got 'some'"):
        activation_bytes_per_layer(**CFG, recompute="some")
    with pytest.raises(ValueError, match=r"tp .* must be >= 1, got 0"):
        activation_bytes_per_layer(**CFG, tp=0)
    with pytest.raises(ValueError, match=r"heads must be >= 1, got 0"):
        activation_bytes_per_layer(**{**CFG, "heads": 0})


def test_measure_linear_with_adamw() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    report = measure(model, opt)
    param_bytes = (16 * 8 + 8) * 4
    assert report.params == param_bytes
    assert report.grads == param_bytes
    # exp_avg + exp_avg_sq, plus one small `step` tensor per parameter.
    assert 2 * param_bytes <= report.optimizer < 2 * param_bytes + 64
    assert report.total == report.params + report.grads + report.optimizer


def test_measure_without_optimizer_or_grads() -> None:
    assert measure(nn.Linear(16, 8)) == MemoryReport(params=(16 * 8 + 8) * 4, grads=0,
                                                     optimizer=0)


def test_measure_counts_tied_parameters_once() -> None:
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # weight tying, as in GPT-2
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert measure(model).params == 10 * 4 * 4
    # A second Parameter object over the same storage is still the same bytes.
    alias = nn.ModuleDict({"emb": emb, "head": nn.Linear(4, 10, bias=False)})
    alias["head"].weight = nn.Parameter(emb.weight.data)
    assert measure(alias).params == 10 * 4 * 4


def test_measure_counts_views_of_one_flat_buffer_separately() -> None:
    # Like DDP's gradient_as_bucket_view: every grad is a distinct slice of one bucket.
    model = nn.Linear(16, 8)
    bucket = torch.zeros(16 * 8 + 8)
    model.weight.grad = bucket[: 16 * 8].view(8, 16)
    model.bias.grad = bucket[16 * 8:]
    assert measure(model).grads == bucket.numel() * 4


@pytest.fixture
def fake_world() -> Iterator[int]:
    """A 2-rank process group with no peers (torch's fake backend): we are rank 1."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group already in this process")
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=2)
    try:
        yield 2
    finally:
        dist.destroy_process_group()


def test_measure_dtensor_counts_local_shard(fake_world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (fake_world,))
    model = nn.Linear(16, 8)
    for name, p in list(model.named_parameters()):
        setattr(model, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    local = (16 * 8 + 8) // fake_world * 4
    report = measure(model, opt)
    assert (report.params, report.grads) == (local, local)
    assert 2 * local <= report.optimizer < 2 * local + 64


def test_measure_zero_redundancy_optimizer_counts_own_shard(fake_world: int) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    # Two equal-sized layers: ZeRO gives one to each rank, so rank 1 holds one layer's state.
    model = nn.Sequential(nn.Linear(16, 8, bias=False), nn.Linear(8, 16, bias=False))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    layer = 16 * 8 * 4
    report = measure(model, opt)
    assert report.params == 2 * layer  # parameters stay replicated under ZeRO-1
    assert 2 * layer <= report.optimizer < 2 * layer + 64


def test_activation_bytes_shrink_with_checkpointing() -> None:
    from meshlab.measure.memory import activation_bytes
    from meshlab.models import ModelConfig, Transformer, global_batch
    from meshlab.parallel import apply_ac

    inputs, _ = global_batch(step=0, batch=4, seq=16, vocab=256)
    sizes = {mode: activation_bytes(apply_ac(Transformer(ModelConfig()), mode), inputs)
             for mode in ("none", "selective", "full")}
    assert sizes["full"] < sizes["selective"] < sizes["none"]
    assert sizes["none"] >= 4 * 16 * 64 * 4  # the output projection saves its input, at least


def test_offloaded_activations_are_counted_on_the_host_and_train_alike() -> None:
    from meshlab.measure.memory import activation_placement
    from meshlab.models import ModelConfig, Transformer, global_batch
    from meshlab.parallel.offload import apply_activation_offload

    inputs, targets = global_batch(step=0, batch=4, seq=16, vocab=256)
    torch.manual_seed(0)
    plain = Transformer(ModelConfig())
    offloaded = apply_activation_offload(copy.deepcopy(plain))
    device, host = activation_placement(plain, inputs)
    off_device, off_host = activation_placement(offloaded, inputs)
    assert host == 0 and off_host > 0
    # what the blocks save moves; the embedding's and the output's stay on the device
    assert 0 < off_device < device <= off_device + off_host
    grads = []
    for model in (plain, offloaded):
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    # the same ops on the same values: bit for bit
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_offloaded_fsdp_shards_count_as_host_memory(fake_world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from meshlab.parallel.fsdp import apply_fsdp

    mesh = init_device_mesh("cpu", (fake_world,), mesh_dim_names=("dp_shard_cp",))
    torch.manual_seed(0)
    kept, offloaded = (apply_fsdp(nn.Sequential(nn.ModuleList([nn.Linear(16, 16)])),
                                  mesh, blocks="0", offload=offload)
                       for offload in (False, True))
    assert measure(kept).host == 0
    report = measure(offloaded)
    assert report.params == measure(kept).params and report.host == report.total


class _TwoLinears(nn.Module):
    """Blocks that save their inputs and one transposed weight, nothing twice."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))


def test_offloading_copies_activations_not_the_weights_linears_save() -> None:
    from meshlab.measure.memory import activation_placement
    from meshlab.parallel.offload import apply_activation_offload

    torch.manual_seed(0)
    plain, x = _TwoLinears(), torch.randn(3, 16)
    offloaded = apply_activation_offload(copy.deepcopy(plain))
    # the two inputs, 3 x 16 floats each; the second layer's weight.t() is the weight
    assert activation_placement(plain, x) == (2 * 3 * 16 * 4, 0)
    assert activation_placement(offloaded, x) == (0, 2 * 3 * 16 * 4)


def test_activations_leave_out_the_weights_fsdp_gathers(fake_world: int) -> None:
    # FSDP2 swaps in gathered parameters for the forward, in storage apart from its shards
    # (and freed after each block, so addresses repeat): they are no activations either
    from torch.distributed.device_mesh import init_device_mesh

    from meshlab.measure.memory import activation_placement
    from meshlab.models import ModelConfig, Transformer, global_batch
    from meshlab.parallel.fsdp import apply_fsdp

    inputs, _ = global_batch(step=0, batch=2, seq=16, vocab=256)
    mesh = init_device_mesh("cpu", (fake_world,), mesh_dim_names=("dp_shard_cp",))
    torch.manual_seed(0)
    plain = Transformer(ModelConfig())
    for reshard in (True, False):  # ZeRO-3, ZeRO-2
        sharded = apply_fsdp(copy.deepcopy(plain), mesh, reshard_after_forward=reshard)
        assert activation_placement(sharded, inputs) == activation_placement(plain, inputs)


def _fsdp_root_with_params(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    # The root holds parameters of its own: FSDP2 keeps those gathered after a forward.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 16))
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return model, opt


def test_activation_bytes_leaves_fsdp_sharded(fake_world: int) -> None:
    from meshlab.measure.memory import activation_bytes

    model, opt = _fsdp_root_with_params(fake_world)
    before = measure(model, opt)
    local = (16 * 8 + 8 + 8 * 16 + 16) // fake_world * 4
    assert (before.params, before.grads) == (local, local)
    assert activation_bytes(model, torch.randn(3, 16)) > 0
    # the same figures after the measuring forward, and the optimizer's parameters are
    # still the module's own
    assert measure(model, opt) == before
    ids = {id(p) for p in model.parameters()}
    assert all(id(p) in ids for g in opt.param_groups for p in g["params"])


def test_measure_reshards_a_forward_only_fsdp_module(fake_world: int) -> None:
    model, opt = _fsdp_root_with_params(fake_world)
    before = measure(model, opt)
    model(torch.randn(3, 16))  # a forward without backward: FSDP2 keeps the root gathered
    assert measure(model, opt) == before


def test_zero3_formula_row_divides_parameters_by_tp() -> None:
    from meshlab.notebook.tables.memory import memory_frame

    reports = {0: MemoryReport(params=40, grads=40, optimizer=80)}
    plain = memory_frame(reports, params=80, dp=2, stage=3)
    assert plain.loc["ZeRO-3 formula", "params"] == 80 * 4 / 2
    frame = memory_frame(reports, params=80, dp=2, tp=2, stage=3)
    row = frame.loc["ZeRO-3 formula"]
    assert (row["params"], row["grads"], row["optimizer"]) == (80 * 4 / 4, 80 * 4 / 4,
                                                                80 * 8 / 4)
