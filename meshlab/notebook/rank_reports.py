"""What the ranks hold, gathered into one report: which rank holds which block of a tensor or
module (``inspect``), and the bytes of a model and its optimizer on each (``memory``).
Mixed into Cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from meshlab.measure.sharding import ModuleReport, ShardingReport, merge
from meshlab.notebook import on_ranks
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.output import group
from meshlab.notebook.ranks import label

if TYPE_CHECKING:
    from meshlab.mesh import MeshSpec
    from meshlab.notebook.profiles import Profile


class RankReports:
    """inspect and memory."""

    _client: Any
    _engines: list[int]
    profile: Profile
    _ranks: Callable[..., list[int]]
    _recover: Callable[..., float]
    _failures: Callable[[Any, list[int]], list[tuple[int, str, str]]]
    _apply_each: Callable[..., dict[int, Any]]
    mesh_spec: MeshSpec | None

    def inspect(self, expr: str, ranks: str | list[int] | None = None
                ) -> ShardingReport | ModuleReport:
        """Evaluate ``expr`` on the ranks and merge what each holds into one report."""
        ranks = self._ranks(ranks)
        self._recover()
        ar = self._client.direct_view([self._engines[r] for r in ranks]).apply_async(
            on_ranks.describe, expr)
        try:
            reports = ar.get(timeout=self.profile.pg_timeout)
        except ipp.CompositeError as e:
            why = {r: f"{ename}: {evalue}" for r, ename, evalue in self._failures(e, ranks)}
            lines = [f"  {label(group_ranks)} {text}" for group_ranks, text in group(why)]
            raise ClusterError(f"cannot inspect {expr!r}:\n" + "\n".join(lines)) from None
        merged = merge(dict(zip(ranks, reports, strict=True)))
        if self.mesh_spec is not None:  # FSDP's dp_shard_cp by the name the mesh table uses
            _rename_axes(merged, self.mesh_spec.shown_name)
        return merged

    def memory(self, model: str, optimizer: str | None = None, inputs: str | None = None
               ) -> tuple[dict[int, Any], int, dict[int, tuple[int, int]]]:
        """Bytes each rank holds for ``model`` (an expression) and its optimizer, the
        parameters one tensor-parallel rank holds (Ψ without TP), and (device, host) bytes one
        forward on ``inputs`` saves for backward, if given."""
        self._ranks(None)
        out = self._apply_each(on_ranks.measure_memory, lambda r: {
            "model": model, "optimizer": optimizer, "inputs": inputs})
        activations = {r: a for r, (_, _, a) in out.items() if a is not None}
        return {r: report for r, (report, _, _) in out.items()}, out[0][1], activations


def _rename_axes(report: ShardingReport | ModuleReport, shown: Callable[[str], str]) -> None:
    """Each tensor's mesh axes by the names ``shown`` gives them, in place."""
    for tensor in report.tensors if isinstance(report, ModuleReport) else [report]:
        for part in [tensor, *tensor.parts]:
            part.mesh_axes = [shown(a) for a in part.mesh_axes]
