"""Asynchronous data parallel: a stale-synchronous parameter server over the replicas.

``ParallelPlan(replica_sync="parameter_server", staleness=s)`` trains the ``dp_replicate``
replicas as the workers of a stale-synchronous parallel (SSP) parameter server with updates
aggregated per clock (Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous
Parallel Parameter Server", NeurIPS). Inside a replica DDP or FSDP reduce over ``dp_shard``.

Servers are colocated with the workers. Each rank's local parameter shards, flattened, are cut
into R pieces (R replicas); piece j is served by the rank of replica j in the same *column*
(the ranks with this rank's coordinates on the other axes), which keeps that piece's optimizer
state: 1/R of it per rank, as ZeRO-1 across the replicas would.

Clock c of a worker (its c-th ``step()``): it pushes gradient piece j to server j, then, before
its next gradient, holds every piece at version >= c+1-s, taking the newest that has arrived
at every rank of its replica (they agree on one version per piece, so DDP and FSDP never mix
versions). Server j makes version c+1: one step of the optimizer build_optimizer was asked
for, on its piece, with the mean of the R gradients of clock c summed in worker order; then
sends it to every worker. s=0 is synchronous data parallel; with s>0 a fast worker runs up to
s clocks ahead of a slow one. With max_grad_norm each worker clips its own gradient before
pushing it (as local SGD's replicas do): s=0 then is DP with per-replica clipping. Call
``opt.replica_sync.finish()`` after the last step of your own loop (``verify.train`` does):
it waits for the last version, puts it into the parameters and stops the threads; a later
``step()`` starts them again. The servers' optimizer state is not in ``state_dict()``.

Traffic per clock and rank (``traffic``; N elements of b bytes in the rank's shards, n in its
piece): it pushes the N-n gradient elements of the other pieces, each message one element
longer (how many versions behind its clock the gradient was computed), and pulls their N-n
new values; its server takes R-1 gradients of n+1 elements and sends R-1 new versions of n.
When R divides N a rank sends, and receives, (2(R-1)/R * N + R-1) * b: a ring all-reduce's
2(R-1)/R * N * b, plus the R-1 version headers.

Why plain send/recv on meshlab's groups. torch.distributed.rpc is "stable and in maintenance
mode" (its documentation); it runs a TensorPipe agent set up by its own ``init_rpc``
rendezvous beside the process groups, addressing workers by name, not by the mesh's axes.
torchft's ``ParameterServer`` (torchft/parameter_server.py, a prototype) serves sessions over
HTTP, each with a fresh two-rank process group configured through its own TCPStore, and leaves
what a server does abstract: no versions, no staleness, nothing on the mesh's groups. Here two
process groups per column (pushes, pulls), made once, carry plain send/recv; each rank runs
one server thread (receives clock c's gradients in worker order, steps, sends) and one thread
receiving new versions. A worker's traffic with its own rank's server goes through memory
(gloo cannot send to itself). A dead or stopped peer surfaces at the next ``step()`` or
``finish()`` after the groups' timeout, as an error naming what was awaited.

Verified by replay (meshlab.replicas.parameter_server_replay): every server logs (clock,
worker, version the gradient was computed on) in the order it applied them and every worker
the versions it computed each clock's gradient on; one process replays the log from the same
initial weights.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshlab.measure.comms import CommTracer
from meshlab.measure.memory import local_shard
from meshlab.mesh import axis_size
from meshlab.replicas.parameter_server_columns import (
    Traffic,
    column_groups,
    mean_in_order,
    piece_bounds,
    traced,
    tracers_active,
    traffic,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshlab.parallel.compose import ParallelPlan


def check_supported(mesh: DeviceMesh, plan: ParallelPlan) -> None:
    """Refuse, naming the fix, what the parameter server does not run (pp and ep are refused
    by parallelize already)."""
    for axis in ("tp", "cp"):
        if axis_size(mesh, axis) > 1:
            raise ValueError(f"replica_sync='parameter_server' with {axis}="
                             f"{axis_size(mesh, axis)} is not verified yet: build the mesh as "
                             "dp_replicate x dp_shard, e.g. %mesh init dp_replicate=2 dp=2")
    if plan.data_parallel == "zero1" and axis_size(mesh, "dp_shard") > 1:
        raise ValueError("data_parallel='zero1' with replica_sync='parameter_server': the "
                         "servers already keep 1/R of the optimizer state per rank, and "
                         "inside a replica the workers hold none; use data_parallel='ddp', or "
                         "'zero2'/'zero3' to shard the parameters over dp_shard too")


class ParameterServerSync:
    """One rank's worker and server: ``step()`` pushes this clock's gradient and takes the
    versions the next one is computed on; ``finish()`` takes the last version and stops."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan,
                 optimizer_class: Any, args: dict[str, Any]) -> None:
        check_supported(mesh, plan)
        self.model, self.staleness, self.max_grad_norm = model, plan.staleness, plan.max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {local_shard(p).dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"the parameter server cuts all parameters into one flat vector, "
                             f"and they have dtypes {sorted(map(str, dtypes))}: cast the model "
                             "to one (model.to(torch.float32))")
        self.column, self.push_group, self.pull_group, self.timeout = column_groups(mesh)
        self.replicas, self.replica = len(self.column), self.column.index(dist.get_rank())
        self.within = mesh["dp_shard"].get_group() if axis_size(mesh, "dp_shard") > 1 else None
        flat = self._flat([local_shard(p).detach() for p in self.params])
        self.numel, self.bounds = flat.numel(), piece_bounds(flat.numel(), self.replicas)
        # version 0 is each server's piece as its rank holds it: every worker starts alike
        for j, piece in enumerate(self._pieces(flat)):
            dist.broadcast(piece, src=self.column[j], group=mesh["dp_replicate"].get_group())
        self._write(flat)
        self.piece = nn.Parameter(self._pieces(flat)[self.replica].clone())
        self.optimizer = optimizer_class([self.piece], **args)
        self.log: list[tuple[int, int, int]] = []
        """The server's updates in the order applied: (clock, worker, version of this piece
        the gradient was computed on)."""
        self.used: list[tuple[int, ...]] = [(0,) * self.replicas]
        """The worker's: per clock, the version of each piece its gradient was computed on."""
        self.clock = 0  # clocks pushed: the next step's clock
        self._cond = threading.Condition()
        self._arrived: list[dict[int, torch.Tensor]] = [{0: p.clone()} for p in self._pieces(flat)]
        self._newest = [0] * self.replicas
        self._tracers: dict[int, list[CommTracer]] = {}
        self._sending: deque[tuple[int, Any, torch.Tensor]] = deque()  # pushes not waited for
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.errors: list[str] = []  # what failed in the threads, raised at step() / finish()

    @property
    def updates(self) -> int:
        """Gradients this rank's server has applied (R per clock)."""
        return len(self.log)

    def lags(self) -> Counter[int]:
        """How many versions behind its clock each gradient this server applied was."""
        return Counter(clock - version for clock, _, version in self.log)

    # -- worker ------------------------------------------------------------------------------

    def step(self) -> None:
        """Clock ``self.clock``: push the gradient, then hold versions >= clock + 1 - s."""
        self._check()
        if self.max_grad_norm is not None:  # each worker clips its own gradient, as local SGD
            from meshlab.parallel.clip import clip_grad_norm_

            clip_grad_norm_(self.model, self.max_grad_norm)
        self._start()
        c, versions, tracers = self.clock, self.used[self.clock], tracers_active()
        grads = [local_shard(p.grad) if p.grad is not None else torch.zeros_like(local_shard(p))
                 for p in self.params]
        own = None
        for j, piece in enumerate(self._pieces(self._flat(grads))):
            # the header is the lag, at most s: exact in any float dtype, unlike the version
            message = torch.cat([piece, piece.new_tensor([float(c - versions[j])])])
            if j == self.replica:
                own = message
            else:
                work = dist.isend(message, dst=self.column[j], group=self.push_group)
                self._sending.append((c, work, message))
        with self._cond:
            self.clock, self._tracers[c] = c + 1, tracers
            self._cond.notify_all()
        self._inbox.put((c, own, tracers))
        need = c + 1 - self.staleness
        self._wait(lambda: min(self._newest) >= need, f"version {need} of every piece")
        with self._cond:
            newest = torch.tensor(self._newest, dtype=torch.int64, device=self.piece.device)
        if self.within is not None:  # the newest every rank of this replica holds
            dist.all_reduce(newest, op=dist.ReduceOp.MIN, group=self.within)
        self._take(tuple(int(v) for v in newest.tolist()))
        # a server that made version c+1-s has this worker's push of clock c-s
        while self._sending and self._sending[0][0] <= c - self.staleness:
            self._sending.popleft()[1].wait()

    def finish(self) -> None:
        """Wait for the last version and put it into the parameters; stop the threads. Call
        it after the last step (safe to call again; a later step starts the threads again)."""
        if not self._threads:
            self._check()
            return
        try:
            last = self.clock
            self._wait(lambda: min(self._newest) >= last, f"the last version ({last})")
            self._take((last,) * self.replicas)
            while self._sending:
                self._sending.popleft()[1].wait()  # done: every server has the last clock
        finally:
            self._stop()
        self._check()

    def _take(self, versions: tuple[int, ...]) -> None:
        """Compute the next gradient on these versions (and forget older ones)."""
        with self._cond:
            pieces = [self._arrived[j][v] for j, v in enumerate(versions)]
            for j, v in enumerate(versions):
                for old in [k for k in self._arrived[j] if k < v]:
                    del self._arrived[j][old]
        self._write(torch.cat(pieces))
        self.used[self.clock:] = [versions]

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        started = time.monotonic()
        with self._cond:
            while not ready():
                self._check()
                waited = time.monotonic() - started
                if waited > 3 * self.timeout:  # a backstop: the threads' own waits time out
                    raise RuntimeError(f"parameter server on rank {dist.get_rank()}: no "
                                       f"{what} after {waited:.0f} s")
                self._cond.wait(timeout=1.0)

    def _check(self) -> None:
        if self.errors:
            raise RuntimeError(f"parameter server on rank {dist.get_rank()} failed: "
                               f"{'; '.join(self.errors)}. Every replica must take the same "
                               "number of steps; a peer that died or stopped stepping shows "
                               f"here after the process group's timeout ({self.timeout:g} s)")

    # -- threads -----------------------------------------------------------------------------

    def _start(self) -> None:
        if self._threads:
            return
        self._inbox, first = queue.Queue(), self.clock + 1  # the receiver's first version
        self._threads = [threading.Thread(target=self._guarded, args=(f, name), name=name,
                                          daemon=True)
                         for f, name in ((self._serve, f"meshlab-ps-server-{self.replica}"),
                                         (partial(self._receive, first=first),
                                          f"meshlab-ps-receive-{self.replica}"))]
        for thread in self._threads:
            thread.start()

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._inbox.put(None)
        for thread in self._threads:
            thread.join(timeout=self.timeout + 10)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            self.errors.append(f"threads {alive} still blocked {self.timeout + 10:g} s after "
                               "finish()")
        self._threads, self._stopping = [], False
        self._tracers.clear()

    def _guarded(self, run: Callable[[list[str]], None], name: str) -> None:
        doing = ["starting"]  # what the thread is doing, for the error
        try:
            run(doing)
        except Exception as e:
            with self._cond:
                self.errors.append(f"{name} failed {doing[0]}: {e}")
                self._cond.notify_all()

    def _serve(self, doing: list[str]) -> None:
        """Server thread: per clock, the R gradients in worker order, a step, the version out."""
        while (item := self._inbox.get()) is not None:
            c, own, tracers = item
            messages = []
            with traced(tracers):
                for w, rank in enumerate(self.column):
                    doing[0] = f"receiving clock {c}'s gradient from replica {w} (rank {rank})"
                    if w == self.replica:
                        messages.append(own)
                        continue
                    messages.append(torch.empty_like(own))
                    dist.recv(messages[-1], src=rank, group=self.push_group)
            self.log += [(c, w, c - int(m[-1].item())) for w, m in enumerate(messages)]
            doing[0] = f"stepping clock {c}"
            self.piece.grad = mean_in_order([m[:-1] for m in messages])
            self.optimizer.step()
            new = self.piece.detach().clone()
            self._deliver(self.replica, c + 1, new)
            doing[0] = f"sending version {c + 1}"
            with traced(tracers):
                works = [dist.isend(new, dst=rank, group=self.pull_group)
                         for w, rank in enumerate(self.column) if w != self.replica]
                for work in works:
                    if work is not None:  # None: this rank is not in the group (never here)
                        work.wait()

    def _receive(self, doing: list[str], *, first: int) -> None:
        """Receiving thread: version v of every other piece, once this worker pushed v - 1
        (only then is it sure to come: no receive waits across an idle notebook)."""
        version = first
        while True:
            with self._cond:
                while self.clock < version and not self._stopping:
                    self._cond.wait()
                if self.clock < version:
                    return
                tracers = self._tracers.pop(version - 1, [])
            with traced(tracers):
                for j, rank in enumerate(self.column):
                    if j == self.replica:
                        continue
                    doing[0] = (f"receiving version {version} from replica {j}'s server "
                                f"(rank {rank})")
                    piece = self.piece.new_empty(self.bounds[j + 1] - self.bounds[j])
                    dist.recv(piece, src=rank, group=self.pull_group)
                    self._deliver(j, version, piece)
            version += 1

    def _deliver(self, j: int, version: int, piece: torch.Tensor) -> None:
        with self._cond:
            self._arrived[j][version], self._newest[j] = piece, version
            self._cond.notify_all()

    # -- layout ------------------------------------------------------------------------------

    @staticmethod
    def _flat(shards: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([s.reshape(-1) for s in shards])

    def _pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[lo:hi] for lo, hi in zip(self.bounds, self.bounds[1:], strict=False)]

    @torch.no_grad()
    def _write(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            shard = local_shard(p)
            shard.copy_(flat[offset:offset + shard.numel()].reshape(shard.shape))
            offset += shard.numel()

    def piece_map(self) -> list[torch.Tensor]:
        """Per parameter, whole: which piece (replica's server) each element belongs to (a
        collective inside the replica for sharded parameters)."""
        from torch.distributed.tensor import DTensor

        ids = torch.empty(self.numel, dtype=torch.int64, device=self.piece.device)
        for j, (lo, hi) in enumerate(zip(self.bounds, self.bounds[1:], strict=False)):
            ids[lo:hi] = j
        out, offset = [], 0
        for p in self.params:
            shape = local_shard(p).shape
            local = ids[offset:offset + shape.numel()].reshape(shape)
            offset += shape.numel()
            if isinstance(p, DTensor):
                local = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride()).full_tensor()
            out.append(local)
        return out


class ParameterServerOptimizer(torch.optim.Optimizer):
    """What build_optimizer returns for replica_sync='parameter_server': ``step()`` is this
    worker's clock; ``optimizer_class`` steps the pieces on their servers."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan, *,
                 optimizer_class: Any = torch.optim.AdamW, **args: Any) -> None:
        super().__init__([p for p in model.parameters() if p.requires_grad], dict(args))
        self.replica_sync = ParameterServerSync(model, mesh, plan, optimizer_class, args)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Push this clock's gradient; return with the parameters the next one needs."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.replica_sync.step()
        return loss


__all__ = ["ParameterServerOptimizer", "ParameterServerSync", "Traffic", "mean_in_order",
           "piece_bounds", "traffic"]
