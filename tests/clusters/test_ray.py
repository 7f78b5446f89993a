"""The Ray profile on a real Ray cluster: its head on this machine (the login node, where
the notebook and the controller run; no CPUs for ranks) and a Ray worker node in each test
host (tests/machine/hosts-up.sh), 2 x 2 ranks; what tests/clusters/test_hosts.py runs on
the ssh, mpi and slurm profiles, here on Ray's placement."""

from __future__ import annotations

import ast
import ipaddress
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from IPython.utils.capture import capture_output
from ray_nodes import RayNodes, ray_cluster
from sbatch_job import TRAIN
from test_hosts import (
    ADDRESS,
    HOSTS,
    LOGIN,
    RANK_FACTS,
    TRAIN_CHECK,
    host_pid,
    listening_sockets,
    node2_cut_mid_collective,
    restart_replays_w_on_both_hosts,
)

from meshlab.notebook import profiles
from meshlab.notebook.cluster import Cluster
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.output import MeshError
from meshlab.notebook.session import Session

pytestmark = [pytest.mark.hosts, pytest.mark.cluster]


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNodes]:
    with pytest.MonkeyPatch.context() as env, ray_cluster(
            tmp_path_factory.mktemp("ray"), LOGIN, {h: ADDRESS[h] for h in HOSTS},
            {h: host_pid(h) for h in HOSTS}) as nodes:
        for key, value in nodes.env.items():  # the notebook's driver authenticates too
            env.setenv(key, value)
        yield nodes


def ray_profile(nodes: RayNodes, folder: Path, **launcher: str) -> Path:
    """The built-in ray profile, attached to the test cluster, the controller on the bridge."""
    text = profiles.available()["ray"].read_text()
    text = text.replace('controller_ip = "127.0.0.1"', f'controller_ip = "{LOGIN}"')
    # three quarters of a node's CPU each: PACK fits two on a node (2 CPUs), and a second
    # session of a quarter each still finds room beside the module's
    settings = {"address": f'"{nodes.address}"', "start_local": "false",
                "cpus_per_rank": "0.75"} | launcher
    text = text.split("[launcher]\n")[0] + "[launcher]\n" + "".join(
        f"{k} = {v}\n" for k, v in settings.items())
    path = folder / "ray.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def ray_session(ray_nodes: RayNodes, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[Session]:
    session = Session()
    session.start(profile=str(ray_profile(ray_nodes, tmp_path_factory.mktemp("profile"))),
                  progress=False)
    try:
        yield session
    finally:
        if session.cluster is not None:  # (the last test stops it)
            session.stop()


LOCAL_RAY = """
import socket
import ray
from meshlab import Session
from meshlab.notebook.output import MeshError

session = Session()
session.start(profile="ray", progress=False)  # 4 ranks of 1 CPU on a 2-core machine
print("hosts", session.cluster.host_of == [socket.gethostname()] * 4)
try:
    session.run("import time\\ntime.sleep(60)", timeout=3)
except MeshError as e:  # Ctrl-C reaches a Ray rank
    print("limit", "time limit" in str(e) and "deaf to interrupts" not in str(e))
print("values", session.run("x = torch.ones(1) * (rank + 1)\\ndist.all_reduce(x)\\nfloat(x)",
                            keep_values=True).values)
session.stop()
print("stopped", ray.is_initialized())
"""


def test_the_shipped_profile_starts_a_ray_of_this_machine_where_none_runs(
        tmp_path: Path) -> None:
    # a plain program, in a process of its own: Ray reads its authentication settings once
    # a process, and this module's cluster wants a token; "auto" finds no cluster (no
    # RAY_ADDRESS), and start_local makes one
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([sys.executable, "-c", LOCAL_RAY], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env | {"RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.splitlines() == [
        "hosts True", "limit True", f"values { {r: 10.0 for r in range(4)} }",
        "stopped False"], done.stderr[-4000:]  # the Ray it started went with the session


def test_a_ray_profile_that_cannot_work_says_why(ray_nodes: RayNodes, tmp_path: Path) -> None:
    # (first: before this module's session attaches the notebook to the test cluster)
    # a loopback controller that ranks on node1 and node2 could not reach
    profile = ray_profile(ray_nodes, tmp_path)
    profile.write_text(profile.read_text().replace(f'controller_ip = "{LOGIN}"',
                                                   'controller_ip = "127.0.0.1"'))
    with pytest.raises(ClusterError, match=r"controller_ip '127.0.0.1' is loopback, but Ray "
                       r"placed ranks on 10\.231\.0\.11, 10\.231\.0\.12"):
        Cluster(profile=profile).start(progress=False)
    # no cluster where the profile says, and no local one asked for
    profile = ray_profile(ray_nodes, tmp_path, address=f'"{LOGIN}:1"')
    with pytest.raises(ClusterError, match=r"no Ray cluster at address '10\.231\.0\.1:1'"):
        Cluster(profile=profile).start(progress=False)
    profile = ray_profile(ray_nodes, tmp_path, address='"head-node"')  # no port
    with pytest.raises(ClusterError, match=r"address 'head-node' in \[launcher\] is not a Ray "
                       r"address: give \"auto\""):
        Cluster(profile=profile).start(progress=False)
    # hosts are Ray's to choose
    with pytest.raises(ValueError, match="the ray launcher places ranks"):
        profiles.from_dict("mine", {"cluster": {"launcher": "ray", "hosts": ["node1"]}})


def test_ranks_fill_one_node_then_the_next_and_training_across_nodes_matches_one_process(
        ray_session: Session) -> None:
    cluster = ray_session.cluster
    facts = [cluster.run(RANK_FACTS, keep_values=True).values[r] for r in range(4)]
    # PACK put two bundles on each node; rank 0's store on node1's address, gloo on its link
    assert [f[0] for f in facts] == ["node1", "node1", "node2", "node2"], facts
    assert {f[1] for f in facts} == {ADDRESS["node1"]} and {f[2] for f in facts} == {"eth0"}
    cluster.init_mesh("dp=2 tp=2")  # tp's groups [0, 1] and [2, 3]: each on one node
    result = cluster.run(TRAIN_CHECK, keep_values=True, timeout=300)
    for r in range(4):
        reduced, ok, loss_error, param_error = result.values[r]
        assert reduced == 10.0  # 1 + 2 + 3 + 4, from both nodes
        assert ok, (r, loss_error, param_error)  # meshlab.verify.compare's fp32 tolerances
    # a time limit's Ctrl-C reaches every node's ranks (Ray's threads block SIGINT)
    with pytest.raises(MeshError, match="time limit") as stopped:
        cluster.run("import time\ntime.sleep(60)", timeout=3)
    assert "deaf to interrupts" not in str(stopped.value)
    assert cluster.run("rank", keep_values=True).values == {r: r for r in range(4)}


def test_nothing_of_meshlabs_listens_where_the_profile_did_not_say(
        ray_session: Session) -> None:
    cluster = ray_session.cluster
    cluster.run("dist.all_reduce(torch.ones(1))")  # gloo has connected every pair
    controller = psutil.Process(cluster._ipp.controller.process.pid)
    seen = {f"controller pid {p.pid}": listening_sockets(p.pid)
            for p in [controller, *controller.children(recursive=True)]}
    # Ray's driver is in the notebook: its gRPC server listens on every interface, as Ray
    # 2.60's servers all do (its token guards them: docs/guides/security.md); meshlab's own
    # sockets are held to the profile's address
    driver = ray_driver_port()
    notebook = listening_sockets(psutil.Process().pid)
    assert ("::", driver) in notebook or ("0.0.0.0", driver) in notebook, (driver, notebook)
    seen["notebook"] = {(ip, port) for ip, port in notebook if port != driver}
    for r, h in enumerate(cluster._hosts):
        seen[f"rank {r} on {h['host']}"] = listening_sockets(h["pid"])
    allowed = {"controller": LOGIN, "notebook": LOGIN}
    wrong = [f"{who} listens on {ip}:{port}" for who, sockets in seen.items()
             for ip, port in sockets
             if ip != allowed.get(who.split()[0], ADDRESS.get(who.split()[-1], ""))
             and not ipaddress.ip_address(ip).is_loopback]
    assert not wrong, "\n".join(wrong)
    assert all({ip for ip, _ in seen[f"rank {r} on {h}"]} >= {ADDRESS[h]}
               for r, h in enumerate(cluster.host_of)), seen
    # the cluster's connection reached the actors as a task's argument, in no command line
    keys = [cluster._client.curve_serverkey.decode(), cluster.cell_channel.key.hex()]
    carrying = [p.pid for p in psutil.process_iter(["cmdline"])
                if any(k in " ".join(p.info["cmdline"] or []) for k in keys)]
    assert not carrying


def ray_driver_port() -> int:
    """The port of the Ray driver in this process: its objects' owner's address."""
    import ray
    from ray.core.generated import common_pb2

    owner = common_pb2.Address()
    owner.ParseFromString(ray._private.worker.global_worker.core_worker.get_owner_address(
        ray.put(0)))
    return int(owner.port)


def test_the_ray_cluster_refuses_a_client_without_its_token(ray_nodes: RayNodes) -> None:
    # from node2, as anyone on the network: the GCS answers no one without the token
    done = subprocess.run(
        ["nsenter", "-t", str(host_pid("node2")), "--net", "--", sys.executable, "-m",
         "ray.scripts.scripts", "status", "--address", ray_nodes.address],
        capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(ray_nodes.folder), "RAY_AUTH_MODE": "token",
             "RAY_AUTH_TOKEN": secrets.token_hex(32)})  # a guess
    assert done.returncode != 0
    assert "Authentication token is missing or incorrect" in done.stdout + done.stderr


def test_a_rank_whose_actor_dies_is_named_with_rays_reason(ray_session: Session) -> None:
    launcher = next(iter(ray_session.cluster._ipp.engines.values()))
    import ray

    pid = ray_session.cluster._hosts[3]["pid"]  # rank 3's engine: which actor started it
    actor = next(a for a, p in zip(launcher.actors, launcher.placed, strict=True)
                 if p["pid"] == pid)
    ray.kill(actor)  # its engine ends with it (PR_SET_PDEATHSIG)
    with pytest.raises(MeshError, match="rank 3"):
        ray_session.run("import time\ntime.sleep(60)", timeout=120)
    dead = ray_session.cluster.dead()
    assert list(dead) == [3], dead
    assert dead[3].startswith("its Ray actor died: ") and "(on node2)" in dead[3], dead
    with pytest.raises(ClusterError, match="rank 3 died: its Ray actor died"):
        ray_session.run("1")
    ray_session.restart(progress=lambda line: None)
    assert ray_session.cluster.host_of == ["node1", "node1", "node2", "node2"]


def test_a_node_whose_link_goes_down_is_reported_and_restart_brings_the_session_back(
        ray_nodes: RayNodes, ray_session: Session) -> None:
    with node2_cut_mid_collective(ray_session) as (error, dead):
        assert all("node2" in text for text in dead.values()), dead
        assert "node2" in error, error
    # Ray took node2 for dead and its raylet left: the node comes back as an operator
    # (KubeRay) brings a worker back, and the restart places its bundles there again
    ray_nodes.stop("node2")
    ray_nodes.start_worker("node2")
    ray_nodes.wait_for(3)
    restart_replays_w_on_both_hosts(ray_session)


def test_the_exported_ray_job_reproduces_the_notebooks_losses(
        ray_nodes: RayNodes, ray_session: Session, shell: object, tmp_path: Path) -> None:
    # a second session on the same Ray cluster, in the same notebook: they share its one
    # attachment (ray.init is one per process), and its stop leaves the first's working
    session = shell.magics_manager.registry["MeshMagics"].session  # type: ignore[attr-defined]
    shared, journal = session.cluster, session.journal
    session.cluster = None  # the shared local cluster steps aside, untouched
    try:
        profile = ray_profile(ray_nodes, tmp_path, cpus_per_rank="0.25")
        for cell in [f"%mesh start --profile {profile}", "%mesh init dp=4", TRAIN,
                     f"%mesh export {tmp_path / 'train.py'} --ray --nodes 2"]:
            with capture_output():
                assert shell.run_cell(cell, store_history=True).success, cell  # type: ignore
        interactive = shell.run_line_magic("mesh", "pull losses")[0]  # type: ignore
        shell.run_line_magic("mesh", "stop")  # type: ignore[attr-defined]
    finally:
        if session.cluster is not None:
            session.cluster.stop()
        session.cluster, session.journal = shared, journal
    assert ray_session.run("rank", keep_values=True).values == {r: r for r in range(4)}
    elsewhere = ray_profile(ray_nodes, tmp_path, address=f'"{LOGIN}:1"')
    with pytest.raises(ClusterError, match=r"this notebook is attached to the Ray cluster at "
                       f"'{ray_nodes.address}' for another session"):
        Cluster(profile=elsewhere).start(progress=False)
    ray_session.stop()  # the job's bundles take each node's 2 CPUs (a process per CPU)
    done = subprocess.run([sys.executable, str(tmp_path / "ray_job.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={**ray_nodes.env, "PATH": "/usr/bin:/bin",
                               "RAY_ADDRESS": ray_nodes.address})
    assert done.returncode == 0, done.stderr[-4000:]
    printed = [ast.literal_eval(line.removeprefix("losses ")) for line in done.stdout.splitlines()
               if line.startswith("losses ")]
    assert printed == [interactive], done.stdout[-4000:]
