"""fp16 with dynamic loss scaling and QAT on 4 real gloo ranks, each against the same recipe
in one process (meshlab.verify.compare), and the refusals that name their fix.

fp16 tolerances: losses 1e-4, parameters 1e-3 (verify.TOLERANCES; measured ~1e-5 and ~6e-5
after 4 SGD steps). QAT is held to 10x the one-process floor (2 accumulated halves), as
verify does for any model that rounds."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from meshlab import Cluster
from meshlab.parallel import ParallelPlan
from meshlab.parallel.precision import LossScaledOptimizer, apply_qat, check_qat

TINY = "ModelConfig(dim=32, ffn_hidden=64, vocab_size=128, n_layers=2)"

COMPARE = f"""
from meshlab.models import ModelConfig
from meshlab.parallel import ParallelPlan
from meshlab.verify.compare import compare_with_single_process
results = []
for kw in {{plans}}:
    r = compare_with_single_process({TINY}, mesh, ParallelPlan(**kw), steps=3,
                                    optimizer="sgd", lr=0.05)
    results.append((kw, r.ok, r.max_loss_error, r.max_param_error, r.skipped_steps))
results
"""

OVERFLOW = f"""
from torch.distributed.tensor import DTensor
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.models.llama import loss_fn
from meshlab.parallel import ParallelPlan, parallelize, build_optimizer
from meshlab.verify.compare import full_parameters, train
plan = ParallelPlan(data_parallel="zero3", mixed_precision="fp16")
torch.manual_seed(0)
m = parallelize(Transformer({TINY}), mesh, plan)
opt = build_optimizer(m, mesh, plan, kind="sgd")
x, y = local_batch(step=0, batch=8, seq=16, vocab=128, rank=0, ranks=1)
train(m, opt, [(x, y)])
before, scale = full_parameters(m), opt.loss_scale
opt.zero_grad()
if getattr(m, "pipeline", None) is not None:
    m.pipeline.step(x, y)
else:
    opt.scale(loss_fn(m(x), y)).backward()
if rank == 0:  # one rank alone overflows; every TP, PP and DP rank must skip with it
    g = next(p.grad for p in m.parameters() if p.grad is not None)
    (g.to_local() if isinstance(g, DTensor) else g).view(-1)[0] = float("inf")
opt.step()
same = all(torch.equal(before[n], p) for n, p in full_parameters(m).items())
(same, opt.skipped_steps, opt.loss_scale / scale)
"""


@pytest.mark.parametrize("spec, plans", [
    ("dp=4", [dict(data_parallel=d, mixed_precision="fp16") for d in ("ddp", "zero1", "zero2")]
     + [dict(data_parallel="zero3", mixed_precision="fp16", max_grad_norm=0.5)]),
    ("dp=2 tp=2", [dict(data_parallel="zero3", mixed_precision="fp16")]),
    ("pp=2 dp=2", [dict(data_parallel="zero3", mixed_precision="fp16")])])
def test_fp16_with_loss_scaling_trains_like_one_process(cluster: Cluster, spec: str,
                                                        plans: list[dict[str, object]]) -> None:
    cluster.init_mesh(spec)
    result = cluster.run(COMPARE.format(plans=plans), keep_values=True, timeout=240)
    for r, runs in result.values.items():
        for kw, ok, loss_error, param_error, skipped in runs:
            assert ok and skipped == 0, (r, spec, kw, loss_error, param_error, skipped)
            assert loss_error < 1e-4 and param_error < 1e-3, (r, spec, kw)


@pytest.mark.parametrize("spec", ["dp=2 tp=2", "pp=2 dp=2"])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(cluster: Cluster, spec: str) -> None:
    cluster.init_mesh(spec)
    result = cluster.run(OVERFLOW, keep_values=True, timeout=120)
    # parameters unchanged, one skipped step counted, the scale halved: on all 4 ranks
    assert result.values == {r: (True, 1, 0.5) for r in range(4)}


QAT = """
from torchao.quantization.qat import FakeQuantizedLinear
from meshlab.models import Transformer
from meshlab.parallel import parallelize
fake = parallelize(Transformer({tiny}), mesh, ParallelPlan(**{plans}[0])).modules()
results = [("fake-quantized Linears here", sum(isinstance(x, FakeQuantizedLinear) for x in fake))]
for kw in {plans}:
    r = compare_with_single_process({tiny}, mesh, ParallelPlan(**kw), steps=3,
                                    optimizer="sgd", lr=0.05)
    results.append((kw, r.ok, r.max_loss_error, r.max_param_error, r.param_rtol))
results
"""


@pytest.mark.parametrize("spec, plans", [
    ("dp=4", [dict(data_parallel="ddp", qat="8da4w"), dict(data_parallel="zero3", qat="8da4w")]),
    ("pp=2 dp=2", [dict(data_parallel="zero3", qat="8da8w")])])
def test_qat_trains_like_the_same_qat_in_one_process(cluster: Cluster, spec: str,
                                                     plans: list[dict[str, object]]) -> None:
    cluster.init_mesh(spec)
    code = COMPARE.split("results = []")[0] + QAT.format(plans=plans, tiny=TINY)
    result = cluster.run(code, keep_values=True, timeout=240)
    for r, (quantized, *runs) in result.values.items():
        assert quantized[1] > 0, (r, spec, quantized)
        for kw, ok, loss_error, param_error, param_rtol in runs:
            assert ok, (r, spec, kw, loss_error, param_error, param_rtol)


def test_step_without_scale_is_refused() -> None:
    model = nn.Linear(4, 2)
    opt = LossScaledOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, world=False)
    model(torch.ones(1, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"no opt.scale\(loss\) since the last step"):
        opt.step()


def test_overflow_in_one_process_skips_and_halves_the_scale() -> None:
    model = nn.Linear(4, 2)
    opt = LossScaledOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                              init_scale=1024.0, world=False)
    before = model.weight.detach().clone()
    opt.scale(model(torch.ones(1, 4)).sum() * float("inf")).backward()
    opt.step()
    assert (opt.skipped_steps, opt.loss_scale) == (1, 512.0)
    assert torch.equal(model.weight, before)


def test_mixed_precision_true_still_means_bf16() -> None:
    from meshlab.parallel.precision import compute_dtype

    assert ParallelPlan(mixed_precision=True).mixed_precision is True  # old code reads it
    assert [compute_dtype(v) for v in (True, "bf16", "fp16", False)] == [
        torch.bfloat16, torch.bfloat16, torch.float16, None]


@pytest.mark.parametrize("kw, fix", [
    (dict(mixed_precision="fp8"), "use 'bf16', or 'fp16' with loss scaling"),
    (dict(mixed_precision="fp16", replica_sync="local_sgd", sync_every=2),
     "use replica_sync='every_step'"),
    (dict(mixed_precision="fp32"), r"is not one of \('bf16', 'fp16'\)"),
    (dict(qat="int3"), r"is not one of \('8da4w', '8da8w', '4w'\)"),
    (dict(mixed_precision="fp16", loss_scale=0.0), "must be a positive number")])
def test_precision_options_refused_with_the_fix(kw: dict[str, object], fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        ParallelPlan(**kw)  # type: ignore[arg-type]


def test_qat_with_tp_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="build the mesh without tp"):
        check_qat(ParallelPlan(qat="8da4w"), {"tp": 2}, nn.Linear(32, 32))


def test_qat_refuses_float64_and_groups_that_do_not_divide() -> None:
    with pytest.raises(ValueError, match="build the model in float32"):
        apply_qat(nn.Linear(32, 8).double(), "8da4w")
    with pytest.raises(ValueError, match="use qat='8da8w'"):
        apply_qat(nn.Sequential(nn.Linear(48, 8)), "4w")


def test_qat_without_torchao_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.quantization.qat", None)
    with pytest.raises(ImportError, match="pip install torchao"):
        apply_qat(nn.Sequential(nn.Linear(32, 8)), "8da4w")
