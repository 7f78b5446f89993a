"""Where ``parallelize`` and ``build_optimizer`` find what lives above the strategies: each
replica mode's synchroniser (meshlab.replicas) and ``check="tiny"``'s proof
(meshlab.verify.tiny).

Named by path and imported when a plan asks for one, as a plug-in is: those modules import
meshlab.parallel, and nothing in meshlab.parallel imports them (tests/test_design.py).
"""

from __future__ import annotations

import importlib
from typing import Any

SYNCS = {
    "local_sgd": "meshlab.replicas.local_sgd:sync_for",
    "diloco": "meshlab.replicas.local_sgd:sync_for",
    "edit": "meshlab.replicas.edit:EDiTSync",
    "a_edit": "meshlab.replicas.edit:EDiTSync",
}
"""replica_sync mode -> a callable (model, mesh, plan) -> its synchroniser (``after_step``)."""

PARAMETER_SERVER = "meshlab.replicas.parameter_server:ParameterServerOptimizer"
"""The optimizer of replica_sync="parameter_server": the servers step, workers push and pull."""

TINY_PROOF = "meshlab.verify.tiny:prove"
"""check="tiny": the plan trained on a tiny copy beside one process, before the real model."""


def load(path: str) -> Any:
    """The object at ``module:name``."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
