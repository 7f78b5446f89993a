"""Shared fixtures: one real 4-rank gloo cluster for the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshlab import Cluster

# A short process-group timeout so the hung-collective test recovers in seconds.
TEST_PROFILE = """
[cluster]
launcher = "local"
backend = "gloo"
pg_timeout = 10
start_timeout = 120
"""


@pytest.fixture(scope="session")
def test_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "ci.toml"
    path.write_text(TEST_PROFILE)
    return path


@pytest.fixture(scope="session")
def cluster(test_profile: Path) -> Iterator[Cluster]:
    with Cluster(4, profile=test_profile) as c:
        yield c


@pytest.fixture(scope="session")
def shell(cluster: Cluster):  # type: ignore[no-untyped-def]
    """A real IPython shell with `%load_ext meshlab`, driving the shared cluster."""
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "meshlab")
    session = ip.magics_manager.registry["MeshMagics"].session
    session.cluster = cluster
    yield ip
    session.cluster = None  # the cluster fixture stops it
