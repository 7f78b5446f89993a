"""Shared fixtures: one real 4-rank gloo cluster for the whole session; and the markers kept
honest: a test that starts engines is marked `cluster`, so `-m "not cluster"` starts none."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from meshlab import Cluster, Session

# A short process-group timeout so the hung-collective test recovers in seconds.
TEST_PROFILE = """
[cluster]
launcher = "local"
backend = "gloo"
pg_timeout = 6
start_timeout = 120
"""

# Fixtures that hand a test running engines, and markers whose tests start their own.
ENGINE_FIXTURES = {"cluster", "module_cluster", "shell", "_shared_cluster"}
ENGINE_MARKERS = {"notebook", "browser", "slurm", "hosts"}


def pytest_configure(config: pytest.Config) -> None:
    # A shell's background job starts with SIGINT ignored, and Python then leaves it so: the
    # tests that press Ctrl-C on themselves would wait for ever instead of failing
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        uses = ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses or any(item.get_closest_marker(m) for m in ENGINE_MARKERS):
            item.add_marker(pytest.mark.cluster)


# What the system tests need from the machine, by their marker. The README's command 2 brings
# it up (tests/machine/up.sh); where it could not (no root), those tests skip, the run's last
# line says so, and MESHLAB_REQUIRE_MACHINE=1 (CI) turns each such skip into a failure.
MACHINE_UP = "tests/machine/up.sh"
HOSTS_STATE = Path("/var/lib/meshlab-hosts")


def _answers(*cmd: str) -> str | None:
    """What ``cmd`` printed, or None when it is not installed, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout if done.returncode == 0 else None


@cache
def machine_missing(marker: str) -> str | None:
    """Why the machine cannot run the tests marked ``marker`` (None: it can)."""
    if marker == "browser":
        from meshlab.notebook import lab_settings

        if not shutil.which("chromium"):
            return "Debian's Chromium is not installed"
        if not (lab_settings.overrides_folder() / lab_settings.FILE_NAME).exists():
            return ("JupyterLab does not save widget state here: run `meshlab lab-settings` "
                    "(the README's command 1 does)")
        if not (lab_settings.plugins_folder() / lab_settings.PLUGIN_NAME).is_dir():
            return ("meshlab's JupyterLab plugin is not installed here: run `meshlab "
                    "lab-settings` (the README's command 1 does)")
        return None
    up = {"idle", "mixed", "allocated", "completing"}
    if marker == "slurm":
        states = _answers("sinfo", "-h", "-p", "debug", "-o", "%T")
        return None if states and up & set(states.split()) else "Slurm is not up"
    if marker == "hosts":
        nodes = _answers("sinfo", "-h", "-p", "hosts", "-o", "%n %T") or ""
        ready = {line.split()[0] for line in nodes.splitlines() if line.split()[-1] in up}
        ssh = HOSTS_STATE / "ssh_config"
        if ssh.exists() and {"node1", "node2"} <= ready and all(
                (_answers("ssh", "-F", str(ssh), host, "hostname") or "").strip() == host
                for host in ["node1", "node2"]):
            return None
        return "the test hosts node1, node2 are not up"
    return None


MACHINE_SKIPPED: dict[str, int] = {}


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in ("browser", "slurm", "hosts"):
        if item.get_closest_marker(marker) and (why := machine_missing(marker)):
            message = why if "run `" in why else f"{why}: run {MACHINE_UP} (as root)"
            if os.environ.get("MESHLAB_REQUIRE_MACHINE") == "1":
                pytest.fail(f"{message}; MESHLAB_REQUIRE_MACHINE=1 refuses to skip it")
            MACHINE_SKIPPED[why] = MACHINE_SKIPPED.get(why, 0) + 1
            pytest.skip(message)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's last line, after pytest's own summary, when machine pieces were missing."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if MACHINE_SKIPPED and reporter is not None:
        reasons = "; ".join(f"{why} ({n})" for why, n in MACHINE_SKIPPED.items())
        n = sum(MACHINE_SKIPPED.values())
        reporter.write_line(f"{n} test{'s' * (n != 1)} skipped: {reasons}; "
                            f"see the README's set-up ({MACHINE_UP}, as root, brings up the "
                            "machine), then run the tests again", yellow=True, bold=True)


# The shared cluster stops after the last test that uses it, not at the session's end: an
# idle rank still costs CPU (gloo's loop wakes every 10 ms for each group the tests made,
# ~10% of a core per rank by then), which the tests after it (the tour) would share.
SHARED: list[Cluster] = []
LAST_SHARED_USER: list[str] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [item for item in session.items
             if "_shared_cluster" in getattr(item, "fixturenames", ())]
    if users:  # the end of its module: a module-scoped fixture may still use it in teardown
        module = users[-1].nodeid.split("::")[0]
        LAST_SHARED_USER[:] = [next(item.nodeid for item in reversed(session.items)
                                    if item.nodeid.split("::")[0] == module)]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if SHARED and [item.nodeid] == LAST_SHARED_USER:
        SHARED.pop().stop()


@pytest.fixture(autouse=True)
def _engines_need_the_cluster_mark(request: pytest.FixtureRequest,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A test without the `cluster` mark that starts engines in this process fails, naming
    the fix (tests that start them in a subprocess carry the mark by hand)."""
    if request.node.get_closest_marker("cluster") is None:
        def refuse(self: Cluster, *args: object, **kwargs: object) -> Cluster:
            raise AssertionError(f"{request.node.nodeid} starts engines: mark it "
                                 "@pytest.mark.cluster (or use the `cluster` fixture)")

        monkeypatch.setattr(Cluster, "start", refuse)


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank NCCL process group in this process, for the GPU tests (they skip without
    CUDA before they get here)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("needs no process group already in this process")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def test_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profiles") / "ci.toml"
    path.write_text(TEST_PROFILE)
    return path


@pytest.fixture(scope="session")
def _shared_cluster(test_profile: Path) -> Iterator[Cluster]:
    with Cluster(4, profile=test_profile) as c:
        SHARED[:] = [c]
        yield c
    SHARED.clear()


def healthy(cluster: Cluster) -> Cluster:
    """``cluster``, with fresh engines first if an earlier test left a rank dead or stuck
    past the process-group timeout (one such test must not fail all that follow)."""
    if cluster._dead or cluster._wedged:
        cluster.restart()
    return cluster


@pytest.fixture
def cluster(_shared_cluster: Cluster) -> Cluster:
    """The shared 4-rank cluster, healthy."""
    return healthy(_shared_cluster)


@pytest.fixture
def session(cluster: Cluster) -> Iterator[Session]:
    """A Session driving the shared cluster (which outlives it)."""
    s = Session()
    s.cluster = cluster
    yield s
    s.cluster = None


@pytest.fixture(scope="module")
def module_cluster(_shared_cluster: Cluster) -> Cluster:
    """The same, for a module's fixture that runs every case once."""
    return healthy(_shared_cluster)


@pytest.fixture(scope="session")
def shell(_shared_cluster: Cluster):  # type: ignore[no-untyped-def]
    """A real IPython shell with `%load_ext meshlab`, driving the shared cluster."""
    from IPython.testing import globalipapp

    globalipapp.start_ipython()  # once per process: a second call returns None
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "meshlab")
    session = ip.magics_manager.registry["MeshMagics"].session
    session.cluster = _shared_cluster
    yield ip
    session.cluster = None  # the cluster fixture stops it
