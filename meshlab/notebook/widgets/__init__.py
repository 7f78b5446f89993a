"""Notebook-side views of plain data the ranks send: meshes, shardings, schedules."""

from meshlab.notebook.widgets.mesh import MeshView, group_table
from meshlab.notebook.widgets.sharding import ShardingView, sharding_views

__all__ = ["MeshView", "ShardingView", "group_table", "sharding_views"]
