"""Values between the notebook and the ranks' namespaces: push, and pull with a size check.

Notebook side; a mixin of Cluster (the engines, ranks and failure helpers are its).
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import ipyparallel as ipp
from ipyparallel.serialize import serialize_object

from meshlab.notebook import on_ranks
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.output import size_text
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
    _failures: Callable[..., list[tuple[int, str, str]]]

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

    def pull(self, name: str, ranks: str | list[int] | None = None) -> dict[int, Any]:
        """``{rank: value}`` of a name in the ranks' namespaces."""
        ranks = self._ranks(ranks)
        view = self._client.direct_view([self._engines[r] for r in ranks])
        sizes = [n for n in view.apply_sync(on_ranks.nbytes, name) if n is not None]
        if sum(sizes) > self.pull_warn_bytes:
            warnings.warn(
                f"pulling {name!r} copies {size_text(sum(sizes))} into the notebook ("
                f"{len(sizes)} rank{'s' if len(sizes) > 1 else ''}, up to {size_text(max(sizes))} "
                f"each); `%mesh pull {name} --ranks 0` (or pull(name, ranks=...)) takes fewer",
                PullSizeWarning, stacklevel=2)
        ar = view.pull(name, block=False)
        try:
            return dict(zip(ranks, ar.get(), strict=True))
        except ipp.CompositeError as e:
            failures = self._failures(e, ranks)
            missing = [r for r, ename, _ in failures if ename == "NameError"]
            if len(missing) == len(failures):
                raise KeyError(f"{name!r} is not defined on rank(s) {format_ranks(missing)}: "
                               "define it in a %%mesh cell first") from None
            r, ename, evalue = next(f for f in failures if f[1] != "NameError")
            raise ClusterError(f"could not pull {name!r} from rank {r}: {ename}: {evalue}") \
                from None
