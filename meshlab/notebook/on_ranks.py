"""Functions the notebook sends to the engines: they run on every rank, in its namespace.

``@ipp.interactive`` makes each one's globals the rank's own namespace (where cells run), so
they read and define the names cells see. They import meshlab's rank side when they run.
"""

from __future__ import annotations

from typing import Any

import ipyparallel as ipp


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
    meshlab.probe_server.serve(shell.kernel, shell.user_ns)


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

    globals().update(meshlab.runtime.reform(generation, members))


@ipp.interactive
def newest_output(history: dict[int, Any]) -> Any:
    """Runs on a rank: the value of the last cell that had one."""
    return history[max(history)]
