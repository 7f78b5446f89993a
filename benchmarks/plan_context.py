"""Context parallelism in the planner: bytes per rank and layer of each implementation as
sequence and cp grow together, then which one the planner picks for 128K-token Llama 3
layouts on H100s, and why (each implementation's step, wire bytes, exposed CP time and
memory, or the reason it is refused). The planner only: no GPU, no engines.

$ python benchmarks/plan_context.py            # the tables, two fixed layouts, two searches
$ python benchmarks/plan_context.py --quick    # without the 70B search (~40 s)
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from meshlab.plan.context import cp_options
from meshlab.plan.context_formulas import CP_IMPLEMENTATIONS, context_parallel_bytes
from meshlab.plan.hardware import HARDWARE
from meshlab.plan.layout import Layout
from meshlab.plan.report import plan
from meshlab.plan.shapes import MODELS

MIB = 2**20


def bytes_table() -> None:
    """Llama 3 8B's attention (32 heads, 8 kv heads, tp=1, bf16, one sequence a micro-batch)."""
    print("bytes per rank per layer, forward + backward, MiB: message (handed to the "
          "collectives) / wire (sent)")
    print(f"{'seq':>7} {'cp':>3}  " + "  ".join(f"{i:>17}" for i in CP_IMPLEMENTATIONS))
    for seq, cp in ((32768, 2), (65536, 4), (131072, 8)):
        cells = []
        for impl in CP_IMPLEMENTATIONS:
            b = context_parallel_bytes(impl, batch=1, seq_len=seq, heads=32, kv_heads=8,
                                       head_dim=128, cp=cp, dtype_bytes=2)
            cells.append(f"{b['message'] / MIB:>8.0f}/{b['wire'] / MIB:<8.0f}")
        print(f"{seq:>7} {cp:>3}  " + "  ".join(cells))


def options(name: str, gpus: int, layout: str) -> None:
    model = dataclasses.replace(MODELS[name], seq_len=131072)
    print(f"\n{name} at 131072 tokens, {gpus} x h100-sxm, {layout}:")
    for o in cp_options(model, Layout.parse(layout), HARDWARE["h100-sxm"]):
        print(textwrap.fill(o.text(), 100, initial_indent="  ", subsequent_indent="    "))


def searched(name: str, gpus: int) -> None:
    model = dataclasses.replace(MODELS[name], seq_len=131072)
    p = plan(model, gpus=gpus, hardware_profile="h100-sxm", top=3)
    print(f"\nsearch: {name} at 131072 tokens on {gpus} x h100-sxm")
    for line in p.text().splitlines():
        print(textwrap.fill(line, 100, subsequent_indent="    "))
    for row in p.rows()[1:]:
        print(f"  next: {row['layout']}  {row['memory_gib']} GiB, step {row['step_s']} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 70B search")
    args = parser.parse_args()
    bytes_table()
    options("llama3-8b", 8, "cp=8 zero=3 ac=full")
    options("llama3-70b", 64, "tp=8 cp=2 dp=4 zero=3 ac=full")
    searched("llama3-8b", 8)
    if not args.quick:
        searched("llama3-70b", 64)


if __name__ == "__main__":
    main()
