"""A rank says which global random generators a cell drew from: what lets an export warn that
a failed cell it leaves out made the script's random numbers differ from the notebook's."""

from __future__ import annotations

import io
import random

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from meshlab.rank import cell_exec, rng_state


@pytest.mark.parametrize("draw, drawn", [
    (lambda: torch.randn(3), ["torch"]),
    (lambda: torch.nn.Linear(2, 2), ["torch"]),  # its initialization
    (lambda: torch.manual_seed(1), ["torch"]),
    (lambda: random.random(), ["random"]),
    (lambda: (torch.ones(3) * 2, random.getstate()), []),  # computes, draws nothing
])
def test_a_generator_whose_state_moved_is_named(draw: object, drawn: list[str]) -> None:
    torch.manual_seed(0)
    before = rng_state.snapshot()
    draw()  # type: ignore[operator]
    # torch.manual_seed seeds CUDA too where it is up: the CPU's story is the same either way
    assert [g for g in rng_state.drawn(before) if g != "cuda"] == drawn


def test_seeding_again_with_the_same_seed_is_no_draw() -> None:
    torch.manual_seed(0)
    before = rng_state.snapshot()
    torch.manual_seed(0)
    assert rng_state.drawn(before) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_generator_is_watched_once_cuda_is_up() -> None:
    torch.cuda.init()
    before = rng_state.snapshot()
    torch.randn(3, device="cuda")
    assert rng_state.drawn(before) == ["cuda"]


def test_a_failed_cells_reply_says_what_it_drew_before_failing() -> None:
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell(config=config)
    streams = {"stdout": io.StringIO(), "stderr": io.StringIO()}
    header, _ = cell_exec.run_cell(shell, "import torch\nw = torch.randn(4)\n1 / 0", 1, False,
                                   streams)
    assert header["status"] == "error" and header["drew"] == ["torch"]
    header, _ = cell_exec.run_cell(shell, "raise ValueError('no draw')", 2, False, streams)
    assert header["status"] == "error" and header["drew"] == []
