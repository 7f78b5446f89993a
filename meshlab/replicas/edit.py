"""EDiT and A-EDiT (Cheng et al. 2024, arXiv 2412.07210, ICLR 2025): DiLoCo whose replicas
synchronise block by block in the next forward, with a pseudo-gradient penalty.

The replicas are the ``dp_replicate`` axis, as for local SGD and DiLoCo
(meshlab.replicas.local_sgd); inside one, DDP or FSDP (zero2/zero3) reduce every step.

- Layer-wise sync: the sync decided after a step is taken in the next
  forward, each block's pseudo-gradient all-reduced (``async_op``) one block ahead of the
  block running, on each rank's local shards. A forward pre-hook per block, put in front of
  FSDP2's own (``prepend=True``), updates the sharded parameters before FSDP gathers them.
  The parameters outside the blocks (embeddings, final norm, head) sync before the forward
  starts, in a pre-hook of the model: FSDP's root gathers them there.
- Pseudo-gradient penalty, per block (per FSDP unit, as the authors' code does), with
  Δ_r = θ_synced - θ_r and G_r = ||Δ_r|| for replica r. Anomaly elimination: z_r = (G_r -
  μ_r) / σ_r against an EMA of replica r's earlier norms (Finch 2009: d = G - μ, μ += αd,
  σ² = (1-α)(σ² + αd²)); z_r > δ leaves r out (weight 0; its norm kept out of the EMA).
  Weighted averaging: w_r = exp(-G_r/T) / Σ_kept exp(-G_j/T), Δ = Σ w_r Δ_r. Gradient clip:
  Δ *= min(1, φ / (||Δ|| + 1e-6)). Then DiLoCo's outer step (SGD, Nesterov momentum:
  plan.outer_lr, plan.outer_momentum) on the backup, copied into the shards. Every replica
  left out: the block keeps its synchronised value.
- A-EDiT: each replica syncs once ``sync_seconds`` have passed since its last sync
  (the same sync, in the next forward), so a fast replica takes more local steps. The first
  rank of a replica decides and broadcasts it to the others. Loops run in rounds
  (``train_rounds``).

What we could not check, and chose: only the paper's abstract was retrievable here, so no
section or equation numbers are cited; the penalty's three parts (anomaly elimination,
weighted averaging, clipping) are computed as the authors' released code computes them
(dlrover atorch ``local_sgd``: OnlineDynamicEWMA, the softmax-of-negative-norm reducer,
``clip_pseudo_grad``): the EMA mean starting from 0, the variance by Welford's update on the
EMA, z-scores only after the warm-up, and the dynamic threshold (δ times the spread of the
recent z-scores, at least δ). ``Penalty``'s defaults are that code's: α=0.02, δ=3, T=1, no
clip unless φ is given (a fixed φ suits one model's scale only); the warm-up is 120 syncs
(the detector's own default is 100 updates). Left out: A-EDiT step-count weighting (off by
default there), and keeping the backup and outer momentum in host memory. Where that code
may differ still: whether a norm it leaves out joins the statistics (here: no).

EDiT's result is the same penalised DiLoCo step taken at the end of the round:
meshlab.verify.compare checks it against its one-process reference, and A-EDiT against a
replay of its logged step counts (both in meshlab.replicas.edit_replay; float64, 1e-9).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshlab.measure.memory import local_shard
from meshlab.parallel.blocks import find_blocks, items
from meshlab.replicas.edit_penalty import Penalty, Running, clip_coefficient, weigh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshlab.parallel.compose import ParallelPlan
    from meshlab.verify.training import LossFn

Batch = tuple[torch.Tensor, torch.Tensor]


def squared_norm(tensors: Sequence[torch.Tensor], copies: Sequence[int] | None = None
                 ) -> torch.Tensor:
    """Σ ||t||² in float64 (on the tensors' device), each over how many ranks hold it."""
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for i, t in enumerate(tensors):
        total += torch.linalg.vector_norm(t, dtype=torch.float64).square() / (
            copies[i] if copies else 1)
    return total


Unit = tuple[str, nn.Module | None, list[nn.Parameter]]


def units_of(model: nn.Module, blocks: str | None = None) -> list[Unit]:
    """What syncs together, in forward order: the parameters outside the blocks ("rest",
    module None), then each block: (name, module, trainable parameters)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    try:
        path, container = find_blocks(inner, blocks)
    except ValueError:
        if blocks is not None:
            raise
        # a model without repeated blocks (an MLP) syncs whole, before its forward
        return [("rest", None, [p for p in model.parameters() if p.requires_grad])]
    pairs = [(f"{path}.{key}", block, [p for p in block.parameters() if p.requires_grad])
             for key, block in items(container)]
    taken = {id(p) for _, _, ps in pairs for p in ps}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    return ([("rest", None, rest)] if rest else []) + [u for u in pairs if u[2]]


@dataclass(slots=True)
class SyncRecord:
    """One synchronisation, as every rank saw it (the scalars are all-gathered)."""

    steps: list[int]  # local steps each replica took since its previous sync
    seconds: float  # this replica's time from its previous sync to deciding this one
    weights: dict[str, list[float]] = field(default_factory=dict)  # unit -> per replica
    norms: dict[str, list[float]] = field(default_factory=dict)  # unit -> G per replica
    clipped: dict[str, float] = field(default_factory=dict)  # unit -> coefficient (< 1)


_GROUPS: weakref.WeakKeyDictionary[Any, dict[Any, tuple[Any, int]]] = \
    weakref.WeakKeyDictionary()  # by the default group: a re-formed one makes its own


def replica_group(mesh: DeviceMesh) -> tuple[Any, int]:
    """(the process group of this rank's replica, None when a replica is one rank; the
    global rank that decides for it); made once per mesh, by every rank in the same order."""
    names = list(mesh.mesh_dim_names or ())
    at = names.index("dp_replicate")
    rows = mesh.mesh.movedim(at, 0).reshape(mesh.mesh.shape[at], -1).tolist()
    if len(rows[0]) == 1:
        return None, dist.get_rank()
    made = _GROUPS.setdefault(dist.distributed_c10d._get_default_group(), {})
    key = tuple(map(tuple, rows))
    if key not in made:
        groups = [dist.new_group(row) for row in rows]  # every rank makes every replica's
        mine = next(i for i, row in enumerate(rows) if dist.get_rank() in row)
        made[key] = groups[mine], rows[mine][0]
    return made[key]


def copies_of(p: torch.Tensor, replica_size: int) -> int:
    """How many ranks of a replica hold the same local piece of ``p``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return replica_size
    mesh = p.device_mesh
    same = math.prod(mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_replicate())
    return replica_size // mesh.size() * same


def outer_sgd(params: list[torch.Tensor], plan: ParallelPlan) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum."""
    return torch.optim.SGD(params, lr=plan.outer_lr, momentum=plan.outer_momentum,
                           nesterov=plan.outer_momentum > 0)


class EDiTSync:
    """EDiT (every ``plan.sync_every`` steps) or A-EDiT (every ``plan.sync_seconds``): the
    penalised outer step, block by block in the next forward; ``finish()`` after the last
    step applies one still pending. ``history``: a SyncRecord per sync."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan,
                 penalty: Penalty | None = None) -> None:
        self.group = mesh["dp_replicate"].get_group()
        self.replicas = dist.get_world_size(self.group)
        self.replica = mesh["dp_replicate"].get_local_rank()
        self.inside, self.leader = replica_group(mesh)
        size = dist.get_world_size(self.inside) if self.inside is not None else 1
        self.every, self.seconds = plan.sync_every, plan.sync_seconds
        self.penalty = (penalty or Penalty()) if plan.pseudo_grad_penalty else None
        self.units = units_of(model, plan.blocks)
        self.backup = [[local_shard(p).detach().clone() for p in ps] for _, _, ps in self.units]
        self.outer = [outer_sgd(b, plan) for b in self.backup]
        self.running = [[Running() for _ in range(self.replicas)] for _ in self.units]
        self.copies = [[copies_of(p, size) for p in ps] for _, _, ps in self.units]
        self.device = self.backup[0][0].device
        self.steps = self.rounds = self.syncs = 0  # local steps, syncs decided, syncs done
        self.history: list[SyncRecord] = []
        self._since = self._taken = 0  # local steps since the last decision; in the round
        self._clock: float | None = None  # when this replica's round began
        self._pending: list[int] = []  # units of the decided sync not synchronised yet
        self._flight: dict[int, tuple[Any, torch.Tensor, list[float] | None]] = {}
        self._record: SyncRecord | None = None
        self.handles = [model.register_forward_pre_hook(self._before_model, prepend=True)]
        self.handles += [m.register_forward_pre_hook(partial(self._before_block, i),
                                                     prepend=True)
                         for i, (_, m, _) in enumerate(self.units) if m is not None]

    def after_step(self, *_: Any) -> None:
        """The optimizer's post-step hook: count the step, decide whether to sync."""
        self.steps, self._since = self.steps + 1, self._since + 1
        self._clock = time.monotonic() if self._clock is None else self._clock
        if not self._due():
            return
        self.finish()  # a sync the last forward did not carry through every block
        self.rounds += 1
        self._record = SyncRecord([self._since] * self.replicas,
                                  time.monotonic() - self._clock)
        self._taken, self._since = self._since, 0  # gathered from every replica at the sync
        self._pending = list(range(len(self.units)))

    def finish(self) -> None:
        """Apply a sync still pending (after the last step: the final parameters are the
        synchronised ones, as DiLoCo's are after a sync step)."""
        with torch.no_grad():
            while self._pending:
                self._end(self._pending[0])

    def check_fixed_steps(self, steps: int) -> None:
        """ValueError where a loop of ``steps`` fixed steps cannot end on every replica
        together (A-EDiT: replicas take different numbers of steps)."""
        if self.seconds is not None:
            raise ValueError(
                f"replica_sync='a_edit' trained on a fixed list of {steps} batches: each "
                f"replica syncs every sync_seconds={self.seconds}, taking as many steps as "
                "fit, so a fixed-length loop leaves the fast replicas waiting at a sync the "
                "slow ones never reach. Train in rounds: meshlab.replicas.edit.train_rounds("
                "model, optimizer, next_batch, rounds), next_batch(local_step) giving this "
                "rank's batch")

    def _due(self) -> bool:
        if self.seconds is None:
            return self.steps % self.every == 0
        assert self._clock is not None
        decide = torch.tensor([time.monotonic() - self._clock >= self.seconds],
                              device=self.device)
        if self.inside is not None:  # the replica's ranks must agree: its first one decides
            dist.broadcast(decide, src=self.leader, group=self.inside)
        return bool(decide.item())

    def _before_model(self, module: nn.Module, args: Any) -> None:
        self._clock = time.monotonic() if self._clock is None else self._clock
        if self._pending:
            with torch.no_grad():
                first = self._pending[0]
                self._begin(first)
                if self.units[first][1] is None:  # the rest: needed before anything runs
                    if len(self._pending) > 1:
                        self._begin(self._pending[1])
                    self._end(first)

    def _before_block(self, index: int, module: nn.Module, args: Any) -> None:
        if index in self._pending:
            with torch.no_grad():
                at = self._pending.index(index)
                if at + 1 < len(self._pending):  # the next block's sync runs meanwhile
                    self._begin(self._pending[at + 1])
                self._end(index)

    def _begin(self, index: int) -> None:
        """The block's pseudo-gradient, its norms gathered and weighed, and the weighted
        all-reduce issued (asynchronously)."""
        if index in self._flight:
            return
        record, (name, _, params) = self._record, self.units[index]
        assert record is not None
        flat = torch.cat([(b - local_shard(p)).reshape(-1)
                          for b, p in zip(self.backup[index], params, strict=True)])
        weights = None
        if self.penalty is not None or self.seconds is not None:  # a few scalars per block
            square = squared_norm(flat.split([b.numel() for b in self.backup[index]]),
                                  self.copies[index])
            if self.inside is not None:
                dist.all_reduce(square, group=self.inside)
            mine = torch.stack([square.sqrt(), torch.full_like(square, self._taken)])
            gathered = [torch.empty_like(mine) for _ in range(self.replicas)]
            dist.all_gather(gathered, mine, group=self.group)
            norms = [float(g[0]) for g in gathered]
            record.steps = [int(g[1]) for g in gathered]
            if self.penalty is not None:
                weights = weigh(norms, self.running[index], self.penalty)
                record.norms[name], record.weights[name] = norms, weights
                if not any(weights):  # every replica left out, on every rank: no collective
                    self._flight[index] = (None, flat, weights)
                    return
                w = weights[self.replica]
                flat.mul_(w) if w else flat.zero_()  # 0 * inf would poison the sum
        self._flight[index] = (dist.all_reduce(flat, group=self.group, async_op=True), flat,
                               weights)

    def _end(self, index: int) -> None:
        """Wait for the block's all-reduce, clip, step the outer optimizer, copy in."""
        self._begin(index)
        work, flat, weights = self._flight.pop(index)
        backup = self.backup[index]
        if work is not None:
            work.wait()
            if weights is None:
                flat /= self.replicas
            pieces = flat.split([b.numel() for b in backup])
            if self.penalty is not None and self.penalty.clip is not None:
                square = squared_norm(pieces, self.copies[index])
                if self.inside is not None:
                    dist.all_reduce(square, group=self.inside)
                coefficient = clip_coefficient(float(square.sqrt()), self.penalty)
                if coefficient < 1:
                    flat.mul_(coefficient)
                    assert self._record is not None
                    self._record.clipped[self.units[index][0]] = coefficient
            for b, piece in zip(backup, pieces, strict=True):
                b.grad = piece.view_as(b)
            self.outer[index].step()
            for b in backup:
                b.grad = None
        for p, b in zip(self.units[index][2], backup, strict=True):
            local_shard(p).copy_(b)
        self._pending.remove(index)
        if not self._pending:
            assert self._record is not None
            self.history.append(self._record)
            self.syncs += 1
            self._record, self._clock = None, time.monotonic()


def train_rounds(model: nn.Module, optimizer: torch.optim.Optimizer,
                 next_batch: Callable[[int], Batch], rounds: int, *,
                 loss: LossFn | None = None) -> list[float]:
    """Train until this replica has decided ``rounds`` syncs, then apply the last one: the
    loop A-EDiT needs (its replicas take different numbers of steps; every one syncs
    ``rounds`` times, so none waits for ever). ``next_batch(local_step)`` gives this rank's
    batch; returns this rank's losses, one per local step. EDiT works too (rounds of H)."""
    from meshlab.verify.training import next_token_loss

    sync = getattr(optimizer, "replica_sync", None)
    if not isinstance(sync, EDiTSync):
        raise ValueError("train_rounds trains an optimizer build_optimizer made with "
                         "replica_sync='edit' or 'a_edit' (it counts their rounds); got "
                         f"{type(optimizer).__name__} without one: use verify.train instead")
    losses = []
    while sync.rounds < rounds:
        optimizer.zero_grad()
        value = (loss or next_token_loss)(model, next_batch(sync.steps))
        value.backward()
        optimizer.step()
        losses.append(value.item())
    sync.finish()
    return losses
