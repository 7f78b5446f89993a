"""Lines a library logs when it is imported, dropped where meshlab runs users' cells.

torchao (meshlab's quant extra) logs its CUDA-only extensions failing to load when imported
on a machine without them, and torch a deprecation of a registration it makes; transformers
imports torchao to build any model once it is installed. Each would be a red block under
every cell that builds a model, on a rank or in the notebook's kernel. Only these patterns
are dropped, and the first only where no GPU is used (there a missing extension matters).
trio (imported by transformers' dependencies) warns when IPython already has a custom
exception handler, which `%load_ext meshlab` installs to show rank errors: it only means
trio leaves IPython's handler alone, so that warning is dropped too.
"""

from __future__ import annotations

import logging
import re
import warnings

NOISE = {"torchao": r"Failed to load .*\.so: Could not load this library",
         "torch.utils._pytree": r"is an Enum subclass and is now natively supported"}
"""logger name -> the pattern of the lines dropped from it."""
WARNINGS = {RuntimeWarning: r"IPython detected, but you already have a custom exception handler"}
"""warning category -> the pattern of the warnings dropped."""

_quieted: set[str] = set()


def quiet(*, gpu: bool) -> None:
    """Drop NOISE's lines from their loggers and WARNINGS in this process (once; ``gpu``: keep
    torchao's)."""
    for category, message in WARNINGS.items():
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, pattern in NOISE.items():
        if name in _quieted or (gpu and name == "torchao"):
            continue

        def keep(record: logging.LogRecord, pattern: str = pattern) -> bool:
            return re.search(pattern, record.getMessage()) is None

        logging.getLogger(name).addFilter(keep)
        _quieted.add(name)
