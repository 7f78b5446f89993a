"""Bytes a flood of printed lines costs the notebook: `%%mesh` beside the kernel printing it.

A real IPython shell with `%load_ext meshlab` drives 4 CPU ranks; each prints N lines. Every
display message meshlab publishes (new outputs and in-place updates, as a kernel would send
them, JSON-encoded) is counted, beside the bytes of the stream messages a kernel sends when it
prints the same lines itself (4 x N lines, once). Printed: both byte counts, their ratio, the
text the ranks printed and the bytes the cell kept on the notebook side.

$ python benchmarks/output_flood.py                 # 4 ranks x 20,000 lines
$ python benchmarks/output_flood.py --lines 200000
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from IPython.core.displaypub import DisplayPublisher
from IPython.testing.globalipapp import start_ipython

from meshlab import Cluster

PROFILE = """
[cluster]
launcher = "local"
backend = "gloo"
pg_timeout = 30
start_timeout = 180
"""
LINE = "step {i:>6} loss 2.72"


class CountingPublisher(DisplayPublisher):
    """Counts the JSON bytes of every display message (as ipykernel would send them)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bytes = self.messages = 0

    def publish(self, data: Any, metadata: Any = None, source: Any = None, *,
                transient: Any = None, update: bool = False) -> None:
        self.messages += 1
        self.bytes += len(json.dumps({"data": data, "metadata": metadata or {},
                                      "transient": transient or {}}))

    def clear_output(self, wait: bool = False) -> None:
        self.messages += 1
        self.bytes += len(json.dumps({"wait": wait}))


def kernel_bytes(ranks: int, lines: int) -> int:
    """A kernel printing the lines itself: stream messages of the text, flushed in chunks of
    about 64 KB (ipykernel batches stdout)."""
    text = "".join(LINE.format(i=i) + "\n" for i in range(lines)) * ranks
    chunk = 64 * 1024
    return sum(len(json.dumps({"name": "stdout", "text": text[i:i + chunk]}))
               for i in range(0, len(text), chunk))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=20_000, help="lines each rank prints")
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    profile = Path(tempfile.mkdtemp()) / "flood.toml"
    profile.write_text(PROFILE)
    shell = start_ipython()
    shell.run_line_magic("load_ext", "meshlab")
    session = shell.magics_manager.registry["MeshMagics"].session
    with Cluster(args.ranks, profile=profile) as cluster:
        session.cluster = cluster
        counter = CountingPublisher(shell=shell)
        shell.display_pub = counter
        started = time.perf_counter()
        outcome = shell.run_cell(f"%%mesh\nfor i in range({args.lines}):\n"
                                 f"    print({LINE!r}.format(i=i))")
        seconds = time.perf_counter() - started
        session.cluster = None
        if not outcome.success:
            raise SystemExit(f"the cell failed: {outcome.error_in_exec!r}")
    printed = args.ranks * sum(len(LINE.format(i=i)) + 1 for i in range(args.lines))
    plain = kernel_bytes(args.ranks, args.lines)
    print(f"{args.ranks} ranks x {args.lines:,} lines: {printed / 1e6:.1f} MB printed, "
          f"cell took {seconds:.1f} s")
    print(f"%%mesh display messages: {counter.bytes / 1e6:.2f} MB in {counter.messages} "
          f"messages")
    print(f"kernel printing it:      {plain / 1e6:.2f} MB")
    print(f"ratio: {counter.bytes / plain:.2f}")


if __name__ == "__main__":
    main()
