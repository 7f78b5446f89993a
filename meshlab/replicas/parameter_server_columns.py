"""The parameter server's pieces and columns (meshlab.replicas.parameter_server): how a
rank's flattened shards are cut into one piece per replica, what a clock sends, the column
of ranks that serve each other with its push and pull groups, and its threads' traffic
traced beside the worker's."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshlab.measure.comms import CommTracer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(slots=True)
class Traffic:
    """Bytes one rank moves per clock over its column's groups."""

    pushed: int  # its gradient's other pieces, with their version headers, to their servers
    pulled: int  # those pieces' new versions, from their servers
    collected: int  # its server's: the other workers' gradients of its piece
    served: int  # its server's: the new version of its piece, to the other workers

    @property
    def sent(self) -> int:
        """What this rank sends per clock."""
        return self.pushed + self.served

    @property
    def received(self) -> int:
        """What this rank receives per clock."""
        return self.pulled + self.collected


def traffic(numel: int, replicas: int, replica: int, itemsize: int) -> Traffic:
    """Bytes per clock of the rank serving piece ``replica`` of a shard of ``numel``
    elements of ``itemsize`` bytes (the module's formula)."""
    bounds = piece_bounds(numel, replicas)
    n, others = bounds[replica + 1] - bounds[replica], replicas - 1
    return Traffic(pushed=(numel - n + others) * itemsize, pulled=(numel - n) * itemsize,
                   collected=others * (n + 1) * itemsize, served=others * n * itemsize)


def piece_bounds(numel: int, replicas: int) -> list[int]:
    """Where the flattened shard is cut: piece j is [bounds[j], bounds[j + 1])."""
    return [numel * j // replicas for j in range(replicas + 1)]


def mean_in_order(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The mean, summed in list order: the servers and the replay round alike."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total.div_(len(tensors))


def column_groups(mesh: DeviceMesh) -> tuple[list[int], Any, Any, float]:
    """This rank's column (global ranks by replica), its push and pull groups and their
    timeout in seconds. Every rank makes every column's groups, in one order, as
    dist.new_group requires; they time out like the mesh's own groups."""
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" not in names:
        raise ValueError(f"the parameter server runs over the dp_replicate axis of the root "
                         f"mesh, and this mesh has axes {names}: pass the mesh %mesh init made")
    axis = names.index("dp_replicate")
    columns = mesh.mesh.movedim(axis, -1).reshape(-1, mesh.mesh.shape[axis]).tolist()
    timeout = _timeout(mesh["dp_replicate"].get_group(), mesh.device_type)
    me, mine = dist.get_rank(), None
    for column in columns:
        groups = [dist.new_group(column, timeout=datetime.timedelta(seconds=timeout))
                  for _ in ("push", "pull")]
        if me in column:
            mine = (column, *groups, timeout)
    if mine is None:
        raise RuntimeError(f"rank {me} is in no column of the mesh {columns}: pass the mesh "
                           "this rank was built in")
    return mine


def _timeout(group: Any, device_type: str) -> float:
    try:
        return float(group._get_backend(torch.device(device_type)).options._timeout
                     .total_seconds())
    except (AttributeError, RuntimeError):  # torch's default, as for any new group
        from torch.distributed.constants import default_pg_timeout

        return default_pg_timeout.total_seconds()


def tracers_active() -> list[CommTracer]:
    """The comms tracers active on this thread (%%mesh --comms), for the server's threads."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, CommTracer)]


@contextmanager
def traced(tracers: list[CommTracer]) -> Iterator[None]:
    """A thread's sends and receives into the worker's tracers (dispatch modes are per
    thread: %%mesh --comms would not see the server's traffic otherwise)."""
    with ExitStack() as stack:
        for tracer in tracers:
            mirror = CommTracer(timed=tracer.timed)
            mirror.records = tracer.records
            stack.enter_context(mirror)
        yield
