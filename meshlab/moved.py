"""Import paths that moved, kept working: ``import meshlab.comms`` gives the module now at
``meshlab.measure.comms`` (the same module object: one state, one set of functions).

Installed by ``meshlab/__init__`` as a finder on ``sys.meta_path``; new code imports the new
paths (tests/test_design.py checks that none inside meshlab uses an old one).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

MOVED = {
    **{f"meshlab.{name}": f"meshlab.measure.{name}" for name in (
        "sharding", "comms", "memory", "profiling", "timing", "throttle",
        "activation_layout", "allreduce")},
    **{f"meshlab.parallel.{name}": f"meshlab.replicas.{name}" for name in (
        "local_sgd", "edit", "edit_penalty", "edit_replay", "parameter_server",
        "parameter_server_replay")},
    "meshlab.parallel.verify": "meshlab.verify.compare",
    **{f"meshlab.parallel.{name}": f"meshlab.verify.{name}" for name in (
        "reference_run", "reused_references", "float64_variant", "tiny", "training")},
}


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path in MOVED and hands back the module at its new one."""

    def __init__(self) -> None:
        self.own_specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        self.own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the old path's spec on it: the module keeps its own
        module.__spec__ = self.own_specs[module.__name__]


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
