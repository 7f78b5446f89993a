"""Time a kernel beside its torch reference on this rank: a tidy DataFrame, one row per
(provider, size).

On a GPU the timer is ``triton.testing.do_bench`` (L2 flushed before each call, quantiles
0.5/0.2/0.8, as Liger-Kernel reports) and peak memory is recorded. On a CPU it is a
wall-clock timer after a warm-up call, and a Triton kernel runs in Triton's interpreter:
those rows say ``timer="interpreter"`` so nobody reads them as kernel speed.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from meshlab import runtime
from meshlab.kernels import KERNELS
from meshlab.measure.timing import step_times

if TYPE_CHECKING:
    import pandas as pd

MODES = ("fwd", "bwd", "full")
# HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name()
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12, "A100": 2.0e12}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2,
             torch.float64: 1e-10}


def _default_inputs(rows: int, n: int, dtype: torch.dtype, device: torch.device
                    ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n)
    return (torch.randn(rows, n, generator=gen, dtype=dtype).to(device).requires_grad_(),)


def _bytes(tensors: Sequence[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def bench(fn: str | Callable[..., torch.Tensor], ref: Callable[..., torch.Tensor] | None = None,
          *, sizes: Sequence[int] = (256, 1024), dtype: torch.dtype | str = torch.float32,
          mode: str = "fwd", rows: int | None = None,
          inputs: Callable[..., tuple[torch.Tensor, ...]] | None = None,
          name: str | None = None, reps: int | None = None,
          device: torch.device | None = None) -> pd.DataFrame:
    """Benchmark ``fn`` (a name in meshlab.kernels.KERNELS, or any callable on tensors)
    and ``ref`` over row lengths ``sizes``; ``rows`` rows each (default 4096 on a GPU, 4 on
    a CPU, where the interpreter pays milliseconds per row). ``inputs(rows, n, dtype,
    device)`` makes the arguments (default: one rows x n tensor). Errors are rows too."""
    import pandas as pd

    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    if isinstance(dtype, str):
        dtype = _dtype(dtype)
    device = device or runtime.device()
    gpu = device.type == "cuda"
    rows = rows or (4096 if gpu else 4)
    bytes_moved: Callable[[tuple[torch.Tensor, ...]], int] | None = None
    flops = None
    if isinstance(fn, str):
        if fn not in KERNELS:
            raise ValueError(f"no built-in kernel {fn!r}: choose one of {', '.join(KERNELS)} "
                             "or pass a callable")
        spec = KERNELS[fn]
        name, ref = name or spec.name, ref or spec.reference
        inputs, bytes_moved, flops, fn = spec.inputs, spec.bytes_moved, spec.flops, spec.kernel
    for what, f in (("fn", fn), ("ref", ref)):
        if f is not None and not callable(f):
            raise ValueError(f"{what}={f!r} is not callable: pass a function such as "
                             "a wrapper that launches your @triton.jit kernel")
    name = name or getattr(fn, "__name__", "kernel")
    make = inputs or _default_inputs
    providers: list[tuple[str, Callable[..., torch.Tensor]]] = [("triton", fn)]
    if ref is not None:
        providers.append(("torch", ref))
    rank = int(os.environ.get("RANK", 0))
    out = []
    for n in sizes:
        expected: Any = None
        for provider, call in providers:
            row: dict[str, Any] = {"rank": rank, "device": _device_name(device), "kernel": name,
                                   "provider": provider, "size": n, "mode": mode,
                                   "dtype": str(dtype).removeprefix("torch."),
                                   "timer": _timer(provider, gpu), "error": None}
            try:
                args = make(rows, n, dtype, device)
                result = _run(call, args, mode)
                if provider == "torch":
                    expected = result
                row.update(_time(call, args, mode, gpu, reps))
                # without a formula: the inputs read and the output written
                moved = bytes_moved(args) if bytes_moved else _bytes(args) + _bytes(result[:1])
                factor = {"fwd": 1, "bwd": 2, "full": 3}[mode]  # rough: bwd re-reads & writes
                row["gbps"] = factor * moved / (row["median_ms"] * 1e-3) / 1e9
                if flops is not None and mode == "fwd":
                    row["tflops"] = flops(args) / (row["median_ms"] * 1e-3) / 1e12
                peak = peak_bandwidth(device)
                row["peak_pct"] = 100 * row["gbps"] * 1e9 / peak if peak else None
                row["_result"] = result
            except Exception as e:  # a compile error or a bad dtype: report, go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            out.append(row)
        _check(out[-len(providers):], expected, dtype)
    frame = pd.DataFrame(out).drop(columns=["_result"], errors="ignore")
    columns = ["rank", "device", "kernel", "provider", "size", "mode", "dtype", "timer",
               "median_ms", "p20_ms", "p80_ms", "gbps", "tflops", "peak_pct", "peak_mem_bytes",
               "max_error", "correct", "error"]
    return frame.reindex(columns=columns)


def _run(call: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], mode: str
         ) -> list[torch.Tensor]:
    """The output (and, unless fwd, the input gradients) for a correctness check."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.grad is not None:
            a.grad = None
    output = call(*args)
    if mode == "fwd":
        return [output.detach()]
    output.backward(torch.ones_like(output))
    grads = [a.grad.detach().clone() for a in args
             if isinstance(a, torch.Tensor) and a.grad is not None]
    return [output.detach(), *grads]


def _check(rows: list[dict[str, Any]], expected: Any, dtype: torch.dtype) -> None:
    """Compare each provider's result with the reference's, in place."""
    for row in rows:
        result = row.get("_result")
        if expected is None or result is None:
            continue
        error = max(((r.float() - e.float()).abs().max().item() for r, e in
                     zip(result, expected, strict=False)), default=0.0)
        row["max_error"] = error
        row["correct"] = len(result) == len(expected) and error <= TOLERANCE.get(dtype, 1e-3) \
            * max(1.0, max(e.float().abs().max().item() for e in expected))
        if not row["correct"] and row["error"] is None:
            row["error"] = f"wrong result: max error {error:.3g} vs torch"


def _time(call: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], mode: str,
          gpu: bool, reps: int | None) -> dict[str, Any]:
    if mode == "bwd":
        output = call(*args)
        grad = torch.ones_like(output)

        def timed() -> Any:
            return output.backward(grad, retain_graph=True)
    elif mode == "full":
        def timed() -> Any:
            return call(*args).sum().backward()
    else:
        def timed() -> Any:
            return call(*args)
    if gpu:
        import triton.testing

        torch.cuda.reset_peak_memory_stats()
        median, p20, p80 = triton.testing.do_bench(timed, quantiles=[0.5, 0.2, 0.8])
        return {"median_ms": median, "p20_ms": p20, "p80_ms": p80,
                "peak_mem_bytes": torch.cuda.max_memory_allocated()}
    # one warm-up call: the interpreter's first call also traces the kernel
    times = [s * 1e3 for s in step_times(timed, reps or 5, warmup=1)]
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return {"median_ms": statistics.median(times), "p20_ms": q[1], "p80_ms": q[7]}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={name!r} is not a torch dtype: use float32, float16 or bfloat16")
    return dtype


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _timer(provider: str, gpu: bool) -> str:
    if gpu:
        return "do_bench"
    interpreted = provider != "torch" and os.environ.get("TRITON_INTERPRET") == "1"
    return "interpreter" if interpreted else "cpu wall clock"


def peak_bandwidth(device: torch.device) -> float | None:
    """The device's HBM bandwidth in bytes/s, where PEAK_BANDWIDTH knows it."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)
