"""%%mesh --memory on a GPU: the CUDA allocator's history of a training step, in the format
torch's memory viewer (pytorch.org/memory_viz) opens, beside MemTracker's categories."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the CUDA allocator's history needs a GPU: none here", allow_module_level=True)


def test_a_training_steps_allocator_history_opens_in_the_memory_viewer(tmp_path: Path) -> None:
    from torch.cuda._memory_viz import trace_plot

    from meshlab.measure import memory_timeline
    from meshlab.models import ModelConfig, Transformer

    model = Transformer(ModelConfig()).cuda()
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 256, (8, 64), device="cuda")
    memory_timeline.start({"model": model, "opt": opt})
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    opt.step()
    timeline = memory_timeline.stop(rank=0)
    assert timeline is not None and timeline.device == "cuda"
    path = timeline.save(tmp_path)
    snapshot = pickle.loads(path.read_bytes())
    allocs = [e for trace in snapshot["device_traces"] for e in trace if e["action"] == "alloc"]
    assert allocs and all(e["frames"] for e in allocs[:10])  # with the Python stacks
    html = trace_plot(snapshot)  # what memory_viz draws: the page torch makes from it
    assert "snapshot.pickle" in html
    peak = timeline.peak
    assert peak is not None and peak.bytes["optimizer states"] > 0
    print(f"allocator history: {len(allocs)} allocations; MemTracker peak "
          f"{sum(peak.bytes.values()) / 2**20:.1f} MiB in {peak.phase} of {peak.module}")
    folder = os.environ.get("GPU_PASS_RESULTS")
    if folder:
        (Path(folder) / "memory_history.pickle").write_bytes(path.read_bytes())
