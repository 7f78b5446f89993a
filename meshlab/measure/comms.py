"""Which collectives a cell issued, on which group, moving how many bytes.

A TorchDispatchMode sees every c10d op at the dispatcher: plain ``dist.*`` calls arrive
as ``c10d.*`` ops, DTensor redistributions as ``_c10d_functional.*`` ops. Unlike torch's
CommDebugMode (counts only), each record carries the group's ranks and computed bytes, and,
timed, when this rank issued it and when it completed here (``%%mesh --profile`` lines the
ranks' records up to find who arrived last). Plain torch; the notebook turns the records into
tables and charts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Dispatcher op names (c10d.allreduce_, _c10d_functional.all_gather_into_tensor, ...) by
# the collective they implement; first match wins, so longer names come first.
_OPS = [("reduce_scatter", "reduce_scatter"), ("allreduce", "all_reduce"),
        ("all_reduce", "all_reduce"), ("allgather", "all_gather"),
        ("all_gather", "all_gather"), ("alltoall", "all_to_all"), ("all_to_all", "all_to_all"),
        ("broadcast", "broadcast"), ("barrier", "barrier"), ("scatter", "scatter"),
        ("gather", "gather"), ("reduce", "reduce"), ("send", "send"), ("recv", "recv")]
_INPUTS = ("input", "input_tensor", "input_tensors", "inputs", "tensors", "tensor")
_OUTPUTS = ("output", "output_tensor", "output_tensors", "outputs", "out")


@dataclass(slots=True)
class CommRecord:
    """One collective as this rank issued it."""

    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, ...
    group: list[int]  # global ranks of the process group it ran on
    bytes: int  # payload: the larger of the data going in and coming out on this rank
    wire_bytes: int  # what this rank sends with ring algorithms (an estimate, not a measure)
    # timed tracing only (time.time_ns on this rank's clock; 0 when not timed):
    peer: int = -1  # send/recv: the global rank on the other end
    seq: int = -1  # how many this rank issued before on the same group (send/recv: the same
    # direction between the same two ranks, the order their messages match in)
    issued_ns: int = 0  # the call began: this rank arrived at the collective
    done_ns: int = 0  # its result was ready here (the work's future, or the wait's end)
    # the all-reduce algorithm (meshlab.measure.allreduce) whose send/recv this is, or the backend
    # ("gloo", "nccl") that ran a collective itself
    algorithm: str = ""


_running: ContextVar[str] = ContextVar("meshlab_comms_algorithm", default="")


@contextmanager
def algorithm(name: str) -> Iterator[None]:
    """Tag the send/recv issued inside as steps of the collective algorithm ``name``."""
    token = _running.set(name)
    try:
        yield
    finally:
        _running.reset(token)


def op_label(op: str, algorithm: str) -> str:
    """What a table calls a record: ``send (ring)`` for a step of a meshlab algorithm, the op
    alone (``all_reduce``) for what the backend ran itself."""
    return f"{op} ({algorithm})" if algorithm and algorithm not in dist.Backend.backend_list \
        else op


def collective_name(func_name: str) -> str | None:
    """``c10d.allreduce_`` -> ``all_reduce``; None for non-collectives like wait_tensor."""
    name = func_name.split(".")[1] if "." in func_name else func_name
    return next((op for key, op in _OPS if key in name), None)


def wire_bytes(op: str, payload: int, n: int) -> int:
    """Bytes one rank sends for a collective of ``payload`` bytes over ``n`` ranks (ring)."""
    if n <= 1 or op == "barrier":
        return 0
    if op == "all_reduce":
        return 2 * (n - 1) * payload // n  # reduce-scatter, then all-gather
    if op in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        return (n - 1) * payload // n
    return payload  # broadcast, reduce, send, recv: the whole payload passes through


class CommTracer(TorchDispatchMode):
    """Records every collective dispatched while active; ``timed`` also when each was issued
    and completed on this rank."""

    def __init__(self, *, timed: bool = False) -> None:
        super().__init__()
        self.records: list[CommRecord] = []
        self.timed = timed
        self._seq: dict[tuple[int, ...], int] = {}
        self._unwaited: dict[int, CommRecord] = {}  # functional results by storage, until waited

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if self._unwaited:
            self._wait_for_results(args, kwargs)
        if func.namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **kwargs)
        name = str(func.overloadpacket.__name__)
        op, issued = collective_name(name), time.time_ns()
        out = func(*args, **kwargs)
        if op is not None:
            record = self._note(op, func, args, kwargs)
            if self.timed:
                record.issued_ns = issued
                self._until_done(record, out)
        elif self.timed and name == "wait_tensor" and isinstance(args[0], torch.Tensor):
            waited = self._unwaited.pop(_storage(args[0]), None)
            if waited is not None:
                waited.done_ns = time.time_ns()
        return out

    def observe(self, func: Any, args: Any, kwargs: Any) -> None:
        """Record ``func`` if it is a collective: for another dispatch mode that runs the
        ops itself (a dry run's memory tracker), one mode on the stack instead of two."""
        if func.namespace in ("c10d", "_c10d_functional"):
            op = collective_name(str(func.overloadpacket.__name__))
            if op is not None:
                self._note(op, func, args, kwargs or {})

    def _note(self, op: str, func: Any, args: Any, kwargs: Any) -> CommRecord:
        record = _record(op, func, args, kwargs)
        record.seq = self._seq.get(key := call_key(dist.get_rank(), record), 0)
        self._seq[key] = record.seq + 1
        self.records.append(record)
        return record

    def _wait_for_results(self, args: Any, kwargs: Any) -> None:
        """An op about to read a functional collective's result waits for it inside the
        result's own dispatch, where this mode cannot see: wait here first (the same wait, a
        moment earlier) and note when it ended."""
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        for value in (*args, *kwargs.values()):  # ops take such results as arguments
            if isinstance(value, AsyncCollectiveTensor):
                record = self._unwaited.pop(_storage(value.elem), None)
                if record is not None:
                    torch.ops._c10d_functional.wait_tensor(value.elem)
                    record.done_ns = time.time_ns()

    def _until_done(self, record: CommRecord, out: Any) -> None:
        """Set ``record.done_ns`` when the collective completes on this rank."""
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.ScriptObject):  # c10d ops return their Work
                work = dist.distributed_c10d.Work.unbox(value)
                if work is None:  # seen with NCCL on torch 2.11: no handle to ask
                    record.done_ns = time.time_ns()  # the host's view: the call returned
                    return
                try:
                    future = work.get_future()
                except RuntimeError:  # "getFuture not implemented" (gloo's reduce_scatter),
                    record.done_ns = time.time_ns()  # whose is_completed() stays False too
                    return
                future.add_done_callback(lambda _: setattr(record, "done_ns", time.time_ns()))
                return
        # functional collectives complete at their wait_tensor (torch waits there, or earlier)
        tensors = [v for v in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(v, torch.Tensor)]
        if tensors:
            self._unwaited[_storage(tensors[0])] = record
        else:
            record.done_ns = time.time_ns()


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)


P2P = -1  # first in a send/recv's call key: (P2P, sender, receiver)


def call_key(rank: int, record: CommRecord) -> tuple[int, ...]:
    """What ``rank``'s k-th call is counted on, the same on every member: its group's ranks;
    for send/recv, (P2P, sender, receiver)."""
    if record.op == "send":
        return (P2P, rank, record.peer)
    if record.op == "recv":
        return (P2P, record.peer, rank)
    return tuple(record.group)


def _record(op: str, func: Any, args: Any, kwargs: Any) -> CommRecord:
    named = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | kwargs
    pg, group = _group_ranks(named)
    inputs = sum(_bytes(named[k]) for k in _INPUTS if k in named)
    outputs = sum(_bytes(named[k]) for k in _OUTPUTS if k in named)
    if op == "all_gather" and not outputs:  # functional: the output is not an argument
        outputs = inputs * int(named.get("group_size", len(group)))
    payload = max(inputs, outputs)
    record = CommRecord(op, group, payload, wire_bytes(op, payload, len(group)),
                        algorithm=_running.get() or _backend(pg))
    if op in ("send", "recv") and isinstance(peer := named.get("dst", named.get("src")), int):
        record.peer = dist.get_global_rank(pg, peer) if pg is not None else peer
    return record


def _group_ranks(named: dict[str, Any]) -> tuple[Any, list[int]]:
    pg = None
    if "group_name" in named:
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(named["group_name"])
    elif "process_group" in named:
        pg = dist.ProcessGroup.unbox(named["process_group"])
    try:
        return pg, sorted(dist.get_process_group_ranks(pg if pg is not None else
                                                       dist.group.WORLD))
    except (RuntimeError, ValueError):
        return pg, list(range(dist.get_world_size()))


def _backend(pg: Any) -> str:
    try:
        return str(dist.get_backend(pg))
    except (RuntimeError, ValueError):  # a group this rank is not in, or fake ones
        return ""


def _bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


_active: CommTracer | None = None


def start(*, timed: bool = False) -> None:
    """Start tracing on this rank (until stop()); the cluster calls it around a cell."""
    global _active
    stop()
    _active = CommTracer(timed=timed)
    _active.__enter__()


def stop() -> list[CommRecord]:
    """Stop tracing; the collectives issued since start()."""
    global _active
    if _active is None:
        return []
    tracer, _active = _active, None
    tracer.__exit__(None, None, None)
    return tracer.records
