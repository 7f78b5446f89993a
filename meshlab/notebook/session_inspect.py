"""Looking at the ranks from a Session: status, stacks, post-mortems, which rank holds which
block, memory per rank. Mixed into Session."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from meshlab.notebook.errors import ClusterError, SessionError
from meshlab.notebook.output import postmortem_text, stacks_text
from meshlab.notebook.ranks import parse_ranks

if TYPE_CHECKING:
    import pandas as pd

    from meshlab.measure.sharding import ModuleReport, ShardingReport
    from meshlab.notebook.cluster import Cluster


class Inspection:
    """status, stacks, postmortem, inspect and memory."""

    need_cluster: Callable[[], Cluster]

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

    def postmortem(self, rank: int) -> str:
        """Post-mortem of the last failed cell on ``rank``."""
        return postmortem_text(rank, self.need_cluster().postmortem(rank))

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
