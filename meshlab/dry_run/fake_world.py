"""What one process needs to measure one rank's training step of a world it does not have.

A dry run (meshlab.dry_run.run) runs a rank's real program on torch's fake process group and
fake tensors: collectives return at once and tensors have shapes but no values. What
stands in for the peers is meshlab.dry_run.fake_peers, for values meshlab.dry_run.fake_routing;
this module is the memory tracker that takes what meshlab builds (``step_tracker``): torch's
FSDP tracker takes one FSDP root called once, and a pipeline rank holds several roots, each
called once per micro-batch; both trackers also keep each category's own peak.

Plain torch, rank side.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import torch

# torch's memory trackers import torch._dynamo, which imports triton: on a machine without a
# GPU, choose Triton's interpreter first, as meshlab.kernels does (its mode is fixed then)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch import nn
from torch.distributed._tools import fsdp2_mem_tracker as _fsdp_tracker
from torch.distributed._tools import mem_tracker as _tracker
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import _TOTAL_KEY as _TOTAL
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultAllocMixin,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import SUPPORTED_NODES, tree_map_only

from meshlab.measure.tracked_gradients import GradientsInGrad


class _Propagating:
    """Whether DTensor is inferring an op's output shape: it runs the op on fake tensors of
    the global shape (under the dry run's own fake mode, where torch's tracker would count
    them: a whole-vocabulary embedding gradient on every tp rank)."""

    depth = 0


_propagating = _Propagating()


@contextlib.contextmanager
def dtensor_inference_untracked() -> Iterator[None]:
    """Within: DTensor's output-shape inference is not counted (see ``_Propagating``)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    infer = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        _propagating.depth += 1
        try:
            return infer(self, *args, **kwargs)
        finally:
            _propagating.depth -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = infer  # type: ignore[method-assign]


class _CategoryPeaks:
    """Each category's largest value over the forward and backward, beside the tracker's
    peak of the total: torch's own categories (``peaks``) and the groups of them ``groups``
    names (``group_peaks``: the planner's categories, meshlab.dry_run.step says which is
    which). The optimizer step's temporaries are left out: states are what the planner
    counts, and they exist before the step."""

    peaks: dict[str, int]
    group_peaks: dict[str, int]
    groups: dict[str, str]
    comms: Any
    window: Any
    """The running action's meshlab.dry_run.compose.Window, shown what this sees."""

    def _start_peaks(self, groups: dict[str, str], comms: Any) -> None:
        self.peaks, self.group_peaks, self.groups, self.comms = {}, {}, groups, comms
        self.window, self._provisional = None, False

    def __enter__(self) -> Any:
        # torch's trackers visit an op's outputs with pytree's tree_map_only, which also
        # builds a mapped copy they drop: a tenth of a large step's time
        for module in (_fsdp_tracker, _tracker):
            module.tree_map_only = _visit_tensors  # type: ignore[attr-defined]
        return super().__enter__()  # type: ignore[misc]

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)  # type: ignore[misc]
        finally:
            if not self._depth:  # type: ignore[attr-defined]
                for module in (_fsdp_tracker, _tracker):
                    module.tree_map_only = tree_map_only  # type: ignore[attr-defined]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if _propagating.depth:  # DTensor's shape inference: no device memory in a real run
            return func(*args, **(kwargs or {}))
        out = super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]
        if self.comms is not None:  # the collectives too: a second mode costs a sixth
            self.comms.observe(func, args, kwargs)
        return out

    def _update_snap(self, u_type: Any, *args: Any, **kwargs: Any) -> None:
        super()._update_snap(u_type, *args, **kwargs)  # type: ignore[misc]
        # a total only falls; the optimizer step's temporaries are its own (states excepted)
        if u_type.name == "DEL" or self._in_opt or self._provisional:  # type: ignore[attr-defined]
            return
        for snapshot in self._curr_mem_snap.values():  # type: ignore[attr-defined]
            summed: dict[str, int] = {}
            for key, value in snapshot.items():
                name = getattr(key, "value", key)
                if value > self.peaks.get(name, 0):
                    self.peaks[name] = value
                group = self.groups.get(name)
                if group is not None:
                    summed[group] = summed.get(group, 0) + value
            for group, value in summed.items():
                if value > self.group_peaks.get(group, 0):
                    self.group_peaks[group] = value
            if self.window is not None:  # the running action's own group peaks
                self.window.see_groups(summed)

    def _update_peak_stats(self, peak_state: Any) -> None:
        if self._provisional:
            return
        # torch's version also keeps every module's own peak, walking all of them after
        # every op (a fifth of a large step's time); a dry run wants the step's peak only
        for device, snapshot in self._curr_mem_snap.items():  # type: ignore[attr-defined]
            total = snapshot[_TOTAL]
            if self._peak_mem.get(device, 0) < total:  # type: ignore[attr-defined]
                self._peak_mem[device] = total  # type: ignore[attr-defined]
                self._peak_mem_snap[device] = dict(snapshot)  # type: ignore[attr-defined]
        if self.window is not None:
            self.window.see_op(self._curr_mem_snap)  # type: ignore[attr-defined]

    def snapshot(self) -> dict[str, int]:
        """torch's categories at the step's peak (all devices: a CPU rank has one)."""
        from meshlab.dry_run.compose import flat

        return flat(self.get_tracker_snapshot("peak"))  # type: ignore[attr-defined]


def _visit_tensors(kind: type, fn: Any, tree: Any) -> Any:
    """``fn`` on each tensor in ``tree`` (an op's outputs, a module's inputs), as torch's
    trackers call ``tree_map_only(torch.Tensor, fn, tree)`` for its calls only."""
    if isinstance(tree, torch.Tensor):
        fn(tree)
    elif isinstance(tree, (tuple, list)):
        for item in tree:
            _visit_tensors(kind, fn, item)
    elif isinstance(tree, dict):
        for item in tree.values():
            _visit_tensors(kind, fn, item)
    elif type(tree) in SUPPORTED_NODES:  # another container pytree knows (an OrderedDict)
        tree_map_only(kind, fn, tree)
    return tree


class _FSDPRoots(FSDPModule, nn.ModuleList):
    """Several FSDP roots (a pipeline rank's stages) as one module for the tracker, which
    asks every FSDP module for its parameter group: this one has none of its own."""

    def _get_fsdp_state(self) -> Any:
        return SimpleNamespace(_fsdp_param_group=None)


class FSDPStepTracker(_CategoryPeaks, FSDPMemTracker):
    """torch's FSDP2 memory tracker over several roots, each called once per micro-batch."""

    def __init__(self, roots: Sequence[nn.Module], optimizer: torch.optim.Optimizer,
                 groups: dict[str, str], comms: Any = None) -> None:
        root = roots[0]
        if len(roots) > 1:  # FSDPModule's __new__ makes a plain ModuleList: cast it after
            root = nn.ModuleList(roots)
            root.__class__ = _FSDPRoots
        super().__init__(root, optimizer)
        self._start_peaks(groups, comms)

    def _fsdp_state_pre_forward(self, fsdp_mod: Any, orig: Any) -> Any:
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

        def each_microbatch(*args: Any, **kwargs: Any) -> Any:
            # torch's tracker refuses a root's second forward (it takes it for a second
            # step); a pipeline runs one per micro-batch: a fresh record for each
            if not self._mod_tracker.is_bw:
                self.memory_tracking.pop(fsdp_mod, None)
            return inner(*args, **kwargs)

        return each_microbatch

    def _fsdp_param_group_post_backward(self, fsdp_mod: Any, orig: Any) -> Any:
        inner = super()._fsdp_param_group_post_backward(fsdp_mod, orig)

        def labelled(*args: Any, **kwargs: Any) -> Any:
            self._accumulating = True
            try:
                out = inner(*args, **kwargs)
            finally:
                self._accumulating = False
            # without gradient sync (a pipeline's micro-batches) and with mixed precision,
            # FSDP2 accumulates the unsharded gradients in the reduce dtype, beside .grad,
            # where torch's tracker does not look: they are unsharded gradients all the same
            group = fsdp_mod._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group else ():
                kept = getattr(param, "unsharded_accumulated_grad", None)
                if kept is not None:
                    self._update_and_maybe_create_winfos(kept, _FSDPRefType.UNSHARDED_GRAD)
            return out

        return labelled

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        # what FSDP2's post-backward allocates is gradients (the fp32 accumulators, the
        # reduce-scatter's input), not a temporary of the model's backward, nor an
        # activation where a pipeline calls it after the last backward
        if (reftype in (_FSDPRefType.TEMP, _FSDPRefType.ACT)
                and getattr(self, "_accumulating", False)):
            reftype = _FSDPRefType.UNSHARDED_GRAD
        super()._track(reftype, t)

    def __enter__(self) -> Any:
        def allocate(comm: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            return self._all_gather_output(comm, *args, **kwargs)

        DefaultAllGather.allocate = allocate  # type: ignore[method-assign,assignment]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        if "allocate" in DefaultAllGather.__dict__:
            del DefaultAllGather.allocate

    def _all_gather_output(self, comm: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """FSDP2's all-gather output, labelled as one when it is made. torch's tracker
        labels it at the collective, some ops later: until then it counts as a temporary
        (in the forward, an activation), and a category's peak taken in between counts a
        whole unit's gathered weights as activations (2.7 GiB of a Mixtral-like layer in
        bf16)."""
        self._provisional = True  # no category's peak under the wrong label
        try:
            out = DefaultAllocMixin.allocate(comm, *args, **kwargs)
        finally:
            self._provisional = False
        self._update_and_maybe_create_winfos(out, _FSDPRefType.ALL_GATHER, update_existing=True)
        self._update_peak_stats(None)
        return out


class StepTracker(_CategoryPeaks, GradientsInGrad, MemTracker):
    """torch's memory tracker for a model without FSDP (DDP, ZeRO-1, TP or EP alone)."""

    def __init__(self, modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer,
                 groups: dict[str, str], comms: Any = None) -> None:
        super().__init__()
        self._start_peaks(groups, comms)
        # ZeRO-1 (ZeroRedundancyOptimizer) keeps its states in the optimizer it wraps
        inner = getattr(optimizer, "optim", None)
        wrapped = [inner] if isinstance(inner, torch.optim.Optimizer) else []
        self.track_external(*modules, optimizer, *wrapped)
        self.watch_gradients([p for m in modules for p in m.parameters() if p.requires_grad])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        first = args[0] if args else None
        first = first[0] if isinstance(first, (list, tuple)) and first else first  # collectives'
        if (type(first) is not DTensor and isinstance(first, torch.Tensor)
                and (func._schema.is_mutable or not isinstance(first, FakeTensor))
                and first.untyped_storage() not in self._WINFO):
            # written, viewed or reduced, made before the step (DDP's buckets, real tensors
            # ddp_without_peers counts, whose fake copies would count each bucket again)
            out = func(*args, **(kwargs or {}))
            if self.comms is not None:  # DDP's all-reduce still moves its bytes
                self.comms.observe(func, args, kwargs)
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        # torch's tracker refuses a root's second forward (it takes it for a second step);
        # gradient accumulation runs one per micro-batch: a fresh record for each
        name = self._mod_tracker.get_known_fqn(module)
        if (not self._mod_tracker.is_bw and module in self.memory_tracking
                and set(self._mod_tracker.parents) - {name} == {"Global"}):
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


def step_tracker(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer,
                 groups: dict[str, dict[str, str]], comms: Any = None
                 ) -> FSDPStepTracker | StepTracker:
    """The tracker for these modules (a rank's model, or its pipeline stages);
    ``groups["fsdp"]`` or ``groups["plain"]`` groups its categories; ``comms`` (a
    meshlab.measure.comms.CommTracer, not entered) records the collectives it sees."""
    if all(isinstance(m, FSDPModule) for m in modules):
        return FSDPStepTracker(modules, optimizer, groups["fsdp"], comms)
    return StepTracker(modules, optimizer, groups["plain"], comms)

