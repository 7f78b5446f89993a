"""meshlab.measure.throttle in this process: it slows compute, leaves torch's mode stack as it found
it in any order, and stays out of fake tensors and compiled code's way."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import torch.utils._python_dispatch as dispatch
from torch._subclasses.fake_tensor import FakeTensorMode

from meshlab.measure import comms
from meshlab.measure.throttle import MIN_SLEEP_S, Throttle, current_factor, off, slept, throttle

A = torch.randn(128, 128)


def stack() -> list[str]:
    return [type(torch._C._get_dispatch_stack_at(i)).__name__
            for i in range(torch._C._len_torch_dispatch_stack())]


def flags() -> tuple[bool, bool, bool]:
    return (dispatch._is_in_torch_dispatch_mode, dispatch._is_in_non_infra_torch_dispatch_mode,
            dispatch._is_in_any_mode_without_ignore_compile_internals)


def matmuls(n: int = 40) -> float:
    """Seconds ``n`` matmuls took, by the wall clock."""
    started = time.perf_counter()
    for _ in range(n):
        A @ A
    return time.perf_counter() - started


@pytest.fixture(autouse=True)
def _full_speed() -> Iterator[None]:
    off()
    yield
    off()
    comms.stop()
    assert stack() == [] and flags() == (False, False, False)


# The mechanism, not a speed: what the throttle measured and slept (a loaded machine makes
# every op slower, throttled or not, so a ratio of two timings says little; benchmarks/
# straggler.py measures what a throttled rank does to its peers).
def test_throttle_sleeps_factor_minus_one_times_each_ops_own_time() -> None:
    throttle(3)
    mode = dispatch._get_current_dispatch_mode()
    assert isinstance(mode, Throttle)
    took = matmuls()
    assert mode.computed_s > 0 and slept() > 0
    # every op's time is owed twice over: paid (slept, overshoot included) or still owed
    assert slept() + mode.owed_s == pytest.approx(2 * mode.computed_s, rel=1e-9)
    assert mode.owed_s < MIN_SLEEP_S
    assert took >= slept() + mode.computed_s  # the sleeps happened inside the loop


def test_off_restores_full_speed_and_an_empty_mode_stack() -> None:
    throttle(3)
    off()
    assert current_factor() == 1.0 and stack() == [] and slept() == 0.0
    matmuls()
    assert slept() == 0.0 and dispatch._get_current_dispatch_mode() is None


@pytest.mark.parametrize("bad", [0.5, 0, -2, float("nan"), float("inf"), "fast"])
def test_a_bad_factor_raises_naming_the_value_and_the_fix(bad: object) -> None:
    with pytest.raises(ValueError, match=r"throttle factor .*(>= 1|not a number)") as e:
        throttle(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(e.value)
    assert current_factor() == 1.0


def test_calling_it_again_changes_the_factor_in_place() -> None:
    throttle(2)
    throttle(4)
    assert current_factor() == 4.0 and stack() == ["Throttle"]


def test_a_with_block_puts_back_the_factor_before_it() -> None:
    throttle(2)
    with throttle(5):
        assert current_factor() == 5.0
    assert current_factor() == 2.0
    with throttle(1):  # full speed inside the block only
        assert stack() == []
    assert current_factor() == 2.0 and stack() == ["Throttle"]


def test_the_comms_tracer_entered_after_it_leaves_first_or_last() -> None:
    throttle(3)
    comms.start()
    assert stack() == ["Throttle", "CommTracer"]
    off()  # out of order: the tracer stays, alone
    assert stack() == ["CommTracer"] and flags() == (True, True, True)
    comms.stop()
    assert stack() == [] and flags() == (False, False, False)


def test_turned_on_under_a_running_tracer_it_goes_beneath_it() -> None:
    comms.start()
    throttle(3)  # as a cell under %%mesh --comms would
    assert stack() == ["Throttle", "CommTracer"]
    comms.stop()  # the tracer's own LIFO exit pops the tracer, not the throttle
    assert stack() == ["Throttle"] and flags() == (True, True, False)
    off()


def test_fake_and_meta_tensors_are_not_slowed() -> None:
    throttle(3)
    with FakeTensorMode():
        x = torch.randn(512, 512)
        for _ in range(20):
            x @ x
    y = torch.empty(512, 512, device="meta")
    for _ in range(20):
        y @ y
    assert slept() == 0.0


def test_compiled_code_stays_compiled_under_it() -> None:
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(lambda x: (x @ x).tanh(), backend=counter)
    throttle(3)  # ignore_compile_internals: dynamo compiles rather than falls back to eager
    compiled(A)
    assert counter.frame_count == 1
    assert isinstance(dispatch._get_current_dispatch_mode(), Throttle)
    torch._dynamo.reset()
