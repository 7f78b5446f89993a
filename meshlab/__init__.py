"""meshlab: see and try how a model is split across GPUs, from one notebook.

``%load_ext meshlab`` registers the ``%mesh`` magics; ``meshlab.Cluster`` is the same
thing from a plain Python program.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Cluster", "ClusterError", "MeshError", "bench", "calibrate_profile",
           "load_ipython_extension", "unload_ipython_extension"]

if TYPE_CHECKING:
    from meshlab.calibration import calibrate_profile
    from meshlab.cluster import Cluster, ClusterError
    from meshlab.kernels.bench import bench
    from meshlab.output import MeshError


def __getattr__(name: str) -> Any:
    # Lazy: ranks import meshlab.runtime without pulling in ipyparallel or pandas.
    if name in ("Cluster", "ClusterError"):
        from meshlab import cluster

        return getattr(cluster, name)
    if name == "bench":  # engine side: a kernel benchmark on this rank
        from meshlab.kernels.bench import bench

        return bench
    if name == "calibrate_profile":  # notebook side: measure a cluster, write a profile
        from meshlab.calibration import calibrate_profile

        return calibrate_profile
    if name == "MeshError":
        from meshlab.output import MeshError

        return MeshError
    raise AttributeError(f"module 'meshlab' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext meshlab``."""
    from meshlab.extension import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext meshlab``."""
    from meshlab.extension import unload_ipython_extension as unload

    unload(ipython)
