"""From notebook to batch job: the session journal, and the torchrun script, launch.sh and
job.sbatch written from it (``%mesh export``), or from a saved notebook (``meshlab export``).

Notebook side, without IPython at import. The script it writes imports ``meshlab.runtime`` and
``meshlab.mesh``, the engine-side modules the cluster's ranks run, plus whatever the cells
import: never IPython, ipyparallel or widgets, so it runs under plain ``torchrun``.
"""

from meshlab.notebook.export.journal import Entry, ExportError, Journal
from meshlab.notebook.export.notebook import read_notebook
from meshlab.notebook.export.script import (
    Layout,
    Written,
    export,
    launch_script,
    layout,
    python,
    rescale,
    sbatch_script,
    script,
    torchrun_args,
)
from meshlab.notebook.export.selection import left_out, parse_cells, select

__all__ = ["Entry", "ExportError", "Journal", "Layout", "Written", "export", "launch_script",
           "layout", "left_out", "parse_cells", "python", "read_notebook", "rescale",
           "sbatch_script", "script", "select", "torchrun_args"]
