"""Notebook-side views of plain data the ranks send: meshes, shardings, schedules."""

from meshlab.widgets.mesh import MeshView, group_table

__all__ = ["MeshView", "group_table"]
