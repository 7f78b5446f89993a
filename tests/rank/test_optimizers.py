"""Memory-efficient optimizers (meshlab.parallel.optimizers) sharded under ZeRO-1/2/3 on 4
gloo ranks: each trains as the same optimizer in one process, and the state bytes each rank
holds are the formula's (meshlab.plan.formulas.sharded_state_bytes)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch

from meshlab import Cluster
from meshlab.parallel.optimizers import Adafactor, AdamW8bit, AdamWBF16

# dim 32 and vocab 512: the embedding and output (512 x 32) are quantized by adamw8bit in one
# process and in every dim-0 shard of 4 (4096 values each); the other tensors in neither
TINY = "dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=64, vocab_size=512"
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None  # not a meshlab dependency
KINDS = ("adamw_bf16", "adafactor", "adamw8bit") if HAS_TORCHAO else ("adamw_bf16", "adafactor")

COMPARE = """
from meshlab.models import ModelConfig
from meshlab.parallel import ParallelPlan
from meshlab.verify.reused_references import reusing_references
from meshlab.verify.compare import compare_with_single_process
out = {{}}
with reusing_references():  # per optimizer, the three stages share one reference
    for kind in {kinds!r}:
        for dp in ("zero1", "zero2", "zero3"):
            r = compare_with_single_process(ModelConfig({tiny}), mesh,
                                            ParallelPlan(data_parallel=dp), steps=3,
                                            dtype=torch.float64, optimizer=kind)
            out[kind, dp] = (r.max_loss_error, r.max_param_error)
out
"""


@pytest.mark.cluster
def test_each_optimizer_trains_like_one_process_under_zero_1_2_3(cluster: Cluster) -> None:
    # float64, 3 steps. bf16 moments are rounded per element and Adafactor's factors are
    # summed across the shards, so only the order of float64 sums differs: 1e-9. adamw8bit
    # computes its step in fp32 (torchao) from blocks that coincide with one process's, so a
    # float64 reordering (~1e-16) reaches it only if it crosses an fp32 rounding or an 8-bit
    # code boundary: also held to 1e-9.
    cluster.init_mesh("dp=4")
    results = cluster.run(COMPARE.format(kinds=KINDS, tiny=TINY), keep_values=True,
                          timeout=240).values
    for rank, verdicts in results.items():
        for (kind, dp), (loss_error, param_error) in verdicts.items():
            assert loss_error <= 1e-9 and param_error <= 1e-9, (rank, kind, dp, verdicts)


HSDP = """
from meshlab.models import ModelConfig
from meshlab.parallel import ParallelPlan
from meshlab.verify.compare import compare_with_single_process
r = compare_with_single_process(ModelConfig({tiny}), mesh, ParallelPlan(data_parallel="zero3"),
                                steps=3, dtype=torch.float64, optimizer="adafactor")
(r.max_loss_error, r.max_param_error)
"""


@pytest.mark.cluster
def test_adafactor_factors_match_one_process_under_hsdp(cluster: Cluster) -> None:
    # (Replicate, Shard(0)): the row and column sums reduce over the shard axis only
    cluster.init_mesh("dp_replicate=2 dp=2")
    results = cluster.run(HSDP.format(tiny=TINY), keep_values=True, timeout=120).values
    assert all(loss <= 1e-9 and param <= 1e-9 for loss, param in results.values()), results


TENSOR_PARALLEL = """
from meshlab.models import ModelConfig
from meshlab.parallel import ParallelPlan
from meshlab.verify.compare import compare_with_single_process
out = {{}}
for kind in {kinds!r}:
    r = compare_with_single_process(ModelConfig({tiny}), mesh, ParallelPlan(data_parallel="zero3"),
                                    steps=3, dtype=torch.float64, optimizer=kind)
    out[kind] = (r.max_loss_error, r.max_param_error)
out
"""


@pytest.mark.cluster
def test_each_optimizer_trains_like_one_process_under_fsdp_over_tp(cluster: Cluster) -> None:
    # (_StridedShard(0), Shard(0)) and (Shard(0), Shard(1)) parameters: Adafactor sums its
    # row and column statistics over the mesh dims that shard each tensor dim; adamw8bit's
    # shards here are consecutive 4096-value row ranges, its blocks one process's. TP
    # reorders float64 sums more than data parallelism alone (~4e-13 here): 1e-9
    cluster.init_mesh("dp=2 tp=2")
    tiny = TINY.replace("n_kv_heads=1", "n_kv_heads=2")  # tp must divide the kv heads
    results = cluster.run(TENSOR_PARALLEL.format(kinds=KINDS, tiny=tiny), keep_values=True,
                          timeout=180).values
    for rank, verdicts in results.items():
        for kind, (loss_error, param_error) in verdicts.items():
            assert loss_error <= 1e-9 and param_error <= 1e-9, (rank, kind, verdicts)


REFUSED = """
from meshlab.models import ModelConfig, Transformer
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.parallel.compose import build_optimizer
plan = ParallelPlan(data_parallel="zero3")
model = parallelize(Transformer(ModelConfig()), mesh, plan)
try:
    build_optimizer(model, mesh, plan, kind="adamw8bit")
    said = ""
except ValueError as e:
    said = str(e)
said
"""


@pytest.mark.cluster
@pytest.mark.skipif(not HAS_TORCHAO, reason="adamw8bit needs torchao")
def test_adamw8bit_refuses_shards_whose_blocks_differ_from_one_process(cluster: Cluster) -> None:
    # ModelConfig()'s 64 x 64 attention weights are quantized whole (4096 values) but their
    # dim-0 shards on 4 ranks (1024) are not: every rank refuses alike, before training
    cluster.init_mesh("dp=4")
    said = cluster.run(REFUSED, keep_values=True, timeout=60).values
    assert all("adamw8bit" in s and "zero1" in s and "4096" in s for s in said.values()), said


BYTES = """
from meshlab.measure.memory import measure
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.models.llama import loss_fn
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.parallel.compose import build_optimizer
reports = {{}}
for kind in {kinds!r}:
    for dp in {modes!r}:
        torch.manual_seed(0)
        plan = ParallelPlan(data_parallel=dp)
        model = parallelize(Transformer(ModelConfig({tiny})), mesh, plan)
        opt = build_optimizer(model, mesh, plan, kind=kind)
        x, y = local_batch(step=0, batch=8, seq=8, vocab=512, seed=0,
                           rank=mesh["dp"].get_local_rank(), ranks=mesh["dp"].size())
        loss_fn(model(x), y).backward()
        opt.step()
        reports[kind, dp] = measure(model, opt)
reports
"""
ALL_KINDS = (*KINDS, "adamw", "sgd")


def _check_bytes(by_rank: dict[int, Any], modes: tuple[str, ...], dp: int) -> None:
    """The ranks' measured states add up to dp times the formula row (the mean per rank:
    ZeRO-1 spreads whole tensors unevenly), to the byte."""
    from meshlab.notebook.tables.memory import memory_frame

    for kind in ALL_KINDS:
        for mode in modes:
            reports = {r: got[kind, mode] for r, got in by_rank.items()}
            assert {m.optimizer_kind for m in reports.values()} == {kind}
            stage = int(mode[-1])
            frame = memory_frame(reports, params=0, dp=dp, stage=stage)
            measured = frame[frame["source"] == "measured"]["optimizer"].sum()
            formula = frame.loc[f"ZeRO-{stage} formula", "optimizer"]
            assert measured == len(reports) * formula, (kind, mode, measured, formula)


@pytest.mark.cluster
def test_measured_state_bytes_equal_the_formula_per_optimizer(cluster: Cluster) -> None:
    cluster.init_mesh("dp=4")
    modes = ("zero1", "zero3")
    by_rank = cluster.run(BYTES.format(kinds=ALL_KINDS, modes=modes, tiny=TINY),
                          keep_values=True, timeout=180).values
    _check_bytes(by_rank, modes, dp=4)


@pytest.mark.cluster
def test_measured_state_bytes_equal_the_formula_over_tp(cluster: Cluster) -> None:
    # the formula steps one tp rank's shapes (meshlab.measure.memory.tp_rank_shape), cut on dim 0
    cluster.init_mesh("dp=2 tp=2")
    tiny = TINY.replace("n_kv_heads=1", "n_kv_heads=2")
    by_rank = cluster.run(BYTES.format(kinds=ALL_KINDS, modes=("zero3",), tiny=tiny),
                          keep_values=True, timeout=180).values
    _check_bytes(by_rank, ("zero3",), dp=2)


def test_adamw_state_bytes_per_parameter_is_zeros_k() -> None:
    from meshlab.plan.formulas import optimizer_bytes_per_param

    # ZeRO's K = 12 for mixed-precision Adam (fp32 master weights, momentum, variance)
    assert optimizer_bytes_per_param("adamw", master_weights=True) == 12
    assert optimizer_bytes_per_param("adamw_bf16") == 4
    assert optimizer_bytes_per_param("adamw8bit") == 2 + 2 * 4 / 256


def test_fsdp_shards_in_the_formula_are_torch_chunks() -> None:
    from meshlab.plan.formulas import dim0_chunks

    # 6 rows on 4 ranks: torch.chunk gives 3 chunks of 2, FSDP2 an empty shard to the last
    expected = [tuple(c.shape) for c in torch.empty(6, 3).chunk(4)] + [(0, 3)]
    assert dim0_chunks((6, 3), 4) == expected


def _trained(cls: type[torch.optim.Optimizer], **kw: object) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 8)).double()
    optimizer = cls(model.parameters(), lr=1e-2, weight_decay=0.1, **kw)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 16, dtype=torch.float64)).square().mean().backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_adafactor_steps_plain_tensors_exactly_as_torch() -> None:
    ours, torchs = _trained(Adafactor), _trained(torch.optim.Adafactor)
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs, strict=True))


def test_adamw_bf16_with_wide_states_is_torch_adamw() -> None:
    # the same arithmetic; only the dtype the moments are stored in differs
    ours = _trained(AdamWBF16, state_dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(ours, _trained(torch.optim.AdamW), strict=True))


def test_adamw_bf16_stores_its_moments_in_bf16() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = AdamWBF16(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    state = optimizer.state[model.weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


def test_adamw8bit_without_torchao_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(ValueError, match="pip install torchao"):
        AdamW8bit(torch.nn.Linear(2, 2).parameters())
