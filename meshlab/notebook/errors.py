"""The errors the notebook side raises when the cluster cannot start, or the cluster or the
session cannot take a request as it stands."""


class ClusterError(RuntimeError):
    """The cluster could not start, or is not in a state to run this request."""


class SessionError(ValueError):
    """A request the session cannot take as it stands; the message names the fix."""

