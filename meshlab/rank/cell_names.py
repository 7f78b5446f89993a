"""A cell's file named as the notebook names it: "Cell In[7]", in stacks, post-mortems and
the debugger's answers. Plain Python."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

cell_files: Mapping[str, int] = {}  # a cell's file -> its In [n]: the kernel's record (serve)
CELL_FILE = r'[^"\s]*/ipykernel_\d+/\d+\.py'  # ipykernel's name for a cell's code


def short_paths(line: str) -> str:
    """``line`` with cells' files as "Cell In[n]" and site-packages' paths cut: the same code
    on every rank gives the same text, so stacks group across ranks."""
    line = re.sub(f'File "({CELL_FILE})"', lambda m: _cell_name(m[1], quoted=True), line)
    line = re.sub(CELL_FILE, lambda m: _cell_name(m[0], quoted=False), line)
    return re.sub(r'"[^"]*/site-packages/', '"', line)


def _cell_name(path: str, quoted: bool) -> str:
    number = cell_files.get(path)
    if number is not None:
        return f"Cell In[{number}]"
    name = f"cell {os.path.basename(path)}"
    return f'File "{name}"' if quoted else name
