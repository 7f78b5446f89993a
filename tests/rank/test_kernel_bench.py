"""meshlab.bench and %mesh bench: kernels timed beside their references, checked, per rank."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from meshlab import runtime
from meshlab.kernels.bench import bench, peak_bandwidth

# The ranks (and this process) time a Triton kernel with do_bench on a GPU, in Triton's
# interpreter on a CPU
TRITON_TIMER = "do_bench" if torch.cuda.is_available() else "interpreter"


def test_bench_times_a_callable_beside_its_reference_and_checks_it() -> None:
    frame = bench(lambda x: x * 2, lambda x: x + x, sizes=[8, 24], mode="full", name="double")
    assert list(frame["provider"]) == ["triton", "torch", "triton", "torch"]
    assert sorted(frame["size"]) == [8, 8, 24, 24]
    assert set(frame["kernel"]) == {"double"} and set(frame["mode"]) == {"full"}
    assert (frame["correct"] == True).all() and frame["error"].isna().all()  # noqa: E712
    assert (frame["p20_ms"] <= frame["median_ms"]).all()
    assert (frame["median_ms"] <= frame["p80_ms"]).all()
    assert (frame["gbps"] > 0).all()
    if runtime.device().type == "cuda":
        assert set(frame["timer"]) == {"do_bench"}
        # a GPU whose peak bandwidth meshlab knows (H100, H200, ...) gets a % of it
        known = peak_bandwidth(runtime.device()) is not None
        assert frame["peak_pct"].notna().all() if known else frame["peak_pct"].isna().all()
        return
    # CPU rows say what timed them, so nobody reads interpreter time as kernel speed
    assert set(frame["timer"]) <= {"interpreter", "cpu wall clock"}
    assert frame["peak_pct"].isna().all()  # no peak bandwidth for a CPU


def test_the_rank_device_is_the_one_the_runtime_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    # bench and calibrate ask runtime.device(): a rank's pinned GPU, not whichever is current
    pinned = runtime.RankState(rank=1, world_size=2, cluster_rank=1, cluster_size=2,
                               local_rank=1, device=torch.device("cuda", 1), backend="nccl",
                               timeout=60.0)
    monkeypatch.setattr(runtime, "_state", pinned)
    assert runtime.device() == torch.device("cuda", 1)


def test_without_the_runtime_the_device_is_the_current_gpu_or_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_state", None)
    expected = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                else torch.device("cpu"))
    assert runtime.device() == expected


def test_bench_reports_a_wrong_result_and_a_failing_kernel_as_rows() -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("failed to compile: tl.foo is not defined\nmore detail")

    wrong = bench(lambda x: x * 2.5, lambda x: x * 2, sizes=[16])
    assert list(wrong["correct"]) == [False, True]
    assert wrong["error"][0].startswith("wrong result: max error")
    failed = bench(broken, lambda x: x * 2, sizes=[16, 32])
    first_line = "RuntimeError: failed to compile: tl.foo is not defined"
    assert list(failed["error"][::2]) == [first_line] * 2
    # the reference still ran and was timed
    assert failed["median_ms"][1::2].notna().all() and failed["correct"][1::2].all()


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": "both"}, "mode='both' is not one of"),
    ({"dtype": "float8"}, "dtype='float8' is not a torch dtype"),
    ({"ref": "lambda x: x"}, "ref='lambda x: x' is not callable"),
])
def test_bench_rejects_bad_options_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench(lambda x: x, **kwargs)


def test_bench_names_the_built_in_kernels_for_an_unknown_one() -> None:
    with pytest.raises(ValueError, match="no built-in kernel 'layernorm': choose one of rmsnorm"):
        bench("layernorm")


USER_KERNEL = """%%mesh
import os
import torch
import triton
import triton.language as tl

@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, 2.0 * tl.load(x_ptr + offsets, mask=mask), mask=mask)

def scale(x):
    y = torch.empty_like(x)
    _scale_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    return y

def scale_on_three_ranks(x):
    if os.environ["RANK"] == "2":
        raise RuntimeError("no kernel here")
    return scale(x)
"""


@pytest.mark.cluster
def test_bench_magic_times_a_built_in_on_every_rank_with_a_chart(shell: Any) -> None:
    with capture_output() as cap:
        shell.run_line_magic("mesh", "bench rmsnorm --sizes 64,100 --mode full -o table")
    frame: pd.DataFrame = shell.user_ns["table"]
    assert len(frame) == 4 * 2 * 2  # ranks x providers x sizes
    assert sorted(set(frame["rank"])) == [0, 1, 2, 3]
    assert (frame["correct"] == True).all(), frame  # noqa: E712 (NaN must fail too)
    assert set(frame.loc[frame["provider"] == "triton", "timer"]) == {TRITON_TIMER}
    assert (frame["vs_fastest_rank"] >= 1).all()
    table, chart = cap.outputs[-2:]
    shown = table.data["text/plain"]  # one row per provider and size, over all ranks
    assert "provider (timer)" in shown and "fastest rank (ms)" in shown, shown
    assert sum(line.lstrip().startswith(("triton", "torch")) for line in shown.splitlines()) \
        == 2 * 2, shown
    assert "<svg" in chart.data["image/svg+xml"] and "rmsnorm" in chart.data["image/svg+xml"]


@pytest.mark.cluster
def test_bench_magic_times_a_users_triton_kernel_from_a_cell(shell: Any) -> None:
    assert shell.run_cell(USER_KERNEL).success
    shell.run_line_magic("mesh", "bench scale --ref 'lambda x: x * 2' --sizes 100,512 -o mine")
    frame: pd.DataFrame = shell.user_ns["mine"]
    assert len(frame) == 16 and (frame["correct"] == True).all(), frame  # noqa: E712
    assert set(frame["kernel"]) == {"scale"}


@pytest.mark.cluster
def test_bench_magic_shows_each_ranks_error_beside_the_others_results(shell: Any) -> None:
    assert shell.run_cell(USER_KERNEL).success
    with capture_output() as cap:
        shell.run_line_magic("mesh", "bench scale_on_three_ranks --ref 'lambda x: x * 3' "
                                     "--sizes 64 -o mixed")
    frame: pd.DataFrame = shell.user_ns["mixed"]
    ours = frame[frame["provider"] == "triton"].set_index("rank")["error"]
    assert ours[2] == "RuntimeError: no kernel here"
    assert all(ours[r].startswith("wrong result: max error") for r in (0, 1, 3))
    assert "[rank 2] triton at size 64: RuntimeError: no kernel here" in cap.stdout
    assert frame.loc[frame["provider"] == "torch", "median_ms"].notna().all()
    if torch.cuda.is_available():
        return  # bf16 runs on GPU ranks; the refusal below is the CPU interpreter's
    # bf16 on a CPU rank: the interpreter's rounding is wrong, so the kernel refuses it
    with capture_output() as cap:
        shell.run_line_magic("mesh", "bench softmax --sizes 32 --dtype bfloat16 --ranks 0")
    assert "[rank 0] triton at size 32: ValueError: x is bfloat16 on CPU" in cap.stdout


def test_bench_magic_rejects_bad_sizes(shell: Any) -> None:
    with pytest.raises(UsageError, match="--sizes '64,x': give row lengths like 256,1024"):
        shell.run_line_magic("mesh", "bench rmsnorm --sizes 64,x")
