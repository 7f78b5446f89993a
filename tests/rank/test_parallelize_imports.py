"""What the first ``parallelize`` imports: only what the model it is given needs.

A fresh interpreter, one gloo rank: a model written by hand is parallelized without importing
transformers (every family's import table, torchao and dynamo: 5 to 12 seconds before a
rank's first step, on each rank)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, tempfile
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from meshlab.parallel import ParallelPlan, parallelize

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.blocks = nn.Embedding(16, 8), nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 16)
    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
model = parallelize(Model(), mesh, ParallelPlan())
model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
print(sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torchao")))
dist.destroy_process_group()
"""


def test_parallelize_of_a_model_written_by_hand_imports_no_transformers(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
