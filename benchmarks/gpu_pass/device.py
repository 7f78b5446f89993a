"""The device first: what it is, which software runs it, and its two measured ceilings.

Ceilings (METHOD.md): a large device-to-device copy (bytes read + bytes written over time)
and a large bf16 matmul on random data (2*n^3 over time), each the median of 10 timed runs
after 3 warm-ups, timed with CUDA events. Written to $GPU_PASS_RESULTS/device.json for the
summary (and the kernels' % of the measured ceiling). On a CPU it records versions only.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch

# Datasheet peaks (dense): H100 SXM5 80GB: HBM3 3.35 TB/s, bf16 989 TFLOP/s, fp8 1979.
DATASHEET = {"H100": {"hbm_gbs": 3350.0, "bf16_tflops": 989.0, "fp8_tflops": 1979.0},
             "H200": {"hbm_gbs": 4800.0, "bf16_tflops": 989.0, "fp8_tflops": 1979.0}}


def timed_ms(fn, reps: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _dist_version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return "?"


def versions() -> dict:
    import triton

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    for name in ("transformers", "torchao", "liger_kernel", "ipyparallel", "ipykernel",
                 "nbclient", "numpy", "pandas", "altair", "vl_convert"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", None) or _dist_version(name)
        except Exception as e:
            out[name] = f"not importable: {type(e).__name__}: {str(e)[:120]}"
    if torch.cuda.is_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpus=torch.cuda.device_count(),
                   sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30,
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   l2_mb=getattr(props, "L2_cache_size", 0) / 1e6)
    return out


def copy_gbs(nbytes: int = 2**30) -> float:
    """1 GiB each way (far past the 50 MB L2), bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def ceilings() -> dict:
    out: dict = {"copy_gbs": copy_gbs()}
    size = 8192
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    ms = timed_ms(lambda: a @ b)
    out["bf16_tflops"] = 2 * size**3 / (ms * 1e-3) / 1e12
    # the same with torch._scaled_mm in fp8 (e4m3, per-tensor scales), where it runs
    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        ms = timed_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16))
        out["fp8_tflops"] = 2 * size**3 / (ms * 1e-3) / 1e12
    except Exception as e:
        out["fp8_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def main() -> None:
    for cmd in (["nvidia-smi"], ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                "clocks.max.sm,clocks.max.mem,power.limit", "--format=csv"], ["uname", "-a"]):
        try:
            print(subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout)
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"{cmd[0]}: {e}")
    info = versions()
    if torch.cuda.is_available():
        info.update(ceilings())
        sheet = next((v for k, v in DATASHEET.items() if k in info["gpu"]), None)
        if sheet:
            info["datasheet"] = sheet
            info["copy_pct_datasheet"] = 100 * info["copy_gbs"] / sheet["hbm_gbs"]
            info["bf16_pct_datasheet"] = 100 * info["bf16_tflops"] / sheet["bf16_tflops"]
    for key, value in info.items():
        print(f"{key:>20}: {value}")
    folder = Path(os.environ.get("GPU_PASS_RESULTS", "."))
    (folder / "device.json").write_text(json.dumps(info, indent=1, default=str))


if __name__ == "__main__":
    main()
