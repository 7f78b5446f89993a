"""The error the cluster raises when it cannot start, or cannot take a request as it stands."""


class ClusterError(RuntimeError):
    """The cluster could not start, or is not in a state to run this request."""
