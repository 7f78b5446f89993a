"""Looking at the ranks from a Session: status, stacks, post-mortems, which rank holds which
block, memory per rank. Mixed into Session."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from meshlab.notebook.debug_prompt import Prompt
from meshlab.notebook.errors import ClusterError, SessionError
from meshlab.notebook.output import MeshError, postmortem_text, stacks_text
from meshlab.notebook.ranks import parse_ranks

if TYPE_CHECKING:
    import pandas as pd

    from meshlab.measure.sharding import ModuleReport, ShardingReport
    from meshlab.notebook.cluster import Cluster
    from meshlab.notebook.debugger import Debugger

# pdb at the last failed cell's frame, run on the rank as a cell; no name left behind
POST_MORTEM = '__import__("meshlab.rank.debugger").rank.debugger.post_mortem()'


class Inspection:
    """status, stacks, postmortem, inspect and memory."""

    need_cluster: Callable[[], Cluster]
    cell_number: Callable[[], int]

    def status(self) -> pd.DataFrame:
        """One row per rank: host, pid, device, alive, busy, memory."""
        return self.need_cluster().status()

    def stacks(self, ranks: str | list[int] | None = None, *, native: bool = False) -> str:
        """Every rank's current stack (identical ones once) and its last collectives;
        ``native``: py-spy's stacks, C and C++ frames among the Python ones."""
        cluster = self.need_cluster()
        chosen = parse_ranks(ranks, cluster.world_size)
        return stacks_text(cluster.stacks(chosen, native=native), cluster.collectives(chosen),
                           chosen)

    def postmortem(self, rank: int, *, live: bool = False,
                   on_breakpoint: Callable[[Debugger], None] | None = None) -> str:
        """Post-mortem of the last failed cell on ``rank``: its traceback and the failing
        frame's variables; ``live``: pdb at that frame, driven by ``on_breakpoint`` (by
        default the prompt, as a cell's ``breakpoint()``)."""
        cluster = self.need_cluster()
        found = cluster.postmortem(rank)
        if not live or found is None:  # nothing to debug: the text says so
            return postmortem_text(rank, found)
        try:  # on the rank's main thread, as a cell: pdb needs the thread the frames are on
            cluster.run(POST_MORTEM, [rank], number=self.cell_number(),
                        on_breakpoint=on_breakpoint or Prompt())
        except MeshError as e:
            error = e.result.outputs[rank].error
            if error is None or error.ename != "BdbQuit":
                raise
        return f"rank {rank}: post-mortem debugger closed ({found['error']})"

    def inspect(self, expr: str, ranks: str | list[int] | None = None
                ) -> ShardingReport | ModuleReport:
        """Which rank holds which block of ``expr`` (a DTensor, tensor or module)."""
        return self.need_cluster().inspect(expr, ranks)

    def memory(self, model: str, optimizer: str | None = None, *, stage: int | None = None,
               dp: int | None = None, inputs: str | None = None) -> pd.DataFrame:
        """Bytes of parameters, gradients and optimizer states per rank (activations one
        forward on ``inputs`` saves), on the device and offloaded to host memory, beside the
        ZeRO formula for ``stage`` if given."""
        from meshlab.notebook.tables.memory import memory_frame

        cluster = self.need_cluster()
        try:
            reports, params, activations = cluster.memory(model, optimizer, inputs)
        except ClusterError as e:
            raise SessionError(f"cannot measure {model!r}:\n{e}") from None
        spec = cluster.mesh_spec
        dp = dp or (spec.dp_replicate * spec.dp_shard if spec else cluster.world_size)
        # params: what one tp rank holds, counted on the ranks (TP leaves norms, and often
        # the embedding and head, whole), so the formula divides it by dp only
        return memory_frame(reports, params=params, dp=dp, stage=stage, activations=activations)
