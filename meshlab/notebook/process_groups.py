"""The ranks' process group and mesh: re-forming the group over all ranks or a subset, and
building the named DeviceMesh ``mesh``, each refused while the rendezvous store's disk is
full. Mixed into Cluster.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshlab.mesh import MeshSpec
from meshlab.notebook import on_ranks
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.ranks import parse_ranks

if TYPE_CHECKING:
    from meshlab.notebook.profiles import Profile

STORE_HEADROOM = 2**20  # bytes the store's disk must have free before groups are made


class ProcessGroups:
    """regroup and init_mesh."""

    _members: list[int] | None
    _generation: int
    _busy: dict[int, str]
    _dead: dict[int, str]
    _needs_regroup: bool
    _diverged: str | None
    _store_dir: Path | None
    mesh_spec: MeshSpec | None
    profile: Profile
    _ranks: Callable[..., list[int]]
    _recover: Callable[..., float]
    _check_groups: Callable[[], list[str]]
    _apply_each: Callable[..., dict[int, Any]]

    if TYPE_CHECKING:  # Cluster's
        @property
        def world_size(self) -> int: ...

    def regroup(self, ranks: str | list[int] | None = None) -> None:
        """Replace the process group by a fresh one over all ranks (or a subset).

        A mesh built on the old group is rebuilt on the new one when it still fits.
        """
        members = None if ranks is None else parse_ranks(ranks, self.world_size)
        self._members = members
        self._generation += 1
        gen = self._generation
        self._check_store_disk("re-forming the process group")
        self._apply_each(on_ranks.regroup_rank, lambda r: {"generation": gen, "members": members},
                         timeout=self.profile.pg_timeout + 30)
        self._needs_regroup, self._diverged = False, None
        if self.mesh_spec is not None:
            if members is None:
                self.init_mesh(self.mesh_spec)
            else:
                self.mesh_spec = None  # a subset group no longer matches the mesh

    def init_mesh(self, spec: str | MeshSpec) -> MeshSpec:
        """Build the named DeviceMesh ``mesh`` on every rank; ValueError names a bad spec."""
        spec = MeshSpec.parse(spec) if isinstance(spec, str) else spec
        spec.check(self.world_size if self._members is None else len(self._members))
        self._ranks(None)
        if not self._busy and not self._dead and not self._diverged:
            # one round trip per `%mesh init`: groups made unevenly where meshlab could not
            # see it would deadlock the mesh's own new_group calls
            for note in self._check_groups():
                logging.getLogger("meshlab").info("%s", note)
        self._recover(creates_groups=True)
        self._check_store_disk("building the mesh")
        self._apply_each(on_ranks.build_mesh, lambda r: {"spec": spec},
                         timeout=self.profile.pg_timeout + 30)
        self.mesh_spec = spec
        return spec

    def _check_store_disk(self, doing: str) -> None:
        """Refuse ``doing`` (it writes the rendezvous store) when the store's disk is full:
        the rank whose write fails raises, and the others wait for its key."""
        if self._store_dir is None:
            return
        free = shutil.disk_usage(self._store_dir).free
        if free < STORE_HEADROOM:
            raise ClusterError(
                f"{doing} writes the ranks' rendezvous store in {self._store_dir}, and its disk "
                f"has {free // 1024} KiB free: free space there (df {self._store_dir.parent}), "
                "or set TMPDIR to a folder on another disk before %mesh start; nothing ran")
