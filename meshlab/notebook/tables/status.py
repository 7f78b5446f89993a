"""``%mesh status`` as the notebook shows it: one row per rank, its memory in one unit."""

from __future__ import annotations

import pandas as pd

from meshlab.notebook.tables.table import Table, in_byte_unit

# what each rank reports in MiB (meshlab.rank.probe_server.rank_status), as the table names it
MIB_COLUMNS = {"rss_mb": "rss", "gpu_mem_mb": "gpu allocated", "gpu_peak_mb": "gpu peak"}


def status_table(frame: pd.DataFrame) -> Table:
    """``Session.status()`` for reading: memory in the unit that fits the largest (the frame
    keeps MiB), the throttle as a slowdown factor (x1: full speed)."""
    present = {c: name for c, name in MIB_COLUMNS.items() if c in frame}
    in_bytes = frame.assign(**{c: frame[c] * 2**20 for c in present}).rename(columns=present)
    shown = in_byte_unit(in_bytes.reset_index(), list(present.values()))
    formats = dict(shown.formats)
    if "throttle" in frame:
        formats["throttle"] = lambda factor: "" if pd.isna(factor) else f"x{factor:g}"
    return Table(shown.frame, formats=formats)
