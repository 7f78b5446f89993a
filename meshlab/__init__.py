"""meshlab: see and try how a model is split across GPUs, from one notebook.

``%load_ext meshlab`` registers the ``%mesh`` magics; ``meshlab.Session`` does the same
things from a plain Python program.

The path of a module says where it runs: ``meshlab/notebook/`` in the notebook's kernel,
everything else on the ranks (and in exported torchrun scripts).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from meshlab import moved

moved.install()  # old import paths (meshlab.comms, meshlab.parallel.verify, ...) keep working

__version__ = "0.1.0"
__all__ = ["Cluster", "ClusterError", "MeshError", "ParallelPlan", "Session", "SessionError",
           "bench", "calibrate_profile", "dryrun", "load_ipython_extension", "load_pretrained",
           "parallelize", "save_pretrained", "unload_ipython_extension"]

if TYPE_CHECKING:
    from meshlab.dry_run.run import dryrun
    from meshlab.kernels.bench import bench
    from meshlab.notebook.calibrate import calibrate_profile
    from meshlab.notebook.cluster import Cluster, ClusterError
    from meshlab.notebook.output import MeshError
    from meshlab.notebook.session import Session, SessionError
    from meshlab.parallel import ParallelPlan, parallelize

# Lazy: ranks import meshlab.runtime without pulling in ipyparallel or pandas.
_LAZY = {
    "Session": "meshlab.notebook.session",
    "SessionError": "meshlab.notebook.session",
    "Cluster": "meshlab.notebook.cluster",
    "ClusterError": "meshlab.notebook.cluster",
    "MeshError": "meshlab.notebook.output",
    "calibrate_profile": "meshlab.notebook.calibrate",  # measure a cluster, write a profile
    "bench": "meshlab.kernels.bench",  # rank side: a kernel benchmark on this rank
    "ParallelPlan": "meshlab.parallel",
    "parallelize": "meshlab.parallel",
    "load_pretrained": "meshlab.pretrained",  # rank side: a save_pretrained folder into shards
    "save_pretrained": "meshlab.pretrained",  # rank side: the shards out as one such folder
    "dryrun": "meshlab.dry_run.run",  # one step of a layout on fake ranks, in this process
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'meshlab' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext meshlab``."""
    from meshlab.extension import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext meshlab``."""
    from meshlab.extension import unload_ipython_extension as unload

    unload(ipython)
