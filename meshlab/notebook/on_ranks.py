"""Functions the notebook sends to the engines: they run on every rank, in its namespace.

``@ipp.interactive`` makes each one's globals the rank's own namespace (where cells run), so
they read and define the names cells see. They import meshlab's rank side when they run.
"""

from __future__ import annotations

from typing import Any

import ipyparallel as ipp

CELL_REPORT = "meshlab_cell"  # what each rank publishes as a cell ends (setup_rank's hook)


@ipp.interactive
def setup_rank(cwd: str, **kwargs: Any) -> None:
    """Bootstrap the rank, publish its names, and answer probes from the control thread."""
    import os

    import meshlab.probe_server
    import meshlab.runtime

    if os.path.isdir(cwd):  # relative paths in cells mean what they mean in the notebook
        os.chdir(cwd)
    globals().update(meshlab.runtime.setup(**kwargs))
    shell = get_ipython()  # type: ignore[name-defined]  # noqa: F821  (engine namespace)
    kernel = shell.kernel
    if not getattr(kernel, "_meshlab_hooks", False):
        import pickle

        # A cell sent labelled "In[7]" runs as In [7] on the rank: its tracebacks and stacks
        # name the notebook's cell, not the rank's own count of the cells it ran. "In[7] -o"
        # also sends back the value of its last expression.
        init_metadata = kernel.init_metadata  # the kernel's first step with each request
        wanted = {"value": False}

        def numbered(parent: dict[str, Any]) -> Any:
            number, _, flag = ((parent.get("metadata") or {}).get("label") or "").partition(" ")
            if parent["header"]["msg_type"] == "execute_request":
                wanted["value"] = flag == "-o"
                if number.startswith("In[") and number[3:-1].isdigit():
                    shell.execution_count = int(number[3:-1])  # the cell reads it after this
            return init_metadata(parent)

        def report(result: Any) -> None:
            # what the notebook keeps of every cell rides on the cell's own output (before
            # its idle status): no second round trip to ask each rank afterwards
            said: dict[str, Any] = {"optimizer_steps": meshlab.runtime.optimizer_steps}
            if wanted["value"] and result.result is not None:
                try:  # pickled here, so a value that cannot travel costs only this rank's
                    said["value"] = pickle.dumps(result.result)
                except Exception as e:
                    said["unsent"] = f"{type(e).__name__}: {e}"
            shell.data_pub.publish_data({"meshlab_cell": said})  # CELL_REPORT (not in scope)

        kernel.init_metadata, kernel._meshlab_hooks = numbered, True
        shell.events.register("post_run_cell", report)
    # IPython's own record of which cell file is In [n]: stacks name cells as tracebacks do
    meshlab.probe_server.serve(kernel, shell.user_ns, shell.compile._filename_map)


@ipp.interactive
def describe(expr: str) -> Any:
    import meshlab.sharding

    return meshlab.sharding.describe(eval(expr, globals()), expr)


@ipp.interactive
def measure_memory(model: str, optimizer: str | None, inputs: str | None) -> Any:
    import meshlab.memory

    module = eval(model, globals())
    opt = eval(optimizer, globals()) if optimizer else None
    acts = meshlab.memory.activation_bytes(module, eval(inputs, globals())) if inputs else None
    return (meshlab.memory.measure(module, opt), sum(p.numel() for p in module.parameters()),
            acts)


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
    if hasattr(value, "nbytes"):  # a numpy array
        return int(value.nbytes)
    return sys.getsizeof(value)
