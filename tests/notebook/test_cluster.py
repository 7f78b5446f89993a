"""A real 4-rank gloo cluster driven through meshlab.Cluster."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipyparallel as ipp
import psutil
import pytest

from meshlab import Cluster, ClusterError, MeshError
from meshlab.notebook.output import strip_ansi

pytestmark = pytest.mark.cluster


def test_every_rank_has_its_names_and_env(cluster: Cluster) -> None:
    # on one host the store is a file: no MASTER_ADDR/MASTER_PORT names a port to dial
    result = cluster.run("import os\n(rank, world_size, str(device), os.environ['RANK'], "
                         "os.environ['LOCAL_RANK'], os.environ.get('MASTER_ADDR'), "
                         "os.environ.get('MASTER_PORT'), dist.get_backend())")
    for r in range(4):
        assert result.outputs[r].result == f"({r}, 4, 'cpu', '{r}', '{r}', None, None, 'gloo')"


def test_all_reduce_sums_across_ranks(cluster: Cluster) -> None:
    result = cluster.run("t = torch.tensor([float(rank)])\ndist.all_reduce(t)\nprint(t.item())")
    assert result.stdout() == "[ranks 0-3] 6.0"


def test_subset_runs_only_on_the_named_ranks(cluster: Cluster) -> None:
    result = cluster.run("print('here', rank)", ranks="0,2-3")
    assert sorted(result.outputs) == [0, 2, 3]
    assert result.stdout() == "[rank 0] here 0\n[rank 2] here 2\n[rank 3] here 3"


def test_equal_results_collapse_and_different_ones_do_not(cluster: Cluster) -> None:
    assert cluster.run("world_size").results() == "Out[ranks 0-3]: 4"
    assert cluster.run("rank % 2", ranks="0-2").results() == "Out[ranks 0,2]: 0\nOut[rank 1]: 1"


def test_errors_on_some_ranks_are_summarised_and_the_others_keep_their_output(
        cluster: Cluster) -> None:
    with pytest.raises(MeshError) as info:
        cluster.run("print('before', rank)\nif rank in (1, 3):\n    raise ValueError(f'bad {rank}')"
                    "\nrank")
    result = info.value.result
    assert result.failed == [1, 3]
    assert "[rank 1] ValueError: bad 1\n  [rank 3] ValueError: bad 3" in result.summary()
    assert result.results() == "Out[rank 0]: 0\nOut[rank 2]: 2"
    assert "before 1" in result.stdout()
    tb = strip_ansi("\n".join(result.first_traceback()))
    assert tb.startswith("Traceback from rank 1:") and "raise ValueError" in tb
    assert "ipyparallel" not in tb and "ipykernel" not in tb


def test_timeout_on_a_hung_collective_names_the_ranks_and_their_stacks_then_recovers(
        cluster: Cluster) -> None:
    with pytest.raises(MeshError) as info:
        cluster.run("if rank != 0:\n    dist.all_reduce(torch.ones(1))", timeout=2)
    result = info.value.result
    assert result.failed == [1, 2, 3] and result.outputs[0].status == "ok"
    summary = result.summary()
    assert "[ranks 1-3] still running after the 2 s time limit" in summary
    assert "[ranks 1-3] stack when stopped:" in summary and "all_reduce" in summary
    assert "process-group timeout" in summary
    # The next cell waits out the stuck collective, re-forms the group, and is right.
    after = cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert after.results() == "Out[ranks 0-3]: 4.0"


def test_ctrl_c_interrupts_every_rank_and_the_cluster_stays_usable(cluster: Cluster) -> None:
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(MeshError) as info:
        cluster.run("import time\nwhile True:\n    time.sleep(0.05)")
    assert "[ranks 0-3] interrupted (KeyboardInterrupt)" in info.value.result.summary()
    assert cluster.run("rank").results().startswith("Out[rank 0]: 0")


def test_ctrl_c_reaches_ranks_that_start_the_cell_after_something_else(
        cluster: Cluster) -> None:
    # the ranks are still in a call of the notebook's when Ctrl-C comes: its SIGINT ends that
    # call, and they start the cell after it; the cell must stop all the same
    busy = cluster._client.direct_view(cluster._engines).apply_async(time.sleep, 3)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(MeshError) as info:
        cluster.run("import time\nwhile True:\n    time.sleep(0.05)", timeout=60)
    assert "[ranks 0-3] interrupted (KeyboardInterrupt)" in info.value.result.summary()
    busy.wait(30)  # ended by the first SIGINT, or done: either way, over
    assert cluster.run("rank").results().startswith("Out[rank 0]: 0")


def test_a_cell_brings_back_each_ranks_optimizer_steps_with_its_output(
        cluster: Cluster) -> None:
    before = cluster.run("1").optimizer_steps
    assert before is not None
    after = cluster.run("opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)\n"
                        "opt.step()\nopt.step()")
    assert after.optimizer_steps == before + 2 == cluster.optimizer_steps()  # as a probe says


def test_push_and_pull_round_trip(cluster: Cluster) -> None:
    cluster.push({"lr": 0.25, "batch": [1, 2]})
    cluster.run("scaled = lr * (rank + 1)")
    assert cluster.pull("scaled") == {0: 0.25, 1: 0.5, 2: 0.75, 3: 1.0}
    assert cluster.pull("batch", ranks="1") == {1: [1, 2]}


def test_pull_of_a_dataclass_with_an_nbytes_field_is_not_taken_for_an_array(
        cluster: Cluster) -> None:
    # the size check before a pull read any .nbytes as numpy's (AllreduceSweep has a list)
    cluster.run("from types import SimpleNamespace\nsweep = SimpleNamespace(nbytes=[4096, 8192])")
    assert cluster.pull("sweep", ranks="0")[0].nbytes == [4096, 8192]


def test_pull_of_an_unknown_name_says_where_it_is_missing(cluster: Cluster) -> None:
    with pytest.raises(KeyError, match="'nope' is not defined on rank"):
        cluster.pull("nope")


def test_pull_of_a_value_that_cannot_travel_names_the_rank_and_reason(cluster: Cluster) -> None:
    cluster.run("numbers = (i for i in range(3))", ranks="2")
    with pytest.raises(ClusterError, match=r"could not pull 'numbers' from rank 2: .*generator"):
        cluster.pull("numbers", ranks="2")


def test_status_reports_every_rank_even_while_a_cell_runs(cluster: Cluster) -> None:
    frame = cluster.status()
    assert list(frame.index) == [0, 1, 2, 3]
    assert {"host", "pid", "device", "alive", "busy", "rss_mb"} <= set(frame.columns)
    assert frame["alive"].all() and (frame["device"] == "cpu").all()
    runner = threading.Thread(target=cluster.run, args=("import time\ntime.sleep(2)",),
                              kwargs={"ranks": "1"})
    runner.start()
    time.sleep(0.5)
    busy = cluster.status()
    runner.join()
    assert busy["alive"].all() and busy.loc[1, "busy"] and not busy.loc[0, "busy"]


def test_stacks_show_where_a_running_cell_is(cluster: Cluster) -> None:
    runner = threading.Thread(target=cluster.run, args=(
        "import time\ndef waiting_here():\n    time.sleep(2)\nwaiting_here()",),
        kwargs={"ranks": "2"})
    runner.start()
    time.sleep(0.7)
    stacks = cluster.stacks("2")
    runner.join()
    assert "waiting_here" in stacks[2]


def test_completion_comes_from_rank_0(cluster: Cluster) -> None:
    cluster.run("only_on_ranks_value = 1")
    assert "only_on_ranks_value" in cluster.complete("only_on_ranks")
    assert "torch.distributed" in cluster.complete("torch.distrib")


def test_process_group_reforms_over_a_subset_and_back(cluster: Cluster) -> None:
    cluster.regroup("1,3")
    result = cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\n(rank, world_size, t.item())",
                         ranks="1,3")
    assert result.results() == "Out[rank 1]: (0, 2, 2.0)\nOut[rank 3]: (1, 2, 2.0)"
    cluster.regroup()
    assert cluster.run("world_size").results() == "Out[ranks 0-3]: 4"


THREADS = "import os\nthreads = len(os.listdir('/proc/self/task'))"  # gloo's are not Python's


def test_meshes_and_re_forms_do_not_pile_up_group_threads(cluster: Cluster) -> None:
    # Each gloo group holds threads until it is freed; torch frees a mesh's groups only
    # with the default group, and a mesh and its views are a cycle only the collector breaks.
    cluster.init_mesh("dp=2,tp=2")
    cluster.run(THREADS, ranks="1")
    once = cluster.pull("threads", ranks="1")[1]
    for _ in range(3):
        cluster.init_mesh("dp=2,tp=2")
        cluster.regroup()
    cluster.run("t = torch.ones(1)\ndist.all_reduce(t)")
    cluster.run(THREADS, ranks="1")
    assert cluster.pull("threads", ranks="1")[1] == once
    assert cluster.run("mesh.mesh_dim_names", ranks="1").results() == \
        "Out[rank 1]: ('dp_shard', 'tp')"


TP_FORWARD = """
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
torch.manual_seed(0)
m = parallelize_module(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                       mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
round(m(torch.ones(2, 8)).sum().item(), 4)
"""


def test_tensor_parallel_works_after_a_re_form(cluster: Cluster) -> None:
    # DTensor caches sharding decisions with the first mesh of a shape; after a re-form the
    # group names restart, so a cached old mesh named missing or other groups (a hang)
    cluster.run("extra = dist.new_group(list(range(world_size)))")  # shift the group names
    cluster.init_mesh("dp=2 tp=2")
    before = cluster.run(TP_FORWARD, timeout=60).results()
    cluster.regroup()  # rebuilds the mesh on the new group, its names counted from 0 again
    assert cluster.run(TP_FORWARD, timeout=60).results() == before

def test_bad_arguments_name_the_problem(cluster: Cluster, test_profile: object) -> None:
    with pytest.raises(ValueError, match="out of range"):
        cluster.run("1", ranks="7")
    with pytest.raises(ValueError, match="at least 1 rank"):
        Cluster(0)
    with pytest.raises(ValueError, match="backend 'mpi'"):
        Cluster(2, backend="mpi")
    with pytest.raises(ClusterError, match="no cluster is running"):
        Cluster(2).run("1")


@pytest.fixture(scope="module")
def debug_cluster(test_profile: Path, tmp_path_factory: pytest.TempPathFactory) -> Cluster:
    """Two ranks in debug mode, each started as a fresh interpreter (``fork = false``): the
    start-up path without a forkserver is the one these tests keep honest."""
    profile = tmp_path_factory.mktemp("unforked") / "unforked.toml"
    profile.write_text(test_profile.read_text().replace("[cluster]\n", "[cluster]\nfork = false\n"))
    with Cluster(2, profile=profile, debug=True) as c:
        yield c  # type: ignore[misc]


def test_fork_false_starts_each_rank_as_a_process_of_its_own(debug_cluster: Cluster) -> None:
    for pid in debug_cluster.status()["pid"]:
        assert psutil.Process(int(pid)).ppid() == os.getpid()  # no forkserver between


def test_debug_mode_reports_mismatched_collectives_at_once(debug_cluster: Cluster) -> None:
    assert debug_cluster.run("import os\nos.environ['TORCH_DISTRIBUTED_DEBUG']").results() == \
        "Out[ranks 0-1]: 'DETAIL'"
    with pytest.raises(MeshError) as info:
        debug_cluster.run("dist.all_reduce(torch.ones(rank + 1))", timeout=30)
    assert "shape" in info.value.result.summary().lower()
    assert all(o.status == "error" for o in info.value.result.outputs.values())


def test_a_killed_rank_is_reported_not_a_hang(debug_cluster: Cluster) -> None:
    debug_cluster.run("1")  # the group re-formed after the last test's failure: not killed in it
    pid = int(debug_cluster.status().loc[1, "pid"])
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(MeshError) as info:
        debug_cluster.run("import time\ntime.sleep(600)")
    assert "[rank 1] killed by SIGKILL" in info.value.result.summary()
    with pytest.raises(ClusterError, match=r"rank 1 died: killed by SIGKILL.*%mesh restart"):
        debug_cluster.run("1")
    debug_cluster.restart()
    assert debug_cluster.run("world_size").results() == "Out[ranks 0-1]: 2"


def test_output_streams_while_the_cell_runs(cluster: Cluster) -> None:
    seen: list[str] = []
    cluster.run("import time\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('second')",
                ranks="0", on_output=lambda result: seen.append(result.stdout()))
    assert "[rank 0] first" in seen  # shown before the cell finished
    assert seen[-1] == "[rank 0]\nfirst\nsecond"


def test_engines_that_do_not_come_up_in_time_give_a_clear_error(tmp_path: Path) -> None:
    profile = tmp_path / "slow.toml"
    profile.write_text("[cluster]\nstart_timeout = 0.2\n")
    c = Cluster(2, profile=profile)
    with pytest.raises(ClusterError, match=r"only \d of 2 engines registered within 0.2 s "
                                           r"\(profile start_timeout\)\. Engine log tail:"):
        c.start(progress=False)
    assert not c.running


def test_the_profile_gives_the_default_time_limit(cluster: Cluster) -> None:
    cluster.profile.cell_timeout = 1
    try:
        with pytest.raises(MeshError, match="still running after the 1 s time limit"):
            cluster.run("import time\ntime.sleep(30)", ranks="0")
    finally:
        cluster.profile.cell_timeout = None


@pytest.mark.cluster
def test_kept_values_are_the_cells_own_even_after_a_cell_assigns_underscore(
        cluster: Cluster) -> None:
    cluster.run("first, _ = 'a', 'b'")  # IPython stops updating `_` after this
    assert cluster.run("rank * 3", keep_values=True).values == {0: 0, 1: 3, 2: 6, 3: 9}


def test_a_value_the_notebook_cannot_rebuild_is_named_not_kept(cluster: Cluster) -> None:
    result = cluster.run("class OnlyOnTheRanks:\n    pass\nOnlyOnTheRanks()", keep_values=True)
    assert result.values == {}
    assert any(n.startswith("[ranks 0-3] value not kept: ") and "OnlyOnTheRanks" in n
               for n in result.notes), result.notes
    assert cluster.run("rank", keep_values=True).values == {0: 0, 1: 1, 2: 2, 3: 3}


def test_kept_values_are_the_cells_own_after_a_cell_of_a_higher_number(
        cluster: Cluster) -> None:
    cluster.run("'later cell'", number=900)  # a replayed or internal cell numbered past it
    assert cluster.run("rank + 1", keep_values=True, number=5).values == {
        0: 1, 1: 2, 2: 3, 3: 4}


@pytest.mark.cluster
def test_a_stopped_cluster_leaves_no_folder_or_engine_record_behind(test_profile: Path) -> None:
    from meshlab.notebook import launch

    with Cluster(2, profile=test_profile) as pair:
        ipp = pair._ipp
        scratch = Path(launch._scratch[id(ipp)])
        record = Path(ipp.profile_dir, "log", f"engines{ipp.cluster_id}.json")
        exits = Path(next(iter(ipp.engines.values())).exits_file)  # the forkserver's
        assert scratch.is_dir() and scratch.name.startswith("meshlab-") and exits.is_file()
    assert not scratch.exists() and not record.exists() and not exits.exists()
    assert id(ipp) not in launch._scratch


def test_one_stuck_rank_is_named_in_the_singular(cluster: Cluster) -> None:
    # stuck in a group whose timeout outlasts the stop's ladder (a 1 s limit, SIGINT, 2 s
    # grace, the stop signal, 2 s grace) however loaded the machine: in the default group
    # (6 s) a loaded machine saw the collective time out first ("the process group failed")
    cluster.run("import datetime\n"
                "patient = dist.new_group(timeout=datetime.timedelta(seconds=20))")
    with pytest.raises(MeshError) as info:
        cluster.run("if rank == 1:\n    dist.all_reduce(torch.ones(1), group=patient)",
                    timeout=1)
    assert "rank 1 is stuck in native code" in info.value.result.summary()
    after = cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert after.results() == "Out[ranks 0-3]: 4.0"


def test_the_start_bar_names_each_phase_and_is_closed_ready(
        capsys: pytest.CaptureFixture[str]) -> None:
    from meshlab.notebook.launch import StartProgress

    bar = StartProgress(2)  # in a terminal tqdm draws on stderr
    bar.phase("engines")
    bar.registered(1)
    bar.registered(2)
    bar.phase("process group")
    times = bar.close()
    drawn = capsys.readouterr().err
    steps = ["starting the controller: 0/2", "engines registering: ",
             "forming the process group: 2/2", "ready: 2/2"]
    assert [drawn.find(s) for s in steps] == sorted(drawn.find(s) for s in steps), drawn
    assert min(drawn.find(s) for s in steps) >= 0, drawn
    assert list(bar.phases) == ["controller", "engines", "process group"]
    assert re.fullmatch(r"controller \d+\.\d s, engines \d+\.\d s, process group \d+\.\d s",
                        times)


def test_the_ready_line_says_how_long_each_phase_took(test_profile: Path) -> None:
    from meshlab.notebook.session import Session

    session = Session(2, profile=test_profile)
    line = session.start(progress=False)
    session.stop()
    found = re.fullmatch(r"2 ranks ready in (\d+\.\d) s \(controller (\d+\.\d) s, engines "
                         r"(\d+\.\d) s, process group (\d+\.\d) s\): gloo on cpu, profile \S+",
                         line)
    assert found, line
    total, *phases = (float(x) for x in found.groups())
    # the phases are the whole start, as the progress line ends on it, up to rounding
    assert sum(phases) == pytest.approx(total, abs=0.15)


@ipp.interactive
def _fails_on_rank_1(rank: int) -> None:
    import time

    if rank == 1:
        raise OSError(28, "No space left on device")
    time.sleep(2)  # as the others wait for its key in the store


def test_a_rank_failing_in_a_set_up_step_ends_the_wait_and_is_named(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    # a full temp dir: the rank whose store write failed raised, and `%mesh init` waited 90 s
    # for the others, saying only that they were still in it
    monkeypatch.setattr("meshlab.notebook.rank_calls.PEERS_AFTER_A_FAILURE", 0.5)
    with pytest.raises(ClusterError) as failed:
        cluster._apply_each(_fails_on_rank_1, lambda r: {"rank": r}, timeout=120)
    assert re.match(r"_fails_on_rank_1 failed; ranks 0,2-3 are still in it; \[rank 1\] "
                    r"failed: OSError: \[Errno 28\] No space left on device\.", str(failed.value))
    assert cluster.run("rank", timeout=60).ok  # the next cell waits for them, then goes on


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_under_the_store_is_named_before_any_rank_waits(
        cluster: Cluster, tmp_path: Path) -> None:
    import shutil
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    saved = cluster._store_dir
    try:
        fill = os.open(disk / "fill", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError, match="No space left"):  # until the disk says it is full
            while True:
                os.write(fill, bytes(4096))
        os.close(fill)
        cluster._store_dir = disk
        with pytest.raises(ClusterError, match=rf"building the mesh writes the ranks' "
                           rf"rendezvous store in {disk}, and its disk has 0 KiB free: free "
                           rf"space there \(df {tmp_path}\).*nothing ran"):
            cluster.init_mesh("dp=4")
    finally:
        cluster._store_dir = saved
        subprocess.run(["umount", str(disk)], check=True)
        shutil.rmtree(disk)
    assert cluster.run("rank").ok


def _peaks_while(pids: dict[str, list[int]], action: Callable[[], Any]) -> dict[str, int]:
    """How far each group of processes' resident memory rose above where it was, at its
    highest (sampled every 5 ms) while ``action`` ran."""
    procs = {who: [psutil.Process(p) for p in group] for who, group in pids.items()}

    def rss(who: str) -> int:
        return sum(p.memory_info().rss for p in procs[who])

    before = {who: rss(who) for who in procs}
    peaks, done = dict(before), threading.Event()

    def sample() -> None:
        while not done.is_set():
            for who in procs:
                peaks[who] = max(peaks[who], rss(who))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        done.set()
        sampler.join()
    return {who: peaks[who] - before[who] for who in procs}


def test_a_large_pull_streams_past_the_controller_and_is_held_once(cluster: Cluster) -> None:
    # a 1 GiB pull took ~3 GB in the notebook, in rank 0 and in two controller processes
    size = 256 * 2**20
    cluster.run(f"big = torch.arange({size // 4}, dtype=torch.int32)", ranks=[0])
    controller = psutil.Process(cluster._ipp.controller.process.pid)
    got: dict[int, Any] = {}
    grew = _peaks_while(
        {"notebook": [os.getpid()], "rank 0": [cluster._hosts[0]["pid"]],
         "controller": [p.pid for p in [controller, *controller.children(recursive=True)]]},
        lambda: got.update(cluster.pull("big", ranks=[0])))
    assert got[0].shape == (size // 4,) and got[0][-1].item() == size // 4 - 1
    # before: notebook +805 MB, rank 0 +806 MB, the controller +1,074 MB for 268 MB
    assert grew["notebook"] < 1.2 * size and grew["rank 0"] < 64 * 2**20, grew
    assert grew["controller"] < 16 * 2**20, grew
    got.clear()
    cluster.run("del big", ranks=[0])


def test_native_stacks_show_the_frames_below_a_collective_a_rank_is_stuck_in(
        cluster: Cluster) -> None:
    from meshlab.rank.native_stacks import main_thread

    def hang() -> None:
        with pytest.raises(MeshError):  # ranks 1-3 wait for rank 0 until the time limit
            cluster.run("def stuck_here():\n    dist.all_reduce(torch.ones(1))\n"
                        "if rank != 0:\n    stuck_here()", timeout=5)

    runner = threading.Thread(target=hang)
    runner.start()
    deadline = time.monotonic() + 4  # until all three are inside it (a loaded machine is slow)
    while time.monotonic() < deadline and not all(
            "stuck_here" in s for s in cluster.stacks("1-3").values()):
        time.sleep(0.1)
    stacks = cluster.stacks("1-3", native=True)
    runner.join()
    assert sorted(stacks) == [1, 2, 3], stacks
    for rank, stack in stacks.items():
        assert stack.startswith("main thread ("), (rank, stack)
        assert "stuck_here" in stack and "all_reduce" in stack, (rank, stack)
        assert ".so" in stack, (rank, stack)  # a native frame: a shared library's
        assert "0x…" in stack or "0x" not in stack  # raw addresses elided: ranks read alike
    # the next cell waits out the stuck collective and is right
    assert cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").results() == \
        "Out[ranks 0-3]: 4.0"
    # a dump's main thread, as the rank reads it; the reason where there is no stack
    dump = ('Process 7: python\nPython v3.11\n\nThread 7 (active): "MainThread"\n'
            "    wait (libc.so.6)\n    0x7f00aa (libc.so.6)\nThread 9 (idle): \"Thread-1\"\n"
            "    run (threading.py:975)\n")
    assert main_thread(dump) == ("main thread (active), native frames included:\n"
                                 "    wait (libc.so.6)\n    0x… (libc.so.6)")
    cell = ('Thread 7 (idle): "MainThread"\n    stuck (443894094.py:2)\n'
            "    execute (meshlab/rank/cell_exec.py:130)\n    run_cell (x.py:1)\n")
    assert main_thread(cell, {"443894094.py": 12}).splitlines()[1:] == [
        "    stuck (Cell In[12], line 2)", "    … (the engine's frames below the cell)"]
