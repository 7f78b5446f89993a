"""Stepping a schedule on real ranks computes what torch's schedule classes and one process do.

Every run is float64, so a wrong order or a lost gradient cannot hide in rounding: losses and
every gradient must agree to 1e-12. The executor is meshlab's one pipeline runtime: a model
``parallelize`` splits over a pp axis runs on it too (checked here against torch's classes on
the same FSDP-sharded stages; against one process in tests/rank/test_parallel.py).
"""

from __future__ import annotations

import ast
from typing import Any

import pytest

from meshlab import Cluster, MeshError

SETUP = """
import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from meshlab.models import ModelConfig, Transformer, global_batch
from meshlab.models.llama import loss_fn
from meshlab.schedules import build
from meshlab.schedules.execute import bind, stage_modules

cfg = ModelConfig(n_layers=8)
x, y = global_batch(step=0, batch=8, seq=16, vocab=cfg.vocab_size)
reference = Transformer(cfg).double()
reference_loss = loss_fn(reference(x), y)
reference_loss.backward()
reference_grads = {n: p.grad for n, p in reference.named_parameters()}

def gradient_error(model):
    errors = [(p.grad - reference_grads[n]).abs().max().item()
              for n, p in model.named_parameters() if p.grad is not None]
    return max(errors), len(errors)
"""

TORCH_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
               "interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
               "zb_h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
               "dualpipev": "ScheduleDualPipeV"}

STEPPED = """
schedule = build({name!r}, ranks=mesh["pp"].size(), microbatches={m}, virtual={v})
model = Transformer(cfg).double()
pipeline = bind(model, mesh, schedule, batch=(x, y))
advances = 0
while not pipeline.done:
    pipeline.advance(1)
    advances += 1

# torch's own class on the same split of a fresh copy
twin = Transformer(cfg).double()
pp = mesh["pp"]
mine = schedule.stages_of(pp.get_local_rank())
modules = stage_modules(twin, mine, schedule.stages)
stages = [PipelineStage(modules[s], s, schedule.stages, torch.device("cpu"), group=pp.get_group())
          for s in mine]
cls = getattr(torch_schedules, {cls!r})
single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
torch_schedule = cls(stages[0] if single else stages, n_microbatches={m}, loss_fn=loss_fn,
                     scale_grads=True)
losses = []
torch_schedule.step(x, target=y, losses=losses)
torch_loss = torch.stack(losses).mean().item() if losses else None
twin_grads = dict(twin.named_parameters())
vs_torch = max((p.grad - twin_grads[n].grad).abs().max().item()
               for n, p in model.named_parameters() if p.grad is not None)
(abs(pipeline.loss - reference_loss.item()), gradient_error(model),
 None if torch_loss is None else abs(torch_loss - pipeline.loss), vs_torch,
 advances, pipeline.slots)
"""

CASES = [("gpipe", "pp=4", 4, 1), ("1f1b", "pp=4", 8, 1), ("1f1b", "pp=2 dp=2", 4, 1),
         ("interleaved_1f1b", "pp=2 dp=2", 4, 2), ("looped_bfs", "pp=2 dp=2", 4, 2),
         ("zb_h1", "pp=4", 4, 1), ("zbv", "pp=2 dp=2", 4, 1), ("dualpipev", "pp=2 dp=2", 4, 1)]


def run_values(cluster: Cluster, code: str) -> dict[int, Any]:
    result = cluster.run(code, keep_values=True, timeout=120)
    return {r: ast.literal_eval(repr(v)) for r, v in result.values.items()}


@pytest.mark.cluster
@pytest.mark.parametrize("name, spec, m, v", CASES,
                         ids=[f"{n}-{s.replace(' ', '-')}-m{m}-v{v}" for n, s, m, v in CASES])
def test_stepping_one_slot_at_a_time_matches_torch_and_one_process(
        cluster: Cluster, name: str, spec: str, m: int, v: int) -> None:
    cluster.init_mesh(spec)
    cluster.run(SETUP, timeout=120)
    values = run_values(cluster, STEPPED.format(name=name, m=m, v=v, cls=TORCH_CLASS[name]))
    for rank, (loss_error, (grad_error, grads), torch_loss_error, vs_torch, advances,
               slots) in values.items():
        assert loss_error < 1e-12, f"rank {rank}: loss off by {loss_error}"
        assert grads > 0 and grad_error < 1e-12, f"rank {rank}: gradients off by {grad_error}"
        assert vs_torch < 1e-12, f"rank {rank}: gradients differ from torch's by {vs_torch}"
        if torch_loss_error is not None:  # the rank holding the last stage
            assert torch_loss_error < 1e-12
        assert advances == slots  # one slot per advance, and every slot ran


@pytest.mark.cluster
def test_torch_runtime_runs_a_schedule_exported_as_csv(cluster: Cluster, tmp_path: Any) -> None:
    cluster.init_mesh("pp=2 dp=2")
    cluster.run(SETUP, timeout=120)
    path = tmp_path / "schedule.csv"
    values = run_values(cluster, f"""
schedule = build("zb_h1", ranks=2, microbatches=4)
if rank == 0:
    open({str(path)!r}, "w").write(schedule.to_csv())
torch.distributed.barrier()
twin = Transformer(cfg).double()
pp = mesh["pp"]
modules = stage_modules(twin, schedule.stages_of(pp.get_local_rank()), schedule.stages)
stages = [PipelineStage(mod, s, schedule.stages, torch.device("cpu"), group=pp.get_group())
          for s, mod in modules.items()]
runtime = torch_schedules._PipelineScheduleRuntime(stages, n_microbatches=4, loss_fn=loss_fn)
runtime._load_csv({str(path)!r})
losses = []
runtime.step(x, target=y, losses=losses)
gradient_error(twin)[0]
""")
    assert all(error < 1e-12 for error in values.values()), values


@pytest.mark.cluster
def test_a_schedule_for_other_ranks_is_refused_with_the_fix(cluster: Cluster) -> None:
    cluster.init_mesh("pp=4")
    cluster.run(SETUP, timeout=120)
    with pytest.raises(MeshError, match=r"the schedule has 2 ranks but the pp axis has 4: "
                                        r"build it with ranks=4"):
        cluster.run("bind(Transformer(cfg).double(), mesh, build('1f1b', ranks=2, "
                    "microbatches=4), batch=(x, y))")


PARALLELIZED = """
from meshlab.models import local_batch
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.schedules import BUILDERS, TAKES_VIRTUAL
from torch.distributed.tensor import DTensor

def local(t):
    return t.to_local() if isinstance(t, DTensor) else t

cfg4 = ModelConfig(n_layers=4)
xs, ys = local_batch(step=0, batch=8, seq=16, vocab=cfg4.vocab_size,
                     rank=mesh["dp"].get_local_rank(), ranks=2)
pp = mesh["pp"]
errors = {{}}
for name in BUILDERS:
    plan = ParallelPlan(data_parallel="zero3", pipeline_schedule=name, microbatches=4,
                        virtual=2 if name in TAKES_VIRTUAL else 1)
    model = parallelize(Transformer(cfg4).double(), mesh, plan)
    loss = model.pipeline.step(xs, ys)
    rebound = bind(model, mesh, build(name, ranks=2, microbatches=4, virtual=plan.virtual),
                   batch=(xs, ys)) is model.pipeline  # its stages are the FSDP roots: kept
    # torch's class on the same stages of a twin (FSDP roots included), as torchtitan builds it
    twin = parallelize(Transformer(cfg4).double(), mesh, plan)
    schedule = twin.pipeline.schedule
    stages = [PipelineStage(twin.pipeline.stages[s].submod, s, schedule.stages,
                            torch.device("cpu"), group=pp.get_group())
              for s in schedule.stages_of(pp.get_local_rank())]
    cls = getattr(torch_schedules, {classes!r}[name])
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    theirs = cls(stages[0] if single else stages, n_microbatches=4, loss_fn=loss_fn,
                 scale_grads=True)
    losses = []
    theirs.step(xs, target=ys, losses=losses)
    twin_grads = dict(twin.named_parameters())
    errors[name] = (
        abs(torch.stack(losses).mean().item() - loss) if losses else None,
        max((local(p.grad) - local(twin_grads[n].grad)).abs().max().item()
            for n, p in model.named_parameters()),
        isinstance(stages[0].submod, torch.distributed.fsdp.FSDPModule), rebound)
errors
"""


@pytest.mark.cluster
def test_parallelized_pipelines_step_like_torchs_classes(cluster: Cluster) -> None:
    cluster.init_mesh("pp=2 dp=2")
    cluster.run(SETUP, timeout=120)
    values = run_values(cluster, PARALLELIZED.format(classes=TORCH_CLASS))
    for rank, errors in values.items():
        assert sorted(errors) == sorted(TORCH_CLASS)
        for name, (loss_error, grad_error, sharded, rebound) in errors.items():
            assert sharded, f"rank {rank} {name}: the stage is not an FSDP root"
            assert rebound, f"rank {rank} {name}: bind split the model again"
            if loss_error is not None:  # the rank holding the last stage
                assert loss_error < 1e-12, f"rank {rank} {name}: loss off by {loss_error}"
            assert grad_error < 1e-12, f"rank {rank} {name}: gradients off by {grad_error}"


@pytest.mark.cluster
def test_a_batch_the_microbatches_do_not_divide_is_refused_with_the_fix(
        cluster: Cluster) -> None:
    cluster.init_mesh("pp=4")
    cluster.run(SETUP, timeout=120)
    with pytest.raises(MeshError, match=r"4 micro-batches must divide the batch of 6 rows: "
                                        r"pass a batch that is a multiple of 4 rows"):
        cluster.run("bind(Transformer(cfg).double(), mesh, build('gpipe', ranks=4, "
                    "microbatches=4), batch=(x[:6], y[:6]))")
