"""Values between the notebook and the ranks' namespaces: push, and pull with a size check.

Notebook side; a mixin of Cluster (the engines, ranks and failure helpers are its).
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from ipyparallel.serialize import serialize_object

from meshlab.notebook import on_ranks
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.output import CellResult, MeshError, size_text
from meshlab.notebook.ranks import format_ranks

PULL_WARN_BYTES = 256 * 2**20


class PullSizeWarning(UserWarning):
    """A pull that copies a lot of memory into the notebook."""


warnings.filterwarnings("always", category=PullSizeWarning)  # every such pull, not the first


class Transfers:
    """push and pull."""

    _client: Any
    _engines: list[int]
    pull_warn_bytes: int
    _ranks: Callable[..., list[int]]
    run: Callable[..., CellResult]

    def push(self, mapping: Mapping[str, Any], ranks: str | list[int] | None = None) -> None:
        """Copy notebook values to the ranks' namespaces."""
        targets = [self._engines[r] for r in self._ranks(ranks)]
        try:
            self._client.direct_view(targets).push(dict(mapping), block=True)
        except (TypeError, AttributeError, pickle.PicklingError):  # serializing, here
            for name, value in mapping.items():  # one line naming it, not ipyparallel's
                try:
                    serialize_object(value)
                except Exception as why:  # whatever pickling raises
                    raise ClusterError(
                        f"cannot push {name!r}: a {type(value).__name__} cannot be sent to the "
                        f"ranks ({type(why).__name__}: {why}). Push what it is made from and "
                        "build it in a %%mesh cell") from None
            raise

    def pull(self, name: str, ranks: str | list[int] | None = None, *,
             shown_as: int | None = None) -> dict[int, Any]:
        """``{rank: value}`` of a name in the ranks' namespaces. ``shown_as``: the Out[n]
        IPython will show the value as (a large pull's warning then says it stays cached)."""
        ranks = self._ranks(ranks)
        view = self._client.direct_view([self._engines[r] for r in ranks])
        sizes = [n for n in view.apply_sync(on_ranks.nbytes, name) if n is not None]
        if sum(sizes) > self.pull_warn_bytes:
            warnings.warn(
                f"pulling {name!r} copies {size_text(sum(sizes))} into the notebook ("
                f"{len(sizes)} rank{'s' if len(sizes) > 1 else ''}, up to {size_text(max(sizes))} "
                f"each); `%mesh pull {name} --ranks 0` (or pull(name, ranks=...)) takes fewer"
                + ("" if shown_as is None else f". {cached_text(name, shown_as)}"),
                PullSizeWarning, stacklevel=2)
        # straight from each rank over the cell channel, in pieces written into one buffer
        # per array or tensor: not through the controller, which held 2 copies of it, and
        # never twice in the notebook
        code = f"__import__('meshlab.rank.cell_server').rank.cell_server.stream_value({name})"
        try:
            result = self.run(code, ranks=ranks, keep_values=True)
        except MeshError as e:
            errors = {r: o.error for r, o in e.result.outputs.items() if o.error is not None}
            missing = [r for r, error in errors.items() if error.ename == "NameError"]
            if errors and len(missing) == len(errors):
                raise KeyError(f"{name!r} is not defined on rank(s) {format_ranks(missing)}: "
                               "define it in a %%mesh cell first") from None
            r, error = next(((r, why) for r, why in errors.items() if why.ename != "NameError"),
                            (None, None))
            if error is None:  # timed out, interrupted, a rank died: as any cell says it
                raise
            raise ClusterError(f"could not pull {name!r} from rank {r}: {error.ename}: "
                               f"{error.evalue}") from None
        return {r: result.values[r] for r in ranks}


def cached_text(name: str, out: int) -> str:
    """Why a pull shown as a cell's result keeps its memory, and what frees it."""
    # as IPython 8.12 and 9.18 behave: `%reset -f out` leaves the value in the shell's hidden
    # namespace (`_`, and `_<n>` on 8.x), and a line magic receives a trailing `;` as its own
    return (f"Shown as this cell's result, it also stays in IPython's output cache (Out[{out}], "
            f"_{out}, _) after you drop it: only `%reset -f` (every variable) frees it; "
            f"`%reset -f out` keeps hidden references, and `;` after a magic is passed to the "
            f"magic. Assign it instead: `{name} = %mesh pull {name}`; `del {name}` then frees it")
