"""A dry run: one step of the user's own code on fake ranks of any world size (run.py), the
plan a layout means (plan.py), one rank's step (step.py), and what a fake world stands in
for (fake_world.py, fake_peers.py, fake_routing.py, fused_memory.py). Imports the
strategies, the planner and meshlab.measure; only the notebook side imports it.

``from meshlab.dry_run import dryrun`` (the path before this package) still works.
"""

from __future__ import annotations

import importlib
from typing import Any

_RUN = ("DryRun", "RankRun", "Traffic", "dryrun", "plan_for", "planner_beside",
        "representative_ranks", "shape_of")


def __getattr__(name: str) -> Any:
    # lazy: importing one of this package's modules does not run the whole dry run's imports
    if name in _RUN:
        return getattr(importlib.import_module("meshlab.dry_run.run"), name)
    raise AttributeError(f"module 'meshlab.dry_run' has no attribute {name!r}")
