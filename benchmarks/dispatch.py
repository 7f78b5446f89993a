"""Dispatch overhead of %%mesh: a no-op cell through the real magic vs raw ipyparallel.

All five run against the same cluster, interleaved in a shuffled order so drift and
queueing hit them equally:

- raw:        `DirectView.execute(code, block=True)` (returns at the execute replies);
- raw+output: the same, then `wait_for_output()` (until every engine's output has
              arrived: what any display of a cell's output has to wait for);
- %%px:       ipyparallel's own magic on the same engines, waiting for output as %%mesh;
- run:        `Cluster.run(code)`: meshlab's cell channel, without IPython's magic around it;
- %%mesh:     `shell.run_cell("%%mesh\\n" + code)` through the real magic and IPython.

Beside each wall time, the notebook process's own CPU time per %%mesh cell (and per rank):
what the kernel spends parsing and grouping replies, which grows with the ranks.

$ python benchmarks/dispatch.py                 # 4, 8 and 16 ranks, 100 round trips each
$ python benchmarks/dispatch.py --ranks 4 8 16 32 --repeats 40
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython

from meshlab import Cluster
from meshlab.measure.timing import interleaved_times

CODE = "pass"
WARMUP = 10


def measure(n: int, repeats: int) -> dict[str, float]:
    """Median round trip in ms of each way to run CODE on n ranks, and the notebook's median
    CPU ms per %%mesh cell ("%%mesh cpu")."""
    ip = start_ipython() or get_ipython()  # start_ipython returns None once started
    if "mesh" not in ip.magics_manager.magics["cell"]:
        ip.run_line_magic("load_ext", "meshlab")
    session = ip.magics_manager.registry["MeshMagics"].session
    cpu: list[float] = []

    def with_cpu(run: Callable[[], object]) -> Callable[[], object]:
        def timed() -> None:
            start = time.process_time()
            run()
            cpu.append(time.process_time() - start)
        return timed

    ways = {
        "raw": lambda: view.execute(CODE, block=True),
        "raw+output": lambda: view.execute(CODE, silent=False, block=False).wait_for_output(),
        "%%px": lambda: ip.run_cell(f"%%px\n{CODE}").raise_error(),
        "run": lambda: cluster.run(CODE),
        "%%mesh": with_cpu(lambda: ip.run_cell(f"%%mesh\n{CODE}").raise_error()),
    }
    with Cluster(n) as cluster:
        session.cluster = cluster
        view = cluster._client.direct_view(cluster._engines)
        view.block = True  # %%px waits for its result and output, as %%mesh does
        view.activate()  # registers %%px on this shell, targeting the same engines
        samples = interleaved_times(ways, repeats, warmup=WARMUP)
        session.cluster = None
    medians = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    medians["%%mesh cpu"] = statistics.median(cpu[WARMUP:]) * 1e3
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    print(f"median round trip of a no-op cell, ms ({args.repeats} each); "
          "ratio = %%mesh / baseline; cpu = the notebook's CPU ms per %%mesh cell")
    print(f"{'ranks':>5} {'raw':>6} {'raw+output':>10} {'%%px':>6} {'run':>6} {'%%mesh':>6}   "
          f"{'vs raw':>6} {'vs raw+output':>13} {'vs %%px':>7}   {'cpu':>5} {'cpu/rank':>8}")
    for n in args.ranks:
        ms = measure(n, args.repeats)
        mesh = ms["%%mesh"]
        print(f"{n:>5} {ms['raw']:>6.1f} {ms['raw+output']:>10.1f} {ms['%%px']:>6.1f} "
              f"{ms['run']:>6.1f} {mesh:>6.1f}   {mesh / ms['raw']:>6.2f} "
              f"{mesh / ms['raw+output']:>13.2f} "
              f"{mesh / ms['%%px']:>7.2f}   {ms['%%mesh cpu']:>5.1f} "
              f"{ms['%%mesh cpu'] / n:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
