"""``%load_ext meshlab``: register the magics, tab completion and error display."""

from __future__ import annotations

from typing import Any

_state: dict[int, Any] = {}  # id(shell) -> (magics, matcher)


def load_ipython_extension(ipython: Any) -> None:
    """Register %mesh / %%mesh on this IPython shell."""
    from meshlab.magics import MeshMagics, _show_error, rank_matcher

    from meshlab.notebook.cluster import ClusterError
    from meshlab.notebook.output import MeshError
    from meshlab.notebook.restore import ReplayError

    if id(ipython) in _state:
        return
    import torch

    from meshlab.rank import import_noise

    import_noise.quiet(gpu=torch.cuda.is_available())  # the kernel's own cells build models too
    magics = MeshMagics(ipython)
    ipython.register_magics(magics)
    matcher = rank_matcher(magics)
    ipython.Completer.custom_matchers.append(matcher)
    # shown as the cell's error output, in red with its name, not as a line on stderr
    ipython.set_custom_exc((MeshError, ClusterError, ReplayError), _show_error)
    _state[id(ipython)] = (magics, matcher)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the cluster and remove what load_ipython_extension added."""
    magics, matcher = _state.pop(id(ipython), (None, None))
    if magics is None:
        return
    if magics.session.running:
        magics.session.stop()
    if matcher in ipython.Completer.custom_matchers:
        ipython.Completer.custom_matchers.remove(matcher)
    ipython.set_custom_exc((), None)
    ipython.magics_manager.magics["line"].pop("mesh", None)
    ipython.magics_manager.magics["cell"].pop("mesh", None)
