"""Run a schedule on the pp ranks a few slots at a time, with torch's pipeline stages.

Every rank walks its lowered action list (meshlab.schedules.validate.lower). ``advance(n)``
runs the actions of the next n slots of the schedule's grid; a slot's actions depend only
on earlier slots, so every receive a rank waits on was sent by a rank in the same or an
earlier call, and a step split into any number of advances cannot deadlock. Sends and
receives are non-blocking (isend/irecv); a compute action waits for its inputs. The
per-action semantics are those of torch's ``_PipelineScheduleRuntime``, whose helpers do the
micro-batch split and loss bookkeeping, so a stepped run computes what torch's runs do.

This is meshlab's one pipeline runtime: ``parallelize`` with a pp axis
(meshlab.parallel.pipeline.apply_pp) trains through it, and ``%mesh pipeline`` steps it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from meshlab.schedules.actions import Action, Schedule, ScheduleError
from meshlab.schedules.validate import lower, slots

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def stage_layers(n_layers: int, stage: int, stages: int,
                 starts: Sequence[int] | None = None) -> range:
    """The layer indices a stage owns: from ``starts`` (the first layer of stages 1, 2, ...)
    where given, else as even a split as the counts allow."""
    if stages > n_layers:
        raise ValueError(f"{stages} pipeline stages need at least {stages} layers, the model "
                         f"has {n_layers}: use fewer stages (lower pp, or virtual) or add "
                         "layers")
    if starts is None:
        return range(stage * n_layers // stages, (stage + 1) * n_layers // stages)
    bounds = [0, *starts, n_layers]
    return range(bounds[stage], bounds[stage + 1])


def stage_modules(model: Any, stages: list[int], total: int,
                  starts: Sequence[int] | None = None) -> dict[int, nn.Module]:
    """Views of a whole meshlab Transformer holding only each stage's layers (parameters
    shared with ``model``, so gradients land on it); stage 0 embeds, the last stage projects."""
    from meshlab.parallel.blocks import shallow_copy

    layers = cast(nn.ModuleDict, model.layers)
    names = list(layers)
    views: dict[int, nn.Module] = {}
    for stage in stages:
        # own child tables and hook registries: what fully_shard or a user attaches to one
        # stage must not fire on the others
        view = shallow_copy(model)
        keep = [names[i] for i in stage_layers(len(names), stage, total, starts)]
        view.layers = nn.ModuleDict({n: layers[n] for n in keep})
        if stage != 0:
            view.tok_embeddings = None
        if stage != total - 1:
            view.norm = None
            view.output = None
        views[stage] = view
    return views


class Executor:
    """One pipeline step of ``schedule`` on this rank's stages, run slot by slot."""

    def __init__(self, schedule: Schedule, modules: dict[int, nn.Module], mesh: DeviceMesh, *,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 axis: str = "pp", reduce_every_microbatch: bool = False) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

        from meshlab.schedules.reducing_stage import ReducingStage

        schedule.validate()
        pp = mesh[axis]
        if pp.size() != schedule.ranks:
            raise ScheduleError(f"the schedule has {schedule.ranks} ranks but the {axis} axis "
                                f"has {pp.size()}: build it with ranks={pp.size()}")
        self.schedule, self.rank, self.group = schedule, pp.get_local_rank(), pp.get_group()
        mine = schedule.stages_of(self.rank)
        if sorted(modules) != mine:
            raise ScheduleError(f"rank {self.rank} holds stages {mine} in this schedule but "
                                f"was given modules for {sorted(modules)}")
        device = next(modules[mine[0]].parameters()).device
        # reduce_every_microbatch: whole backwards only (meshlab.parallel.combinations)
        kind = ReducingStage if reduce_every_microbatch else PipelineStage
        self.stages = {s: kind(modules[s], s, schedule.stages, device, group=self.group)
                       for s in mine}
        # torch's runtime object: input split, stage set-up, loss bookkeeping, grad scaling
        self.runtime = _PipelineScheduleRuntime(list(self.stages.values()),
                                                n_microbatches=schedule.microbatches,
                                                loss_fn=loss_fn, scale_grads=True)
        self.runtime._prepare_schedule_with_comms(schedule.to_torch())  # stage -> rank map
        slot_of = slots(schedule)
        self.actions = lower(schedule)[self.rank]
        # a send runs in its producer's slot, a receive is posted by its consumer's slot
        computes = [slot_of[(a.stage, a.kind, a.microbatch)] if a.is_compute else None
                    for a in self.actions]
        self.slot_of: list[int] = []
        for i, a in enumerate(self.actions):
            if a.kind.startswith("SEND"):
                self.slot_of.append(next(c for c in reversed(computes[:i]) if c is not None))
            else:
                self.slot_of.append(next(c for c in computes[i:] if c is not None))
        self.slots = max(slot_of.values()) + 1
        self.backwards_left = Counter({s: schedule.microbatches for s in mine})
        self.position = self.clock = 0
        self.records: list[dict[str, Any]] = []
        self.losses: list[torch.Tensor] = []
        self.loss: float | None = None
        self._started = False
        self.waited = 0.0
        # run once every micro-batch's backward is in, before the optimizer steps
        self.after_backward: list[Callable[[], None]] = []

    @property
    def done(self) -> bool:
        """The step has run to its end (its loss is known)."""
        return self.loss is not None

    def begin(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> None:
        """Split the batch into micro-batches and reset the stages for a new step."""
        m = self.schedule.microbatches
        if inputs is not None and inputs.shape[0] % m:
            raise ScheduleError(f"{m} micro-batches must divide the batch of "
                                f"{inputs.shape[0]} rows: pass a batch that is a multiple of "
                                f"{m} rows, or a schedule with fewer micro-batches")
        for stage in self.stages.values():
            stage.has_backward = True
            stage.clear_runtime_states()
        self.args = [(x,) for x in inputs.tensor_split(m)] if inputs is not None else [()] * m
        self.targets = list(targets.tensor_split(m)) if targets is not None else None
        self.runtime._initialize_stages(self.args[0], {}, self.targets[0] if self.targets
                                        else None)
        self.recvs: dict[tuple[str, int, int], list[dist.Work]] = {}
        self.sends: list[list[dist.Work]] = []
        self.position = self.clock = 0
        self.records, self.losses, self.loss = [], [], None
        self.backwards_left = Counter({s: self.schedule.microbatches for s in self.stages})
        self.elapsed = 0.0
        self._started = True

    def advance(self, slots: int | None = None) -> list[dict[str, Any]]:
        """Run the next ``slots`` slots of the grid (all that remain when None); return
        what ran: action, slot, start and end in seconds of the step's own clock (time
        spent inside advance calls; start after any wait for inputs, ``wait`` says how long
        that was), and ``begin_ns``/``end_ns`` on this rank's wall clock (``time.time_ns``:
        when the action began, waits included, and ended). Each action is a span named for
        it (``1F0``, ``1SEND_F0``) in a torch.profiler trace taken meanwhile."""
        if not self._started:
            raise ScheduleError("call begin(inputs, targets) first")
        self.clock = self.slots if slots is None else min(self.slots, self.clock + slots)
        ran = []
        # the step's clock runs only inside advance(): pauses between calls do not count
        base, t0 = self.elapsed, time.perf_counter()
        while self.position < len(self.actions) and self.slot_of[self.position] < self.clock:
            action = self.actions[self.position]
            start, begin_ns = base + time.perf_counter() - t0, time.time_ns()
            self.waited = 0.0
            # a named span in a profiler's trace; without one it costs a few microseconds
            # an action, lost in the noise of a step (measured: 6 us, advance() unchanged)
            with record_function(str(action)):
                self._perform(action)
            record = {"rank": self.rank, "slot": self.slot_of[self.position],
                      "stage": action.stage, "kind": action.kind,
                      "microbatch": action.microbatch, "action": str(action),
                      "start": start + self.waited, "end": base + time.perf_counter() - t0,
                      "wait": self.waited, "begin_ns": begin_ns, "end_ns": time.time_ns()}
            ran.append(record)
            self.position += 1
        if self.clock >= self.slots and self.loss is None:  # the same call on every rank
            self._finish()
        self.elapsed = base + time.perf_counter() - t0
        self.records += ran
        return ran

    def _perform(self, a: Action) -> None:
        stage = self.stages[a.stage]
        m, runtime = a.microbatch, self.runtime
        previous_here, next_here = a.stage - 1 in self.stages, a.stage + 1 in self.stages
        if a.kind == "SEND_F":
            self.sends.append(_post(stage.get_fwd_send_ops(m)))
        elif a.kind == "SEND_B":
            self.sends.append(_post(stage.get_bwd_send_ops(m)))
        elif a.kind == "RECV_F":
            self.recvs[("F", a.stage, m)] = _post(stage.get_fwd_recv_ops(m))
        elif a.kind == "RECV_B":
            self.recvs[("B", a.stage, m)] = _post(stage.get_bwd_recv_ops(m))
        elif a.kind == "F":
            if not stage.is_first and not previous_here:
                self._wait(("F", a.stage, m))
            # the loss is taken here: torch need not keep each micro-batch's output (the
            # last stage's logits) to merge at the end
            output = stage.forward_one_chunk(m, self.args[m], {}, save_forward_output=False)
            runtime._maybe_compute_loss(stage, output, self.targets, m)
            if next_here:  # adjacent stages on one rank (V shape) hand over in memory
                self.stages[a.stage + 1].set_local_fwd_input(output, m)
        elif a.kind in ("B", "I"):
            if not stage.is_last and not next_here:
                self._wait(("B", a.stage, m))
            full = a.kind == "B"
            stage.backward_one_chunk(m, loss=runtime._maybe_get_loss(stage, m),
                                     full_backward=full, last_backward=False)
            if previous_here:
                self.stages[a.stage - 1].set_local_bwd_input(stage.get_local_bwd_output(m), m)
            if full:
                self._backward_done(a.stage)
        elif a.kind == "W":
            stage.backward_weight_one_chunk(m, last_backward=False)
            self._backward_done(a.stage)

    def _wait(self, key: tuple[str, int, int]) -> None:
        started = time.perf_counter()
        with record_function("wait for input"):
            _wait(self.recvs.pop(key))
        self.waited += time.perf_counter() - started

    def _backward_done(self, stage: int) -> None:
        self.backwards_left[stage] -= 1
        if self.backwards_left[stage] == 0:  # every micro-batch in: reduce, scale by 1/m
            self.stages[stage].perform_reduce_grad(self.schedule.microbatches)

    def _finish(self) -> None:
        while self.sends:
            _wait(self.sends.pop())
        for hook in self.after_backward:
            hook()
        self.runtime._update_losses(list(self.stages.values()), self.losses)
        # the last stage knows the loss; share it so every pp rank reports the same number
        loss = torch.zeros((), dtype=torch.float64)
        if self.losses:
            loss = torch.stack(self.losses).mean().detach().double().cpu()
        last = self.schedule.stage_to_rank[-1]
        device = next(iter(self.stages.values())).device
        loss = loss.to(device)
        dist.broadcast(loss, src=dist.get_global_rank(self.group, last), group=self.group)
        self.loss = float(loss)

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> float:
        """A whole step at once: begin, advance to the end, return the mean loss."""
        self.begin(inputs, targets)
        self.advance()
        return cast(float, self.loss)


def bind(model: Any, mesh: DeviceMesh, schedule: Schedule, *, batch: tuple[Any, Any],
         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
         axis: str = "pp") -> Executor:
    """Split ``model`` into this rank's stages of ``schedule`` and start a step on ``batch``
    (inputs, targets); advance it with ``.advance(n)``. A model that ``parallelize`` already
    split (it has ``model.pipeline``) keeps its stages and runs on its own executor."""
    from meshlab.models.llama import loss_fn as next_token_loss

    executor = getattr(model, "pipeline", None)
    if isinstance(executor, Executor):
        if executor.schedule != schedule:
            raise ScheduleError(f"the model was split for {executor.schedule.name} "
                                f"({executor.schedule.stages} stages, "
                                f"{executor.schedule.microbatches} micro-batches), not for "
                                f"{schedule.name} ({schedule.stages} stages, "
                                f"{schedule.microbatches} micro-batches): bind "
                                "model.pipeline.schedule, or parallelize a fresh model with "
                                "ParallelPlan(pipeline_schedule=...)")
    else:
        if not isinstance(getattr(model, "layers", None), nn.ModuleDict):
            raise ScheduleError(f"binding splits meshlab's Transformer; split a "
                                f"{type(model).__name__} first: model = parallelize(model, mesh, "
                                f"ParallelPlan(pipeline_schedule=...)), then bind that model")
        mine = schedule.stages_of(mesh[axis].get_local_rank())
        executor = Executor(schedule, stage_modules(model, mine, schedule.stages), mesh,
                            loss_fn=loss_fn or next_token_loss, axis=axis)
    executor.begin(*batch)
    return executor


def _post(ops: list[dist.P2POp]) -> list[dist.Work]:
    if not ops:
        return []
    # A work posted while torch.profiler runs ends its profiler event when it completes,
    # which may be after the profiler stopped (a step profiled a few slots at a time): the
    # rank then crashes (SIGSEGV/SIGABRT, torch 2.x with gloo). Post without the event.
    torch._C._autograd._enable_record_function(False)
    try:
        return dist.batch_isend_irecv(ops)
    finally:
        torch._C._autograd._enable_record_function(True)


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()
