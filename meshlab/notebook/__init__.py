"""The notebook side: what runs in the notebook's kernel (or a plain Python program) and
drives the ranks: the Session, the cluster of engines, cell output, widgets, charts, tables,
restore, stepping and export. It may import IPython, ipyparallel, pandas, altair and widgets;
nothing under meshlab/ outside this folder imports from it.
"""
