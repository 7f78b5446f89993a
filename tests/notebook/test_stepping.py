"""%mesh schedule, %mesh pipeline and %mesh step in a real IPython shell on real ranks."""

from __future__ import annotations

from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

SETUP = """%%mesh
from meshlab.models import ModelConfig, Transformer, global_batch
from meshlab.models.llama import loss_fn
cfg = ModelConfig(n_layers=4)
model = Transformer(cfg).double()
batch = global_batch(step=0, batch=8, seq=16, vocab=cfg.vocab_size)
reference = Transformer(cfg).double()
reference_loss = loss_fn(reference(batch[0]), batch[1]).item()
"""


@pytest.mark.cluster
def test_schedule_magic_compares_schedules_in_a_table_and_a_chart(shell: Any) -> None:
    with capture_output() as cap:
        shell.run_line_magic("mesh", "schedule 1f1b,interleaved_1f1b,zb_h1 --stages 4 "
                                     "--microbatches 8 --virtual 2 --costs 1,1,1 -o chosen")
    table, chart = cap.outputs[-2:]
    text = table.data["text/plain"]
    for name in ("1f1b", "interleaved_1f1b", "zb_h1"):
        assert name in text
    assert "bubble" in text and "%" in text and "image/svg+xml" in chart.data
    assert shell.user_ns["chosen"].name == "1f1b"


def test_schedule_magic_shows_a_broken_schedule_with_the_fault_marked(shell: Any) -> None:
    shell.user_ns["mine"] = "0F0 0B0 0F1 0B1\n1F0 1F1 1B1 1B0"
    with pytest.raises(UsageError, match=r"(?s)deadlock: rank 0 waits at 0B0 for 1B0.*<-- 0B0"):
        shell.run_line_magic("mesh", "schedule mine")
    with pytest.raises(UsageError, match=r"unknown schedule 'zb_h9'"):
        shell.run_line_magic("mesh", "schedule zb_h9")


@pytest.mark.cluster
def test_step_runs_a_few_slots_then_the_rest_and_reports_the_loss(shell: Any) -> None:
    shell.run_line_magic("mesh", "init pp=2 dp=2")
    assert shell.run_cell(SETUP).success
    with capture_output() as cap:
        shell.run_line_magic("mesh", "pipeline model --schedule 1f1b --microbatches 4")
    assert "1f1b bound to model" in cap.stdout
    with capture_output() as cap:
        shell.run_line_magic("mesh", "step 3")
    # slots 0-2 of 1F1B on 2 ranks: rank 0 idles in slot 2, waiting for 1B0's gradient
    assert "[pp rank 0] ran 0F0 0F1\n[pp rank 1] ran 1F0 1B0\n" in cap.stdout
    assert "step complete" not in cap.stdout
    with capture_output() as cap:
        shell.run_line_magic("mesh", "step --all")
    loss = float(cap.stdout.split("step complete: loss ")[1].split()[0])
    reference = shell.run_line_magic("mesh", "pull reference_loss")[0]
    assert loss == pytest.approx(reference, abs=1e-6)
    chart = cap.outputs[-1].data["image/svg+xml"]
    assert "measured on the ranks" in chart and "simulated with measured costs" in chart
    with pytest.raises(UsageError, match="this step is complete"):
        shell.run_line_magic("mesh", "step")


@pytest.mark.cluster
def test_pipeline_needs_a_pp_axis(shell: Any) -> None:
    shell.run_line_magic("mesh", "init dp=4")
    with pytest.raises(UsageError, match=r"the mesh has no pp axis: %mesh init pp=N"):
        shell.run_line_magic("mesh", "pipeline model --schedule 1f1b")
