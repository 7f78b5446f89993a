"""Durable state: sharded checkpoints through torch.distributed.checkpoint (sharded.py), why
a save failed (failures.py), and whose a checkpoint is with its files' checksums
(integrity.py). Imports meshlab.measure and plain torch.

``from meshlab.checkpoint import save, load`` (the path before this package) still works.
"""

from __future__ import annotations

import importlib
from typing import Any

_SHARDED = ("MANIFEST", "CheckpointError", "load", "manifest", "save", "wait")


def __getattr__(name: str) -> Any:
    if name in _SHARDED:
        return getattr(importlib.import_module("meshlab.checkpoint.sharded"), name)
    raise AttributeError(f"module 'meshlab.checkpoint' has no attribute {name!r}")
