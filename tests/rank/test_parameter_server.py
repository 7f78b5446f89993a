"""The stale-synchronous parameter server on 4 real gloo ranks: synchronous DP at staleness
0, a run with a slowed replica equal to the one-process replay of its own log, its traffic
against the module's formula, and what it refuses or reports.

Tolerances: float64 replays to 1e-9 (measured ~2e-13: the replay computes each worker's
gradient on the whole of its rows, the run as DDP/FSDP's mean over dp_shard); fp32 to
meshlab.verify.compare's (1e-5 losses, 2e-4 parameters).
"""

from __future__ import annotations

from typing import Any

import pytest
from replica_cells import TINY_LLAMA, TWO_RUNS

from meshlab import Cluster
from meshlab.notebook.output import MeshError
from meshlab.parallel import ParallelPlan

# the parameter server trains in two calls: train() ends each with finish(), and the next
# step() starts its threads again
AGAINST_DDP = TWO_RUNS.format(
    runs=[({"data_parallel": "ddp"}, [(0, 4)]),
          ({"data_parallel": "ddp", "replica_sync": "parameter_server"}, [(0, 2), (2, 4)])],
    optimizer={"lr": 1e-2})


@pytest.mark.cluster
def test_staleness_zero_is_synchronous_data_parallel(cluster: Cluster) -> None:
    # every worker waits for every update: DDP with the mean taken in another order (AdamW)
    cluster.init_mesh("dp_replicate=2 dp=2")
    result = cluster.run(AGAINST_DDP, keep_values=True, timeout=180)
    for r, (loss_gap, param_gap) in result.values.items():
        assert loss_gap < 1e-12 and param_gap < 1e-12, (r, loss_gap, param_gap)


SLOWED = """
from meshlab.models import ModelConfig
from meshlab.parallel import ParallelPlan
from meshlab.replicas.parameter_server_replay import run_and_replay
from meshlab.measure.throttle import off, throttle
{llama}if mesh["dp_replicate"].get_local_rank() == 0:
    throttle(3)  # replica 0 is the straggler: replica 1 runs up to `staleness` clocks ahead
out = {{}}
try:
    for name, plan, dtype in {cases}:
        model = llama if name.startswith("llama") else ModelConfig()
        result, sync = run_and_replay(model, mesh, ParallelPlan(
            replica_sync="parameter_server", **plan), steps=5, dtype=getattr(torch, dtype))
        out[name] = (result.ok, result.max_loss_error, result.max_param_error,
                     dict(sync.lags()), [c - v for c, vs in enumerate(sync.used) for v in vs])
finally:
    off()
out
"""

CASES_2X2 = [  # (name, plan, dtype)
    ("zero3 s=2", {"data_parallel": "zero3", "staleness": 2}, "float64"),
    ("ddp s=2 accum clip", {"data_parallel": "ddp", "staleness": 2, "grad_accum": 2,
                            "max_grad_norm": 0.5}, "float64"),
    ("zero3 s=1 fp32", {"data_parallel": "zero3", "staleness": 1}, "float32"),
    ("llama zero3 s=2", {"data_parallel": "zero3", "staleness": 2}, "float64"),
]
CASES_4 = [("none s=2", {"data_parallel": "none", "staleness": 2}, "float64")]


@pytest.fixture(scope="module")
def slowed_runs(module_cluster: Cluster) -> dict[str, dict[int, Any]]:
    """Each case, trained with replica 0 throttled 3x and replayed: {case: {rank: values}}."""
    runs: dict[str, dict[int, Any]] = {}
    for spec, cases in (("dp_replicate=2 dp=2", CASES_2X2), ("dp_replicate=4", CASES_4)):
        module_cluster.init_mesh(spec)
        result = module_cluster.run(SLOWED.format(cases=cases, llama=TINY_LLAMA),
                                    keep_values=True, timeout=300)
        for r, out in result.values.items():
            for name, values in out.items():
                runs.setdefault(name, {})[r] = values
    return runs


ALL_CASES = CASES_2X2 + CASES_4


@pytest.mark.cluster
@pytest.mark.parametrize("name, plan, dtype", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_stale_run_equals_the_replay_of_its_log(slowed_runs: dict[str, dict[int, Any]],
                                                name: str, plan: dict[str, Any],
                                                dtype: str) -> None:
    for r, (ok, loss_error, param_error, *_) in slowed_runs[name].items():
        assert ok, (r, name, loss_error, param_error)
        if dtype == "float64":
            assert loss_error < 1e-9 and param_error < 1e-9, (r, name, loss_error, param_error)


@pytest.mark.cluster
@pytest.mark.parametrize("name, plan, dtype", ALL_CASES, ids=[c[0] for c in ALL_CASES])
def test_slowed_replica_makes_stale_gradients_within_the_bound(
        slowed_runs: dict[str, dict[int, Any]], name: str, plan: dict[str, Any],
        dtype: str) -> None:
    bound = plan["staleness"]
    seen: set[int] = set()
    for r, (*_, server_lags, worker_lags) in slowed_runs[name].items():
        assert max(server_lags) <= bound and max(worker_lags) <= bound, (r, server_lags)
        seen |= set(server_lags)
    assert max(seen) > 0, (name, seen)  # some gradient was computed on an older version


TRAFFIC = """
import threading
import meshlab.measure.comms
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.models.llama import loss_fn
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.replicas.parameter_server import traffic
from meshlab.verify.compare import data_rank
r, n = data_rank(mesh)
plan = ParallelPlan(data_parallel="{dp}", replica_sync="parameter_server", staleness=1)
model = parallelize(Transformer(ModelConfig()), mesh, plan)
opt = build_optimizer(model, mesh, plan)
steps, sync = 3, opt.replica_sync
meshlab.measure.comms.start()
for s in range(steps):
    x, y = local_batch(step=s, batch=8, seq=16, vocab=256, rank=r, ranks=n)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
sync.finish()  # every thread's traffic of the last clock is in
records = [c for c in meshlab.measure.comms.stop() if c.group == sorted(sync.column)]
sync.finish()
formula = traffic(sync.numel, sync.replicas, sync.replica, itemsize=4)
({{op: sum(c.bytes for c in records if c.op == op) / steps for op in ("send", "recv")}},
 {{"send": formula.sent, "recv": formula.received}},
 [t.name for t in threading.enumerate() if t.name.startswith("meshlab-ps")])
"""


@pytest.mark.cluster
@pytest.mark.parametrize("spec, dp", [("dp_replicate=2 dp=2", "zero3"), ("dp_replicate=4", "none")])
def test_traced_bytes_per_clock_are_the_formula(cluster: Cluster, spec: str, dp: str) -> None:
    cluster.init_mesh(spec)
    result = cluster.run(TRAFFIC.format(dp=dp), keep_values=True, timeout=180)
    for r, (traced, formula, _) in result.values.items():
        assert traced == formula, (r, traced, formula)


@pytest.mark.cluster
def test_finish_stops_every_thread_and_may_be_called_again(cluster: Cluster) -> None:
    cluster.init_mesh("dp_replicate=4")
    result = cluster.run(TRAFFIC.format(dp="none"), keep_values=True, timeout=180)
    for r, (*_, threads) in result.values.items():
        assert threads == [], (r, threads)


STOPS_EARLY = """
import time
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.models.llama import loss_fn
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank
r, n = data_rank(mesh)
plan = ParallelPlan(data_parallel="none", replica_sync="parameter_server", staleness=1)
model = parallelize(Transformer(ModelConfig()), mesh, plan)
opt = build_optimizer(model, mesh, plan)
started, error = time.monotonic(), None
try:
    for s in range(2 if r == 3 else 3):  # replica 3 stops a step early
        x, y = local_batch(step=s, batch=8, seq=16, vocab=256, rank=r, ranks=n)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    opt.replica_sync.finish()
except RuntimeError as e:
    error = str(e)
(time.monotonic() - started, error)
"""


@pytest.mark.cluster
def test_a_replica_that_stops_early_fails_the_others_instead_of_hanging(
        cluster: Cluster) -> None:
    # the test profile's process-group timeout is 10 s: the others give up after it
    cluster.init_mesh("dp_replicate=4")
    result = cluster.run(STOPS_EARLY, keep_values=True, timeout=120)
    for r, (seconds, error) in result.values.items():
        if r == 3:
            assert error is None, error  # it has every version it asked for
            continue
        assert seconds < 60, (r, seconds)
        # its server waits for replica 3's clock 2, its receiver for the versions after it
        assert error is not None and "failed receiving" in error, (r, error)
        assert "Every replica must take the same number of steps" in error, (r, error)


@pytest.mark.cluster
def test_zero1_inside_replicas_is_refused_with_the_fix(cluster: Cluster) -> None:
    cluster.init_mesh("dp_replicate=2 dp=2")
    with pytest.raises(MeshError, match=r"data_parallel='zero1' with replica_sync="
                                        r"'parameter_server'.*use data_parallel='ddp'"):
        cluster.run("from meshlab.models import ModelConfig, Transformer\n"
                    "from meshlab.parallel import ParallelPlan, build_optimizer, parallelize\n"
                    "plan = ParallelPlan(data_parallel='zero1', "
                    "replica_sync='parameter_server')\n"
                    "build_optimizer(parallelize(Transformer(ModelConfig()), mesh, plan), "
                    "mesh, plan)")


def test_staleness_is_refused_outside_the_parameter_server() -> None:
    with pytest.raises(ValueError, match=r"staleness=2 applies to replica_sync="
                                         r"'parameter_server', not 'local_sgd'"):
        ParallelPlan(replica_sync="local_sgd", staleness=2)
    with pytest.raises(ValueError, match=r"staleness=-1 must be an integer >= 0"):
        ParallelPlan(replica_sync="parameter_server", staleness=-1)
