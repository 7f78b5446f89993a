"""A shared node: a victim that is a normal account (Debian's 0755 home) runs a session, and a
second unprivileged account attacks it as any local user can: every socket the victim listens
on (any user may read /proc/net/tcp), spoken to as a ZeroMQ peer without a key would, and
the victim's files under its home.

Real components only: the victim's own notebook process (meshlab.Cluster from this checkout,
its controller, forkserver and ranks), the intruder's plain Python with raw sockets (ZMTP 3.0
by hand: what any ZeroMQ library sends).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import select
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from accounts import SOCKETS_OF, as_user, local_user, meshlab_as

INTRUDER, VICTIM = "meshlab-intruder", "meshlab-victim"
SECRET = "victim-secret"

# The victim's notebook: 2 ranks printing, displaying and writing to their fds in a loop
# until told to stop; then what it measured. A line on stdin moves it on.
VICTIM_SESSION = r"""
import json, os, select, sys
import psutil
import meshlab

session = meshlab.Session(2)
session.start(progress=False)
cluster = session.cluster
me = psutil.Process()
controller = psutil.Process(cluster._ipp.controller.process.pid)
ranks = [psutil.Process(h["pid"]) for h in cluster._hosts]
log = os.path.join(cluster._ipp.profile_dir, "log")


def tree(p):
    return [p, *p.children(recursive=True)]


def ports():
    roles = {}
    for role, processes in (("notebook", [me]), ("controller", tree(controller)),
                            ("rank", [p for r in ranks for p in tree(r)])):
        for p in processes:
            for c in p.net_connections("inet"):
                if c.status == psutil.CONN_LISTEN:
                    roles[c.laddr.port] = role
    return roles


def state():
    return {"notebook": me.memory_info().rss,
            "controller": sum(p.memory_info().rss for p in tree(controller)),
            "logs": {f: os.path.getsize(os.path.join(log, f)) for f in os.listdir(log)}}


CELL = ("from IPython.display import display; display('SECRET display'); "
        "print('SECRET print'); import os; os.system('echo SECRET fd')"
        ).replace("SECRET", sys.argv[1])
cluster.run(CELL)
print("READY", json.dumps({"pid": os.getpid(), "ports": ports(), "log": log,
                           "cluster_id": cluster._ipp.cluster_id, "before": state()}), flush=True)
cells = 0
while not select.select([sys.stdin], [], [], 0)[0]:
    cluster.run(CELL)
    cells += 1
sys.stdin.readline()
print("DONE", json.dumps({"cells": cells, "after": state(), "ok": cluster.run("rank").ok}),
      flush=True)

# the files: the intruder's folder and checkpoint, then the victim's own in its 0755 home
planted = json.loads(sys.stdin.readline())
home, said = os.path.expanduser("~"), {}
session.push({"lr": 0.01})
session.run("import torch\nmodel = torch.nn.Linear(4, 4)\nstep = 3")
for what, attempt in [
        ("export", lambda: session.export(os.path.join(planted["export"], "train.py"),
                                          sbatch=True)),
        ("load", lambda: session.checkpoint("load", planted["checkpoint"]))]:
    try:
        attempt()
        said[what] = "done"
    except Exception as e:
        said[what] = f"{type(e).__name__}: {e}"
# in folders anyone may enter (0755, as the home itself): only the files' own modes protect
shared = os.path.join(home, "shared")
os.makedirs(os.path.join(shared, "traces"), exist_ok=True)
for folder in (shared, os.path.join(shared, "traces")):
    os.chmod(folder, 0o755)
mine = {"export": os.path.join(shared, "train.py"),
        "checkpoint": os.path.join(shared, "ckpt"), "traces": os.path.join(shared, "traces")}
session.export(mine["export"], sbatch=True)
session.checkpoint("save", mine["checkpoint"], ["model", "step"])
session.run("x = torch.ones(2)", profile_dir=mine["traces"])
print("FILES", json.dumps({"said": said, "mine": mine}), flush=True)
sys.stdin.readline()  # the test kills this process here, as a crash kills a kernel
"""

# The intruder: each listening socket of the victim's uid, greeted as ZMTP 3.0 with the NULL
# mechanism (no key). Where the server greets back with NULL: subscribe to everything and
# read for a while, then send an unsigned message and a 200 MB frame. Where it greets back
# with another mechanism: the 200 MB frame anyway (it should be cut off at once).
ATTACK = SOCKETS_OF + r"""
import json, socket, struct, sys, time
from concurrent.futures import ThreadPoolExecutor

UID, SECRET, READ_S = int(sys.argv[1]), sys.argv[2].encode(), float(sys.argv[3])
GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)


def ready(kind):
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(kind)) + kind
    return bytes([0x04, len(body)]) + body


def greet(address):
    # what the server answers: its mechanism, "closed" (cut off at the greeting: a CURVE
    # server does that to a NULL peer) or "silent" (not ZeroMQ: gloo waits for its own)
    sock = socket.create_connection(address, timeout=2)
    sock.sendall(GREETING)
    data = b""
    try:
        while len(data) < 64:
            chunk = sock.recv(64 - len(data))
            if not chunk:
                return sock, "closed"
            data += chunk
    except OSError:
        return sock, "closed" if data else "silent"
    return sock, data[12:32].rstrip(b"\0").decode(errors="replace")


def flood(sock, kind):
    sent = 0
    try:
        sock.sendall(ready(kind))
        sock.sendall(b"\x02" + struct.pack(">Q", 200 * 2**20))
        for _ in range(200):
            sock.sendall(bytes(2**20))
            sent += 2**20
    except OSError:
        pass
    return sent


def attack(address):
    said = {"address": "%s:%d" % address}
    sock, said["mechanism"] = greet(address)
    if said["mechanism"] == "silent":
        sock.close()
        return said
    if said["mechanism"] == "NULL":
        sock.sendall(ready(b"SUB") + b"\x00\x01\x01")  # subscribe to every topic
        heard, deadline = b"", time.monotonic() + READ_S
        sock.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                heard += sock.recv(2**16)
            except socket.timeout:
                pass
            except OSError:
                break
        said["heard"], said["secret"] = len(heard), SECRET in heard
        sock.close()
        sock, _ = greet(address)
        forged = [b"<IDS|MSG>", b"", b'{"msg_type": "execute_request"}', b"{}", b"{}", b"{}"]
        try:
            sock.sendall(ready(b"DEALER") + b"".join(
                bytes([1 if i < len(forged) - 1 else 0, len(f)]) + f for i, f in enumerate(forged)))
        except OSError:
            pass
        sock.close()
        sock, _ = greet(address)
    said["flooded"] = flood(sock, b"DEALER")
    sock.close()
    return said


found = sorted(set(listeners(UID)))
with ThreadPoolExecutor(32) as pool:
    print(json.dumps(list(pool.map(attack, found))))
"""


# The intruder's bait: an export folder of its own (0777) whose launch.sh and job.sbatch are
# links to a file of the victim's, and a checkpoint whose .metadata is a pickle that runs code.
PLANT = r"""
import json, os, pickle, sys, tempfile
root = tempfile.mkdtemp(prefix="meshlab-bait-", dir=sys.argv[1])
os.chmod(root, 0o777)
export, checkpoint = os.path.join(root, "export"), os.path.join(root, "checkpoint")
precious, ran = os.path.join(root, "precious.txt"), os.path.join(root, "ran")
with open(precious, "w") as f:
    f.write("the victim's own\n")  # (in the victim's stead: it is another user's file)
os.chmod(precious, 0o666)
os.makedirs(export)
os.chmod(export, 0o777)
for name in ("launch.sh", "job.sbatch"):
    os.symlink(precious, os.path.join(export, name))


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {ran}",))


os.makedirs(checkpoint)
with open(os.path.join(checkpoint, ".metadata"), "wb") as f:
    pickle.dump(Payload(), f)
with open(os.path.join(checkpoint, "meshlab.json"), "w") as f:
    json.dump({"names": ["step"], "kinds": {"step": "value"}, "world_size": 2}, f)
print(json.dumps({"export": export, "checkpoint": checkpoint, "precious": precious,
                  "ran": ran, "root": root}))
"""


def victim_files(mine: dict[str, str]) -> dict[str, str]:
    """Every file the victim's export, checkpoint and trace wrote."""
    export = Path(mine["export"])
    found = {f"export {p.name}": str(p) for p in export.parent.iterdir() if p.is_file()}
    found |= {f"checkpoint {p.name}": str(p) for p in Path(mine["checkpoint"]).iterdir()}
    found |= {f"trace {p.name}": str(p) for p in Path(mine["traces"]).iterdir()}
    return found


@pytest.fixture(scope="module")
def intruder() -> str:
    return local_user(INTRUDER)


@pytest.fixture(scope="module")
def victim() -> str:
    return local_user(VICTIM, home=True)


def said(session: subprocess.Popen[str], tag: str, timeout: float) -> dict[str, Any]:
    """The JSON after ``tag`` on the victim's next line of output."""
    assert session.stdout is not None
    if not select.select([session.stdout], [], [], timeout)[0]:
        session.kill()
        pytest.fail(f"the victim said nothing in {timeout} s: {session.communicate()[1][-3000:]}")
    line = session.stdout.readline()
    assert line.startswith(tag), (line, session.stderr.read() if session.poll() else "")
    return json.loads(line[len(tag):])


def tell(session: subprocess.Popen[str]) -> None:
    assert session.stdin is not None
    session.stdin.write("\n")
    session.stdin.flush()


@pytest.mark.cluster
def test_another_user_reaches_no_output_memory_log_or_file_of_a_victims_session(
        intruder: str, victim: str) -> None:
    victim_uid = pwd.getpwnam(victim).pw_uid
    with meshlab_as(victim, VICTIM_SESSION, SECRET) as session:
        start = said(session, "READY", timeout=120)
        attacked = as_user(intruder, ATTACK, str(victim_uid), SECRET, "3", timeout=120)
        tell(session)
        done = said(session, "DONE", timeout=60)
        planted = as_user(intruder, PLANT, "/tmp")
        assert planted.returncode == 0, planted.stderr
        bait = json.loads(planted.stdout)
        assert session.stdin is not None
        session.stdin.write(json.dumps(bait) + "\n")
        session.stdin.flush()
        files = said(session, "FILES", timeout=120)
        peeks = {what: as_user(intruder, f"print(open({path!r}, 'rb').read(64))")
                 for what, path in victim_files(files["mine"]).items()}
        log = Path(start["log"])
        left = sorted(p.name for p in log.glob(f"*{start['cluster_id']}*"))
        peek = as_user(intruder, f"import os; print(os.listdir({str(log)!r}))")
        os.kill(start["pid"], signal.SIGKILL)  # the kernel dies; its watchdog stops the rest
        stderr = session.communicate(timeout=30)[1]
    assert attacked.returncode == 0, attacked.stderr[-3000:]
    sockets = json.loads(attacked.stdout)
    roles = {int(port): role for port, role in start["ports"].items()}
    # every socket of the session was tried: the notebook's cell channel, the controller's
    # and the ranks' (gloo's and the nannies')
    assert {int(s["address"].rsplit(":", 1)[1]) for s in sockets} >= set(roles), sockets
    # (rows 1, 3, 4) no ZeroMQ socket of the session speaks to a peer without its key
    plain = [s for s in sockets if s["mechanism"] not in ("CURVE", "closed", "silent")]
    assert not plain, f"sockets that took a peer without a key: {plain}"
    assert not [s for s in sockets if s.get("secret")], "another user read the cells' output"
    # the rest are gloo's, in the ranks (gloo authenticates no one: the guide says so)
    silent = {int(s["address"].rsplit(":", 1)[1]) for s in sockets if s["mechanism"] == "silent"}
    assert {roles.get(port) for port in silent} <= {"rank"}, (silent, roles)
    before, after = start["before"], done["after"]
    grown = {k: after[k] - before[k] for k in ("notebook", "controller")}
    assert max(grown.values()) < 100 * 2**20, grown  # three 200 MB frames grew them 600 MB
    # the controller's log (the engines' holds the cells' fd output, which grows as they run)
    logs = {name: after["logs"][name] - size for name, size in before["logs"].items()
            if name.startswith("ipcontroller-")}
    assert logs and max(logs.values()) < 1024, (before, after)  # 67 MB before
    assert done["ok"] and done["cells"] > 0, done
    assert "Traceback" not in stderr, stderr[-3000:]  # forged messages put tracebacks there
    # (row 2) the logs hold the ranks' fd output: in a folder only the victim can enter
    assert left, f"no log of the cluster in {log}"
    assert "PermissionError" in peek.stderr, peek
    for folder in (log.parent, log, log.parent / "security"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    for name in left:
        assert (log / name).stat().st_mode & 0o777 == 0o600, name
    # (rows 5, 6) the intruder's export folder and checkpoint: refused, nothing written or run
    assert re.search(r"belongs to another user \(uid \d+\)", files["said"]["export"]), files
    assert re.search(r"belongs to another account \(uid \d+\)", files["said"]["load"]), files
    assert Path(bait["precious"]).read_text() == "the victim's own\n"  # not written through
    assert not Path(bait["ran"]).exists()  # the planted pickle never ran
    # (row 8) what the victim wrote in 0755 folders: none of it readable by another user
    assert len(peeks) >= 6, peeks
    for what, peek in peeks.items():
        assert peek.returncode != 0 and "PermissionError" in peek.stderr, (what, peek)
    shutil.rmtree(bait["root"])
    shutil.rmtree(Path(files["mine"]["export"]).parent)
    # ... and a killed kernel's logs go with the next session of that user
    sweep = ("import sys; from meshlab.rank.private_files import private_profile as p; "
             "p(sys.argv[1])")
    with meshlab_as(victim, sweep, str(log.parent)) as swept:
        assert swept.communicate(timeout=60)[0] == ""
    assert not list(log.glob(f"*{start['cluster_id']}*")), sorted(log.iterdir())
