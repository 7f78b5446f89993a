"""Security: what listens where, who can read the keys, and who can run code on the ranks.

Real components only: the shared 4-rank cluster's controller and engines, their sockets as
the kernel reports them (psutil), their connection files, messages forged with
jupyter_client's Session and sent over ZeroMQ to the controller as ipyparallel's client
does, and the files `%mesh export` writes.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ipyparallel as ipp
import psutil
import pytest
import zmq
from accounts import SOCKETS_OF, as_user, local_user
from jupyter_client.session import Session

from meshlab import Cluster, runtime
from meshlab.notebook import profiles
from meshlab.notebook.export import Journal

REPO = Path(__file__).resolve().parents[2]


def security_dir(cluster: Cluster) -> Path:
    return Path(cluster._ipp.profile_dir, "security")


def connection_file(cluster: Cluster, who: str = "client") -> Path:
    return security_dir(cluster) / f"ipcontroller-{cluster._ipp.cluster_id}-{who}.json"


def connection(cluster: Cluster) -> dict[str, Any]:
    return json.loads(connection_file(cluster).read_text())


def with_children(pids: list[int]) -> list[psutil.Process]:
    """The processes and everything they started (schedulers, engine nannies)."""
    found = []
    for pid in pids:
        process = psutil.Process(pid)
        found += [process, *process.children(recursive=True)]
    return found


def cluster_processes(cluster: Cluster) -> dict[str, list[psutil.Process]]:
    return {"controller": with_children([cluster._ipp.controller.process.pid]),
            "engines": with_children([h["pid"] for h in cluster._hosts])}


def listening(process: psutil.Process) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


@ipp.interactive
def _rank_env() -> dict[str, str | None]:
    import os

    return {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")}


# -- 1. everything listens on loopback only ----------------------------------------------------


@pytest.mark.cluster
def test_controller_engines_and_gloo_listen_on_loopback_only(cluster: Cluster) -> None:
    cluster.run("dist.all_reduce(torch.ones(1))")  # gloo has connected every pair
    env = cluster._client[cluster._engines[0]].apply_sync(_rank_env)
    exposed, ports, by_role = [], {}, {}
    for role, processes in cluster_processes(cluster).items():
        by_role[role] = set()
        for process in processes:
            found = listening(process)
            ports[process.pid] = found
            by_role[role] |= found
            exposed += [f"{role} pid {process.pid} ({' '.join(process.cmdline()[1:3])}) "
                        f"listens on {ip}:{port}" for ip, port in found if not is_loopback(ip)]
    assert not exposed, "\n".join(exposed)
    # gloo binds the hostname's address unless told: told, in case the hostname is not loopback
    assert env["GLOO_SOCKET_IFNAME"] == runtime.LOOPBACK_INTERFACE
    # not vacuous: every rank's gloo and the controller's client-facing ports are checked
    assert all(ports[h["pid"]] for h in cluster._hosts), ports
    client = connection(cluster)
    assert {("127.0.0.1", client[k]) for k in ("registration", "mux", "task", "control")} \
        <= by_role["controller"]


def _other_address() -> str | None:
    """An IPv4 address of this machine that is not loopback."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                return str(a.address)
    return None


GLOO_PROBE = """
import json, psutil, torch, torch.distributed as dist
from meshlab import runtime

def listening():
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN}

# plain torch: gloo binds to the address the hostname resolves to
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
plain = listening()
dist.destroy_process_group()
before = listening()
# as a cluster whose ranks are all on this host bootstraps them
runtime.setup(rank=0, world_size=1, local_rank=0, store_file=runtime.private_store(30),
              backend="gloo", timeout=30)
dist.all_reduce(torch.ones(1))
print(json.dumps({"plain": sorted(plain), "meshlab": sorted(listening() - before)}))
"""


def test_gloo_stays_on_loopback_when_the_hostname_resolves_elsewhere() -> None:
    # gloo picks its address from the hostname; here the hostname resolves to loopback, so
    # run one rank in its own UTS namespace whose hostname is this machine's outer address
    address = _other_address()
    if address is None or shutil.which("unshare") is None:
        pytest.skip("needs a non-loopback address and unshare(1)")
    if subprocess.run(["unshare", "-u", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -u is not permitted here (needs CAP_SYS_ADMIN)")
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    done = subprocess.run(
        ["unshare", "-u", "sh", "-c", f'hostname {address} && exec "$0" -c "$1"',
         sys.executable, GLOO_PROBE],
        capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    # the hazard is real here: without meshlab, gloo listens on the outer address
    assert address in {ip for ip, _ in seen["plain"]}, seen
    assert seen["meshlab"], seen  # gloo's own listener
    assert all(is_loopback(ip) for ip, _ in seen["meshlab"]), seen


def test_the_store_binds_the_address_it_is_given_and_leaves_host_names_to_torch() -> None:
    assert runtime.bind_address("127.0.0.1") == "127.0.0.1"
    assert runtime.bind_address("localhost") == "127.0.0.1"
    assert runtime.bind_address("::1") == "::1"
    assert runtime.bind_address("node17") is None  # may resolve differently on the peers
    assert runtime.is_loopback("::1") and runtime.is_loopback("localhost")
    assert not runtime.is_loopback("10.1.2.3") and not runtime.is_loopback("node17")


# -- 2. connection files -------------------------------------------------------------------


@pytest.mark.cluster
def test_connection_files_are_0600_in_a_0700_directory(cluster: Cluster) -> None:
    for folder in (Path(cluster._ipp.profile_dir), security_dir(cluster)):  # its own profile
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, oct(folder.stat().st_mode)
        assert folder.stat().st_uid == os.getuid()
    for who in ("client", "engine"):
        path = connection_file(cluster, who)
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == 0o600, f"{path.name}: {oct(mode)}"
        assert path.stat().st_uid == os.getuid()
        assert json.loads(path.read_text())["curve_serverkey"], f"{path.name} holds no key"


# -- 3. the controller's key --------------------------------------------------------------------


@contextlib.contextmanager
def controller_socket(cluster: Cluster, port: str, server_key: bytes | None
                      ) -> Iterator[zmq.Socket[Any]]:
    """A DEALER on one of the controller's client-facing ports, as ipyparallel's client has:
    a CurveZMQ client of ``server_key`` (None: none, the NULL mechanism)."""
    info = connection(cluster)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    # a send waits for a connection: one the controller refused never comes (under load the
    # refusal can come before the send), so it gives up after 5 s (zmq.Again)
    sock.sndtimeo = 5000
    if server_key is not None:
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(f"{info['interface']}:{info[port]}")
    try:
        yield sock
    finally:
        sock.close()


def send_execute(cluster: Cluster, sock: zmq.Socket[Any], port: str, code: str,
                 rank: int = 3) -> None:
    """An execute_request for one rank's engine (unsigned: ipyparallel signs nothing under
    CurveZMQ, where the handshake is what authenticates)."""
    info = connection(cluster)
    engine = cluster._client._engines[cluster._engines[rank]]  # the engine's ZeroMQ identity
    session = Session(key=b"", signature_scheme=info["signature_scheme"], username="intruder")
    content = {"code": code, "silent": False, "user_expressions": {}}
    if port == "mux":  # the mux routes by the identity frame
        session.send(sock, "execute_request", content=content, ident=engine.encode())
    else:  # the task scheduler routes by the targets in the metadata
        session.send(sock, "execute_request", content=content, metadata={"targets": [engine]})


def appears(path: Path, within: float) -> bool:
    deadline = time.monotonic() + within
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


FORGERIES = {"no key": None, "a wrong key": zmq.curve_keypair()[0]}


@pytest.mark.cluster
@pytest.mark.parametrize("port", ["mux", "task"])
@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_message_to_the_controller_without_its_key_runs_nothing(
        cluster: Cluster, tmp_path: Path, forgery: str, port: str) -> None:
    forged, keyed = tmp_path / "forged", tmp_path / "keyed"
    key = connection(cluster)["curve_serverkey"].encode()
    with (controller_socket(cluster, port, FORGERIES[forgery]) as intruder,
          controller_socket(cluster, port, key) as client):
        with contextlib.suppress(zmq.Again):  # refused before it could even be sent
            send_execute(cluster, intruder, port, f"open({str(forged)!r}, 'w')")
        # the positive control, sent after the forgery to the same engine
        send_execute(cluster, client, port, f"open({str(keyed)!r}, 'w')")
        assert appears(keyed, within=30), "the message with the server key did not run either"
        assert not appears(forged, within=1.0), f"a message with {forgery} ran"
    assert cluster.run("1").ok


# -- 4. no keys in what meshlab and ipyparallel write --------------------------------------


@pytest.mark.cluster
def test_exports_logs_and_command_lines_hold_no_connection_key(
        cluster: Cluster, shell: Any, tmp_path: Path) -> None:
    # the controller's CurveZMQ key (ipyparallel's HMAC key is empty under CURVE) and the
    # cell channel's
    keys = {json.loads(connection_file(cluster, who).read_text())["curve_serverkey"]
            for who in ("client", "engine")} | {cluster.cell_channel.key.hex()}
    session = shell.magics_manager.registry["MeshMagics"].session
    saved, session.journal = session.journal, Journal(cluster.world_size, cluster.backend)
    try:
        shell.user_ns["lr"] = 0.01
        assert shell.run_cell("%%mesh\nx = torch.ones(2) * rank\n", store_history=True).success
        shell.run_line_magic("mesh", "push lr")
        shell.run_line_magic("mesh", f"export {tmp_path / 'train.py'} --sbatch")
    finally:
        session.journal = saved
    exported = [tmp_path / name for name in ("train.py", "launch.sh", "job.sbatch")]
    ipp, cid = cluster._ipp, cluster._ipp.cluster_id
    logs = {*Path(ipp.profile_dir, "log").glob(f"*{cid}*"),
            security_dir(cluster) / f"cluster-{cid}.json",  # readable by all (0644)
            Path(ipp.controller.output_file)}
    for engine_set in ipp.engines.values():  # a forkserver's log, or one per engine
        for launcher in [engine_set, *getattr(engine_set, "launchers", {}).values()]:
            if getattr(launcher, "output_file", ""):
                logs.add(Path(launcher.output_file))
    assert all(p.is_file() for p in exported), exported
    assert len(logs) >= 3, logs  # the controller's, the engines', the forkserver's exits...
    for path in [*exported, *sorted(logs)]:
        text = path.read_text(errors="replace")
        assert not [k for k in keys if k in text], f"{path} holds a connection key"
    # any user can read a process's command line (ps): the key travels in the 0600 files
    for processes in cluster_processes(cluster).values():
        for process in processes:
            command = " ".join(process.cmdline())
            assert not [k for k in keys if k in command], f"pid {process.pid}: {command}"


# -- 5. profiles name their bind address ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(profiles.available()))
def test_every_shipped_profile_names_a_bind_address(name: str) -> None:
    profile = profiles.load(name)
    assert profile.controller_ip.strip() not in ("", "*", "0.0.0.0", "::", "[::]")
    assert not ipaddress.ip_address(profile.controller_ip).is_unspecified
    assert not profile.allow_all_interfaces
    if profile.launcher == "local":
        assert ipaddress.ip_address(profile.controller_ip).is_loopback


def test_shipped_profiles_are_the_files_in_clusters() -> None:
    assert set(profiles.available()) == {p.stem for p in (REPO / "clusters").glob("*.toml")}


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "*", "", "::", "[::]"])
def test_a_profile_binding_all_interfaces_is_refused_unless_allowed(wildcard: str) -> None:
    data: dict[str, Any] = {"cluster": {"launcher": "slurm", "controller_ip": wildcard}}
    with pytest.raises(ValueError, match=r"listens on all interfaces.*allow_all_interfaces = true"):
        profiles.from_dict("open", data)
    data["cluster"]["allow_all_interfaces"] = True
    assert profiles.from_dict("open", data).controller_ip == wildcard


def test_a_profile_may_name_an_interface_address_or_host() -> None:
    for address in ("10.0.0.5", "login1.cluster", "fd00::2"):
        data = {"cluster": {"launcher": "slurm", "controller_ip": address}}
        assert profiles.from_dict("p", data).controller_ip == address


# -- 5. another user on the machine --------------------------------------------------------

INTRUDER = "meshlab-intruder"


@pytest.fixture(scope="session")
def intruder() -> str:
    """A second, unprivileged local user, created here (CI runs as root)."""
    return local_user(INTRUDER)


@pytest.mark.cluster
def test_cut_output_cannot_be_redirected_read_or_left_behind_by_another_user(
        intruder: str, test_profile: Path, tmp_path: Path) -> None:
    import tempfile

    precious = tmp_path / "precious.txt"
    precious.write_text("mine\n")
    # the old, guessable folder made first, 0777, its files links to a file of ours
    planted = as_user(intruder, f"""
import os
root = os.path.join({tempfile.gettempdir()!r}, "meshlab-{os.getpid()}")
os.makedirs(root, exist_ok=True); os.chmod(root, 0o777)
for n in range(1, 60):
    cell = os.path.join(root, f"cell-{{n}}")
    os.makedirs(cell, exist_ok=True); os.chmod(cell, 0o777)
    for r in range(2):
        os.symlink({str(precious)!r}, os.path.join(cell, f"rank{{r}}.stdout"))
""")
    assert planted.returncode == 0, planted.stderr
    with Cluster(2, profile=test_profile) as ranks:
        ranks.max_output_lines = 3
        result = ranks.run("for i in range(20): print('secret', i)", timeout=60)
        folder = Path(result.full_output or "")
        assert folder.is_dir() and folder.parent.name.startswith("meshlab-output-")
        for path, mode in [(folder.parent, 0o700), (folder, 0o700),
                           (folder / "rank0.stdout", 0o600)]:
            assert stat.S_IMODE(path.lstat().st_mode) == mode, f"{path}: {oct(path.stat().st_mode)}"
        assert "secret 19" in (folder / "rank0.stdout").read_text()
        peek = as_user(intruder, f"print(open({str(folder / 'rank0.stdout')!r}).read())")
        assert peek.returncode != 0 and "PermissionError" in peek.stderr, peek
    assert precious.read_text() == "mine\n"  # nothing written through the links
    assert not folder.parent.exists()  # removed with the cluster
    shutil.rmtree(Path(tempfile.gettempdir()) / f"meshlab-{os.getpid()}", ignore_errors=True)


def test_a_dead_kernels_output_folders_are_swept_and_no_one_elses(intruder: str,
                                                                  tmp_path: Path) -> None:
    from meshlab.rank.private_files import STORE_PREFIX, private_dir

    dead = tmp_path / "meshlab-output-999999999-abc"  # a pid no process has
    alive = tmp_path / f"meshlab-output-{os.getpid()}-abc"
    theirs = tmp_path / "meshlab-output-999999998-abc"
    dead_rank = tmp_path / "meshlab-store-999999999-abc"  # a rank 0 killed with its store
    for folder in (dead, alive, theirs, dead_rank):
        folder.mkdir()
    shutil.chown(theirs, user=intruder)
    made = private_dir(tmp_path)
    assert not dead.exists() and alive.exists() and theirs.exists()
    assert not dead_rank.exists()
    assert made.name.startswith(f"meshlab-output-{os.getpid()}-")
    assert private_dir(tmp_path, STORE_PREFIX).name.startswith(f"meshlab-store-{os.getpid()}-")


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


@pytest.mark.cluster
def test_frames_from_another_user_to_the_cell_channel_are_never_buffered(
        intruder: str, cluster: Cluster) -> None:
    """Three 200 MB frames, sent as a ZeroMQ peer would (ZMTP 3.0, the NULL mechanism: what
    any client library speaks), by a user who does not hold the cluster's key."""
    port = int(cluster.cell_channel.address.rsplit(":", 1)[1])
    before = rss(os.getpid())
    flood = as_user(intruder, f"""
import socket, struct
s = socket.create_connection(("127.0.0.1", {port}))
s.sendall(b"\\xff" + bytes(8) + b"\\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\\0") + bytes(32))
ready = b"\\x05READY" + b"\\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
sent, chunk = 0, bytes(2**20)
try:
    s.sendall(bytes([0x04, len(ready)]) + ready)
    for frame in range(3):
        s.sendall(b"\\x02" + struct.pack(">Q", 200 * 2**20))  # a long frame, the last part
        for _ in range(200):
            s.sendall(chunk)
            sent += len(chunk)
except OSError as e:
    print("cut off:", type(e).__name__)
print("sent", sent)
""")
    assert flood.returncode == 0, flood.stderr
    cluster.cell_channel.poll(0.5)  # what a cell would read first
    grown = rss(os.getpid()) - before
    assert "cut off" in flood.stdout and grown < 100 * 2**20, (flood.stdout, grown)
    assert cluster.run("rank").outputs[3].result == "3"


# -- 6. the rendezvous store ---------------------------------------------------------------

# What another user with no torch runs: every TCP socket this uid listens on (any user may
# read /proc/net/tcp), each spoken to as torch's TCPStore client does: validate, ping, then
# set a key and read it back. Prints the sockets it tried, and what each that answered said.
STORE_PROBE = SOCKETS_OF + r"""
import json, os, socket, struct, sys
from concurrent.futures import ThreadPoolExecutor

VALIDATE, SET, GET, GETNUMKEYS, PING = 0, 1, 3, 7, 13
MAGIC = 0x3C85F7CE  # torch's TCPStore validation number
KEY, VALUE = b"/meshlab-intruder", b"written by another user"


def sized(data):
    return struct.pack("<Q", len(data)) + data


def as_store(address):
    nonce = os.getpid() & 0x7FFFFFFF
    try:
        with socket.create_connection(address, timeout=2) as sock:
            sock.sendall(struct.pack("<BI", VALIDATE, MAGIC) + struct.pack("<BI", PING, nonce))
            if exactly(sock, 4) != struct.pack("<I", nonce):
                return None
            sock.sendall(bytes([SET]) + sized(KEY) + sized(VALUE) + bytes([GET]) + sized(KEY))
            read = exactly(sock, struct.unpack("<Q", exactly(sock, 8))[0])
            sock.sendall(bytes([GETNUMKEYS]))
            keys = struct.unpack("<q", exactly(sock, 8))[0]
            return {"read back": read.decode(), "keys": keys}
    except OSError:
        return None


found = sorted(set(listeners(int(sys.argv[1]))))
with ThreadPoolExecutor(16) as pool:
    said = dict(zip(found, pool.map(as_store, found)))
print(json.dumps({"probed": [f"{ip}:{port}" for ip, port in found],
                  "stores": {f"{ip}:{port}": s for (ip, port), s in said.items() if s}}))
"""


def stores_another_user_reaches(user: str) -> tuple[set[str], dict[str, dict[str, Any]]]:
    """The sockets of this uid ``user`` tried ("ip:port"), and those that answered as a
    TCPStore, with what each said."""
    done = as_user(user, STORE_PROBE, str(os.getuid()), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    return set(seen["probed"]), seen["stores"]


def loopback_store() -> Any:
    """A TCPStore this test serves on loopback: the probe must find it and use it."""
    import torch.distributed as dist

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def cluster_sockets(cluster: Cluster) -> dict[str, str]:
    """"ip:port" -> which process of the cluster (or the notebook) listens there."""
    owners = {h["pid"]: f"rank {r}" for r, h in enumerate(cluster._hosts)}
    ours = {}
    for role, processes in cluster_processes(cluster).items():
        for process in [*processes, psutil.Process()]:  # the notebook: the cell channel
            who = owners.get(process.pid, "the notebook" if process.pid == os.getpid()
                             else role)
            ours |= {f"{ip}:{port}": f"{who} (pid {process.pid})"
                     for ip, port in listening(process)}
    return ours


@ipp.interactive
def _store_file() -> str | None:
    import meshlab.runtime

    return meshlab.runtime._store_file


@pytest.mark.cluster
def test_no_socket_of_the_cluster_answers_another_user_as_a_store(
        cluster: Cluster, intruder: str) -> None:
    cluster.run("dist.all_reduce(torch.ones(1))")  # gloo has connected every pair
    ours = cluster_sockets(cluster)
    control = loopback_store()
    probed, stores = stores_another_user_reaches(intruder)
    # not vacuous: the probe wrote to the test's own store and read it back, and it tried
    # every socket of the cluster
    assert stores.get(f"127.0.0.1:{control.port}") == {
        "read back": "written by another user", "keys": 1}, stores
    assert control.get("meshlab-intruder") == b"written by another user"
    assert set(ours) <= probed, sorted(set(ours) - probed)
    reached = [f"{ours[where]} at {where} answered as a TCPStore: {said}"
               for where, said in stores.items() if where in ours]
    assert not reached, "\n".join(reached)


@pytest.mark.cluster
def test_another_user_cannot_open_the_store_file(cluster: Cluster, intruder: str) -> None:
    path = Path(cluster._client[cluster._engines[0]].apply_sync(_store_file))
    # the store the ranks rendezvous on: their process group's keys are in it
    assert b"meshlab/gen" in path.read_bytes()
    for item, mode in [(path.parent, 0o700), (path, 0o600)]:
        info = item.lstat()
        assert (stat.S_IMODE(info.st_mode), info.st_uid) == (mode, os.getuid()), item
    assert path.parent.name.startswith(f"meshlab-store-{cluster._hosts[0]['pid']}-")
    for attempt in (f"open({str(path)!r}, 'rb')", f"open({str(path)!r}, 'ab')",
                    f"os.listdir({str(path.parent)!r})"):
        tried = as_user(intruder, f"import os; {attempt}")
        assert tried.returncode != 0 and "PermissionError" in tried.stderr, (attempt, tried)


@ipp.interactive
def _rendezvous_env() -> dict[str, str | None]:
    import os

    return {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}


@pytest.mark.cluster
def test_ranks_on_one_host_name_no_rendezvous_port(cluster: Cluster) -> None:
    # no TCP store listens: a port named here could since be another user's listener
    envs = cluster._client[cluster._engines].apply_sync(_rendezvous_env)
    assert envs == [{"MASTER_ADDR": None, "MASTER_PORT": None}] * cluster.world_size


@pytest.mark.cluster
def test_the_store_folder_goes_with_the_cluster(test_profile: Path) -> None:
    with Cluster(2, profile=test_profile) as ranks:
        path = Path(ranks._client[ranks._engines[0]].apply_sync(_store_file))
        assert path.is_file()
        ranks.regroup()  # a new generation of keys in the same file
        assert ranks.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()",
                         keep_values=True).values == {0: 2.0, 1: 2.0}
    assert not path.parent.exists()


def test_an_export_is_never_written_through_a_link_or_into_another_users_folder(
        intruder: str, tmp_path: Path) -> None:
    # another user made the export folder first, launch.sh and job.sbatch links to our files:
    # the export followed them, overwrote both and made them 0755
    from meshlab.notebook.export import ExportError, Journal, export

    journal = Journal(world_size=4, backend="gloo")
    journal.record_cell("x = 1", 2)
    precious = tmp_path / "precious.sh"
    precious.write_text("mine\n")
    os.chmod(tmp_path, 0o755)  # the victim's folder, as Debian's default home
    shared = Path("/tmp") / f"meshlab-export-bait-{os.getpid()}"
    planted = as_user(intruder, f"""
import os
os.makedirs({str(shared)!r}, mode=0o777); os.chmod({str(shared)!r}, 0o777)
for name in ("launch.sh", "job.sbatch"):
    os.symlink({str(precious)!r}, os.path.join({str(shared)!r}, name))
""")
    try:
        assert planted.returncode == 0, planted.stderr
        with pytest.raises(ExportError, match=r"belongs to another user .*: they could read or "
                                              r"replace train\.py; write into a folder of"):
            export(journal, shared / "train.py", sbatch=True)
        # our own folder, with a link left in it: refused before anything is written
        mine = tmp_path / "out"
        mine.mkdir()
        (mine / "launch.sh").symlink_to(precious)
        with pytest.raises(ExportError, match=r"launch\.sh is a link \(to .*precious\.sh\): "
                                              r"meshlab does not write through links"):
            export(journal, mine / "train.py")
        assert not (mine / "train.py").exists()  # nothing half written
        assert precious.read_text() == "mine\n" and stat.S_IMODE(precious.stat().st_mode) == 0o644
        # written: only its owner reads it (it holds the cells and pushed values)
        (mine / "launch.sh").unlink()
        written = export(journal, mine / "train.py", sbatch=True)
        assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in written} == {
            "train.py": 0o600, "launch.sh": 0o700, "job.sbatch": 0o600}
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_checkpoint_another_user_planted_runs_none_of_its_code(intruder: str) -> None:
    # its .metadata was a pickle that ran the attacker's code as the victim on every rank
    from meshlab.checkpoint.sharded import CheckpointError, load

    planted = Path("/tmp") / f"meshlab-ckpt-bait-{os.getpid()}"
    ran = planted.with_name(planted.name + ".ran")
    made = as_user(intruder, f"""
import json, os, pickle
class Payload:
    def __reduce__(self):
        return (os.system, ("touch {ran}",))
os.makedirs({str(planted)!r})
with open(os.path.join({str(planted)!r}, ".metadata"), "wb") as f:
    pickle.dump(Payload(), f)
json.dump({{"names": ["step"], "kinds": {{"step": "value"}}, "world_size": 1}},
          open(os.path.join({str(planted)!r}, "meshlab.json"), "w"))
""")
    try:
        assert made.returncode == 0, made.stderr
        with pytest.raises(CheckpointError, match=r"belongs to another account \(uid \d+\), and "
                                                  r"loading a checkpoint reads pickles, which "
                                                  r"run code: if you trust whoever"):
            load(planted, {"step": None})
        assert not ran.exists()  # nothing of it ran
    finally:
        shutil.rmtree(planted, ignore_errors=True)
        ran.unlink(missing_ok=True)


def test_the_profilers_trace_is_written_where_no_one_else_can_plant_a_link(
        tmp_path: Path) -> None:
    # torch writes "<path>.tmp" without O_NOFOLLOW; in /tmp, under a name another user could
    # watch for, a planted link there overwrote a file of ours (46 of 48 races won)
    import torch

    from meshlab.measure.profiling import _chrome_trace

    seen: dict[str, int] = {}
    with torch.profiler.profile() as profiler:
        torch.ones(4).sum()
    export = profiler.export_chrome_trace

    def watched(path: str) -> None:
        folder = Path(path).parent
        seen["mode"] = stat.S_IMODE(folder.stat().st_mode)
        seen["owner"] = folder.stat().st_uid
        seen["others"] = len([p for p in folder.iterdir()])
        export(path)

    profiler.export_chrome_trace = watched  # type: ignore[method-assign]
    trace = _chrome_trace(profiler)
    assert seen == {"mode": 0o700, "owner": os.getuid(), "others": 0}
    assert b"traceEvents" in trace
