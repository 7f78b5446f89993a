"""A GPU's bf16 matmul rate held for a while: TFLOP/s per window, to see whether a busy GPU
keeps its first seconds' rate (clocks and power beside it, from nvidia-smi).

$ python benchmarks/gpu_pass/sustained.py 90      # seconds; on a CUDA device
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
N, WINDOW = 8192, 5.0
a, b = (torch.randn(N, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
start = time.perf_counter()
while time.perf_counter() - start < SECONDS:
    t, done = time.perf_counter(), 0
    while time.perf_counter() - t < WINDOW:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        done += 20
    rate = 2 * N**3 * done / (time.perf_counter() - t) / 1e12
    smi = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout
    print(f"{time.perf_counter() - start:5.0f} s  {rate:6.0f} TFLOP/s  {smi.strip()}",
          flush=True)
