"""meshlab beside its peers on the same work: N workers to a finished gloo all_reduce, then
a no-op round trip.

Peers (installed into a benchmark environment of their own, never meshlab's dependencies):
- Monarch (`torchmonarch`): procs spawned on this host, an actor per proc, `ping.call()`;
- nbdistributed: its process manager's workers (a gloo group) and its ZeroMQ socket,
  `send_to_all("execute", "pass")` (what its `%%distributed` magic sends, without the
  magic's 100 ms polling sleep).
meshlab: `Cluster(N)` (engines and a gloo group), `Cluster.run("pass")` and the `%%mesh`
magic through IPython. The round trips of all of them are interleaved in shuffled rounds on
workers that are all up at once, so drift and load hit them alike; start-up is timed once per
size, one tool at a time.

$ python -m venv --system-site-packages .peers
$ .peers/bin/pip install torch==2.13.0 torchmonarch nbdistributed "cloudpickle==3.1.1"
$ . .peers/bin/activate   # nbdistributed starts its workers with the `python` on PATH
$ python benchmarks/peers.py --ranks 4 8 16 --repeats 50

(Monarch 0.7 needs cloudpickle's 3.1 internals.) nbdistributed binds its socket on every
interface (`tcp://*`); run this on a machine whose network you trust.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython

from meshlab import Cluster
from meshlab.measure.timing import interleaved_times


class Meshlab:
    name = "meshlab"

    def __init__(self, n: int) -> None:
        self.cluster = Cluster(n).start(progress=False)
        self.cluster.run("t = torch.ones(1)\ndist.all_reduce(t)")
        self.ip = start_ipython() or get_ipython()
        if "mesh" not in self.ip.magics_manager.magics["cell"]:
            self.ip.run_line_magic("load_ext", "meshlab")
        self.ip.magics_manager.registry["MeshMagics"].session.cluster = self.cluster

    def calls(self) -> dict[str, Callable[[], object]]:
        return {"meshlab Cluster.run": lambda: self.cluster.run("pass"),
                "meshlab %%mesh": lambda: self.ip.run_cell("%%mesh\npass").raise_error()}

    def stop(self) -> None:
        self.ip.magics_manager.registry["MeshMagics"].session.cluster = None
        self.cluster.stop()


class Monarch:
    name = "Monarch"

    def __init__(self, n: int) -> None:
        from monarch.actor import Actor, endpoint, this_host

        class Noop(Actor):
            @endpoint
            def join(self, port: int) -> float:
                import torch
                import torch.distributed as dist
                from monarch.actor import current_rank, current_size

                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                        rank=current_rank().rank, world_size=current_size()
                                        ["procs"])
                t = torch.ones(1)
                dist.all_reduce(t)
                return t.item()

            @endpoint
            def ping(self) -> int:
                return 0

        self.procs = this_host().spawn_procs(per_host={"procs": n})
        self.actors: Any = self.procs.spawn("noop", Noop)
        self.actors.join.call(free_port()).get()  # a gloo group across them, as the others

    def calls(self) -> dict[str, Callable[[], object]]:
        return {"Monarch actor call": lambda: self.actors.ping.call().get()}

    def stop(self) -> None:
        self.procs.stop().get()


class NbDistributed:
    name = "nbdistributed"

    def __init__(self, n: int) -> None:
        from nbdistributed.communication import CommunicationManager
        from nbdistributed.process_manager import ProcessManager

        self.processes = ProcessManager()
        port = self.processes.start_workers(n, "localhost")
        self.comm = CommunicationManager(n, port)  # its workers joined a gloo group
        deadline = time.monotonic() + 120
        while True:  # its ROUTER socket drops messages to workers not connected yet
            try:
                self.comm.send_to_all("get_status", None, timeout=1)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        self.comm.send_to_all("execute", "t = torch.ones(1)\ndist.all_reduce(t)")

    def calls(self) -> dict[str, Callable[[], object]]:
        return {"nbdistributed socket": lambda: self.comm.send_to_all("execute", "pass")}

    def stop(self) -> None:
        self.comm.shutdown()
        self.processes.shutdown()  # its own worker processes, by their handles


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(n: int, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """(start seconds per tool, median round-trip ms per call) on n workers."""
    started: dict[str, float] = {}
    tools: list[Any] = []
    try:
        for tool in (Meshlab, Monarch, NbDistributed):
            t = time.perf_counter()
            tools.append(tool(n))
            started[tool.name] = time.perf_counter() - t
        calls = {name: call for tool in tools for name, call in tool.calls().items()}
        samples = interleaved_times(calls, repeats, warmup=5)
    finally:
        for tool in tools:
            tool.stop()
    return started, {name: statistics.median(s) * 1e3 for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    for n in args.ranks:
        started, ms = measure(n, args.repeats)
        print(f"\n{n} workers: start " + ", ".join(
            f"{name} {seconds:.1f} s" for name, seconds in started.items()))
        fastest = min(ms.values())
        for name, median in ms.items():
            print(f"  {name:<22} {median:7.2f} ms   {median / fastest:5.1f}x the fastest",
                  flush=True)


if __name__ == "__main__":
    main()
