"""meshlab.runtime outside the notebook: the bootstrap an exported torchrun script calls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshlab import runtime
from meshlab.rank.private_files import STORE_PREFIX

SCRIPT = """
from meshlab import runtime
from meshlab.rank.private_files import STORE_PREFIX
ns = runtime.init_from_env()
try:  # what transformers imports to build any model, once the quant extra is installed
    import torchao  # noqa: F401
except ImportError:
    pass
t = ns["torch"].ones(1) * ns["rank"]
ns["dist"].all_reduce(t)
print(f"rank {ns['rank']}/{ns['world_size']} {ns['device']} sum={t.item():g}", flush=True)
ns["dist"].destroy_process_group()
"""


def test_torchrun_ranks_bootstrap_with_the_same_module(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    # Two processes share the pipe: their lines may interleave, so match, don't split.
    assert sorted(re.findall(r"rank \d/\d \w+ sum=\d", done.stdout)) == [
        "rank 0/2 cpu sum=1", "rank 1/2 cpu sum=1"]
    # an exported run is as quiet as the notebook's ranks: no torchao CUDA-only extension
    # failing to load on a CPU, no torch deprecation of torchao's registrations
    assert "Failed to load" not in done.stderr and "Enum subclass" not in done.stderr, \
        done.stderr[-3000:]


def test_init_from_env_outside_torchrun_says_how_to_launch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="launch this script with torchrun"):
        runtime.init_from_env()


def test_ports_we_pick_stay_below_the_ephemeral_range() -> None:
    # the kernel's own range, read here independently of runtime's reader
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert runtime.ephemeral_port_floor() == low
    # a store served in a fresh process binds below it (gloo's connections take ports above)
    code = ("from meshlab import runtime\n"
            "print(runtime.serve_store('127.0.0.1', timeout=5))")
    port = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True).stdout)
    assert low - 12000 <= port < low, (low, port)


def test_setup_without_a_store_says_which_to_pass() -> None:
    with pytest.raises(ValueError, match=r"no rendezvous store .*: pass rank 0's "
                                         r"private_store\(\) path, or its serve_store\(\)"):
        runtime.setup(rank=1, world_size=2, local_rank=1)


def test_a_rank_that_cannot_see_rank_0s_store_file_says_so_at_once(tmp_path: Path) -> None:
    # not torch's wait for the file to appear, the whole timeout long
    missing = tmp_path / "meshlab-store-1-abc" / "store"
    with pytest.raises(RuntimeError, match=rf"rank 1 on .*: rank 0's rendezvous store "
                                           rf"{re.escape(str(missing))} is not on this machine"):
        runtime.setup(rank=1, world_size=2, local_rank=1, store_file=str(missing), timeout=600)


STORE_OWNER = """
import os, stat
from meshlab import runtime
from meshlab.rank.private_files import STORE_PREFIX
path = runtime.private_store(timeout=5)
print(path, oct(stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)),
      oct(stat.S_IMODE(os.stat(path).st_mode)))
child = os.fork()
if child == 0:  # as a process a cell forks: its exit runs the handlers it inherited
    import atexit
    atexit._run_exitfuncs()
    os._exit(0)
os.waitpid(child, 0)
print(os.path.exists(path), flush=True)
"""


def test_rank_0s_store_file_is_private_and_goes_when_rank_0_exits_not_its_child() -> None:
    done = subprocess.run([sys.executable, "-c", STORE_OWNER], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    made, after_child = done.stdout.splitlines()
    path, folder_mode, file_mode = made.split()
    assert (folder_mode, file_mode) == ("0o700", "0o600")
    assert Path(path).parent.name.startswith(STORE_PREFIX)
    assert after_child == "True"
    assert not Path(path).parent.exists()

