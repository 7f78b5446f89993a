"""Functions the notebook sends to the engines: they run on every rank, in its namespace.

``@ipp.interactive`` makes each one's globals the rank's own namespace (where cells run), so
they read and define the names cells see. They import meshlab's rank side when they run.
"""

from __future__ import annotations

from typing import Any

import ipyparallel as ipp


@ipp.interactive
def setup_rank(cwd: str, cells: str, cells_key: bytes, **kwargs: Any) -> None:
    """Bootstrap the rank, publish its names, listen for cells at ``cells`` (the notebook's
    channel, whose key ``cells_key`` came over the controller's encrypted channel) and
    answer probes from the control thread."""
    import os

    import meshlab.rank.cell_server
    import meshlab.rank.debugger
    import meshlab.rank.probe_server
    import meshlab.runtime

    if os.path.isdir(cwd):  # relative paths in cells mean what they mean in the notebook
        os.chdir(cwd)
    globals().update(meshlab.runtime.setup(**kwargs))
    shell = get_ipython()  # type: ignore[name-defined]  # noqa: F821  (engine namespace)
    meshlab.rank.cell_server.serve(shell, cells, kwargs["rank"], cells_key)
    # IPython's own record of which cell file is In [n]: stacks name cells as tracebacks do
    meshlab.rank.probe_server.serve(shell.kernel, shell.user_ns, shell.compile._filename_map)
    meshlab.rank.debugger.install()  # breakpoint() in a cell stops for the notebook's pdb


@ipp.interactive
def describe(expr: str) -> Any:
    import meshlab.measure.sharding

    # the namespace's modules name the tensor in the whole model; its `mesh` places the rank
    return meshlab.measure.sharding.describe(eval(expr, globals()), expr, globals())


@ipp.interactive
def measure_memory(model: str, optimizer: str | None, inputs: str | None) -> Any:
    import meshlab.measure.memory

    module = eval(model, globals())
    opt = eval(optimizer, globals()) if optimizer else None
    acts = (meshlab.measure.memory.activation_placement(module, eval(inputs, globals())) if inputs
            else None)
    memory = meshlab.measure.memory
    return memory.measure(module, opt), memory.tp_rank_params(module), acts


@ipp.interactive
def start_memory() -> str:
    import meshlab.measure.memory_timeline

    # the models and optimizers the cell can reach by name are what it tracks
    return meshlab.measure.memory_timeline.start(globals())


@ipp.interactive
def build_mesh(spec: Any) -> None:
    import meshlab.mesh

    globals()["mesh"] = meshlab.mesh.build(spec)


@ipp.interactive
def regroup_rank(generation: int, members: list[int] | None) -> None:
    import meshlab.runtime

    globals().pop("mesh", None)  # its groups are going; the cluster builds it anew if it fits
    globals().update(meshlab.runtime.reform(generation, members))


def group_state() -> tuple[bool, int]:
    """Runs on a rank: whether it has a default process group, and how many groups it has
    made since (ranks that made different numbers deadlock in the next new_group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    return dist.is_initialized(), int(distributed_c10d._world.group_count)


@ipp.interactive
def nbytes(name: str) -> int | None:
    """Runs on a rank: about how many bytes pulling ``name`` copies (None: not defined)."""
    import sys

    if name not in globals():
        return None
    value = globals()[name]
    if hasattr(value, "numel") and hasattr(value, "element_size"):  # a tensor
        return int(value.numel() * value.element_size())
    if isinstance(getattr(value, "nbytes", None), int):  # a numpy array (not a field of that name)
        return int(value.nbytes)
    return sys.getsizeof(value)


def set_throttle(factor: float | None) -> float:
    """Runs on a rank: slow its compute ``factor`` times (1: full speed; None: leave it as it
    is) until changed (meshlab.measure.throttle); its factor now."""
    import meshlab.measure.throttle

    if factor is not None:
        meshlab.measure.throttle.throttle(factor)
    return meshlab.measure.throttle.current_factor()
