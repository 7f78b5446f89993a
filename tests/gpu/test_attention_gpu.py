"""The fused attention kernels meshlab.calibrate times on a GPU, and SDPA's own choice.

The rates are printed (and written to $GPU_PASS_RESULTS/attention.json where that is set)
beside the ones the H100 presets take from Tritonbench (pytorch/pytorch#142132), asserted
only to be measured.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("fused attention kernels need a GPU: none here", allow_module_level=True)


def test_calibrate_times_each_fused_kernel_and_names_sdpas_choice(one_rank: None) -> None:
    from meshlab.calibrate.attention import sdpa_default, time_attention
    from meshlab.calibrate.compute import time_matmuls
    from meshlab.plan.hardware import GH100_ATTENTION

    device = torch.device("cuda", torch.cuda.current_device())
    rates = time_attention(device, reps=10)
    default = sdpa_default(device)
    (matmul,) = time_matmuls([(8192, 8192, 8192)], ["bf16"], device, reps=10)
    presets = {k: share * 989.5 for k, share in GH100_ATTENTION.items()}
    print(f"{torch.cuda.get_device_name()}: attention TFLOP/s {rates} (SDPA picks "
          f"{default or 'another'}); bf16 8192^3 {matmul.tflops:.0f}; H100 presets {presets}")
    folder = os.environ.get("GPU_PASS_RESULTS")
    if folder:
        (Path(folder) / "attention.json").write_text(json.dumps(
            {"rates": rates, "default": default, "bf16_matmul": matmul.tflops}, indent=1))
    assert "flash2" in rates, "SDPA's flash backend did not run on this GPU"
    if torch.cuda.get_device_capability() >= (9, 0):
        assert "cudnn" in rates, "SDPA's cuDNN backend did not run on a Hopper GPU"
    assert default in rates
    assert all(t > 0 for t in rates.values()), rates
