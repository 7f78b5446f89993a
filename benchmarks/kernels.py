"""meshlab's Triton kernels beside torch eager and torch.compile, per kernel and size.

For each kernel in meshlab.kernels.KERNELS (rmsnorm, softmax, swiglu, cross_entropy) and each
row length (the vocabulary for cross_entropy), the providers run the same problem in one
process: meshlab's kernel, its plain-torch reference (eager), ``torch.compile`` of that
reference (compiled once per shape, dynamic=False) and, where the liger-kernel package is
installed beside meshlab (a peer in the benchmark's environment, never a meshlab dependency),
Liger-Kernel's kernel for the same function (its functional API; its cross_entropy computes
the gradient in the forward, in place of the logits, so its forward does more work).
Timing, GB/s and the correctness check against eager come from meshlab.kernels.bench.bench.
Printed per kernel and size: the median ms of each, GB/s of each (the forward's bytes_moved;
x3 in full mode, rough), eager/meshlab, compiled/meshlab and liger/meshlab (above 1: meshlab
is faster) and, on a GPU with a known peak, meshlab's
% of HBM peak (goal: >= 85% on H100, all four kernels being memory-bound). A failing provider
(e.g. torch.compile) prints its reason under its row; a wrong result prints a warning.
``--json PATH`` also writes every row (and each provider's error) as JSON.

On a CPU meshlab's kernels run in Triton's interpreter (about a millisecond per program):
those figures are interpreter times, NOT kernel speed; run on a GPU for real numbers.

$ python benchmarks/kernels.py                  # GPU: 4096 rows, bf16; CPU: 4 rows, fp32
$ python benchmarks/kernels.py --mode full      # forward + backward
$ python benchmarks/kernels.py --kernels rmsnorm,softmax --sizes 4096,8192 --rows 8192
$ python benchmarks/kernels.py --no-liger --json kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

import torch

# Before anything imports triton (torch._dynamo does): meshlab.kernels sets TRITON_INTERPRET on
# a CPU, which only takes if triton is not imported yet. torch._dynamo is reached lazily below.
from meshlab import runtime
from meshlab.kernels import KERNELS
from meshlab.kernels.bench import bench, peak_bandwidth

GPU_SIZES, GPU_VOCAB = [1024, 2048, 4096, 8192, 16384], [32768, 65536, 131072]
CPU_SIZES, CPU_VOCAB = [256, 1024, 4096], [4096, 32768, 131072]
PEAK_GOAL = 85.0


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def _value(row: dict[str, Any] | None, key: str) -> float | None:
    value = None if row is None else row.get(key)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def liger_providers() -> tuple[dict[str, Callable[..., torch.Tensor]], str | None]:
    """Liger-Kernel's version of each kernel it has, with meshlab's signatures; or ({}, why)
    when liger-kernel is not installed or does not import here."""
    try:
        from liger_kernel.transformers.functional import (
            liger_cross_entropy,
            liger_rms_norm,
            liger_softmax,
            liger_swiglu,
        )
    except Exception as e:  # not installed, or built for another triton: no Liger column
        return {}, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"

    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        # casting_mode "llama": 1/rms in fp32, x * rstd cast back, then the weight, as ours
        return liger_rms_norm(x, weight, eps, casting_mode="llama", in_place=False)

    def cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                      ignore_index: int = -100) -> torch.Tensor:
        return liger_cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                   ignore_index=ignore_index)

    return {"rmsnorm": rmsnorm, "softmax": liger_softmax, "swiglu": liger_swiglu,
            "cross_entropy": cross_entropy}, None


def _compare(name: str, sizes: list[int], args: argparse.Namespace, device: torch.device,
             liger: Callable[..., torch.Tensor] | None = None) -> list[dict[str, Any]]:
    """One dict per size: the meshlab, eager, compiled (and liger) rows of bench's frames."""
    spec = KERNELS[name]
    common: dict[str, Any] = {"sizes": sizes, "dtype": args.dtype, "mode": args.mode,
                              "rows": args.rows, "reps": args.reps, "device": device}
    # meshlab's kernel ("triton") beside eager ("torch"), checked against eager
    ours = bench(name, **common).to_dict("records")
    # torch.compile'd reference ("triton" here) beside eager again, as its correctness check
    torch._dynamo.reset()
    compiled = torch.compile(spec.reference, dynamic=False)
    theirs = bench(compiled, spec.reference, inputs=spec.inputs, name=f"{name} (compiled)",
                   **common).to_dict("records")
    # Liger-Kernel's kernel beside eager, checked against it like ours
    peer = [] if liger is None else bench(liger, spec.reference, inputs=spec.inputs,
                                          name=f"{name} (liger)", **common).to_dict("records")
    out = []
    for n in sizes:
        def find(rows: list[dict[Any, Any]], provider: str, n: int = n) -> dict[Any, Any] | None:
            return next((r for r in rows if r["size"] == n and r["provider"] == provider), None)
        meshlab, eager, comp = find(ours, "triton"), find(ours, "torch"), find(theirs, "triton")
        lig = find(peer, "triton")
        for other in (comp, lig):
            if other is not None:
                # bench knows spec.bytes_moved only by name: same bytes as eager, so scale
                gbps, ms = _value(eager, "gbps"), _value(eager, "median_ms")
                other_ms = _value(other, "median_ms")
                other["gbps"] = gbps * ms / other_ms if gbps and ms and other_ms else None
        out.append({"size": n, "meshlab": meshlab, "eager": eager, "compiled": comp,
                    "liger": lig})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"comma list of {', '.join(KERNELS)}")
    parser.add_argument("--sizes", type=_ints, default=None,
                        help="row lengths for rmsnorm, softmax and swiglu "
                             f"(default {GPU_SIZES} on GPU, {CPU_SIZES} on CPU)")
    parser.add_argument("--vocab", type=_ints, default=None,
                        help="vocabulary sizes for cross_entropy "
                             f"(default {GPU_VOCAB} on GPU, {CPU_VOCAB} on CPU)")
    parser.add_argument("--rows", type=int, default=None, help="default 4096 on GPU, 4 on CPU")
    parser.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--mode", choices=["fwd", "full"], default="fwd",
                        help="fwd: forward only; full: forward + backward")
    parser.add_argument("--reps", type=int, default=20,
                        help="timed calls per provider on CPU (a GPU uses do_bench's own)")
    parser.add_argument("--no-liger", dest="liger", action="store_false",
                        help="leave Liger-Kernel out even where it is installed")
    parser.add_argument("--json", metavar="PATH", help="also write every row to PATH as JSON")
    args = parser.parse_args()
    device = runtime.device()
    gpu = device.type == "cuda"
    args.rows = args.rows or (4096 if gpu else 4)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    names = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        parser.error(f"unknown kernel(s) {', '.join(unknown)}: choose from {', '.join(KERNELS)}")
    sizes = args.sizes or (GPU_SIZES if gpu else CPU_SIZES)
    vocab = args.vocab or (GPU_VOCAB if gpu else CPU_VOCAB)
    # one compile per size and mode; don't let dynamo fall back to eager on many sizes
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, len(sizes), len(vocab)) + 2

    liger, why = liger_providers() if args.liger else ({}, "--no-liger")
    peak = peak_bandwidth(device)
    what = {"fwd": "forward", "full": "forward + backward"}[args.mode]
    if gpu:
        bw = f"HBM peak {peak / 1e12:.2f} TB/s" if peak else "peak bandwidth unknown: no peak %"
        print(f"{torch.cuda.get_device_name(device)} ({bw}), {args.rows} rows, {args.dtype}, "
              f"{what}; triton.testing.do_bench medians")
    else:
        print(f"CPU, {args.rows} rows, {args.dtype}, {what}; median of {args.reps} calls")
        print("NOTE: meshlab's kernels run in Triton's INTERPRETER here: their times are "
              "interpreter times,\n      NOT kernel speed (eager and compiled are real CPU "
              "times). Run on a GPU for real figures.")
    print("ratio = other ms / meshlab ms: above 1 means meshlab is faster"
          + (f"; goal >= {PEAK_GOAL:.0f}% of HBM peak on H100" if gpu else ""))
    print("liger: " + ("Liger-Kernel's functional API, "
                       f"liger-kernel {_version('liger_kernel')}" if liger else
                       f"not run ({why})"))
    header = (f"{'kernel':<14} {'size':>7} {'meshlab ms':>11} {'eager ms':>9} "
              f"{'compiled ms':>11} {'meshlab GB/s':>12} {'eager GB/s':>10} "
              f"{'comp. GB/s':>10} {'eager/ml':>8} {'comp./ml':>8}")
    if liger:
        header += f" {'liger ms':>9} {'liger GB/s':>10} {'liger/ml':>8}"
    if peak:
        header += f" {'% peak':>6}"
    print()
    print(header)
    warnings, below, records = [], False, []
    for name in names:
        for row in _compare(name, vocab if name == "cross_entropy" else sizes, args, device,
                            liger.get(name)):
            ml, eager, comp, lig = row["meshlab"], row["eager"], row["compiled"], row["liger"]
            ms = [_value(r, "median_ms") for r in (ml, eager, comp, lig)]
            gbps = [_value(r, "gbps") for r in (ml, eager, comp, lig)]
            line = (f"{name:<14} {row['size']:>7} {_cell(ms[0], 11, 3)} {_cell(ms[1], 9, 3)} "
                    f"{_cell(ms[2], 11, 3)} {_cell(gbps[0], 12, 1)} {_cell(gbps[1], 10, 1)} "
                    f"{_cell(gbps[2], 10, 1)} {_cell(_ratio(ms[1], ms[0]), 8, 2)} "
                    f"{_cell(_ratio(ms[2], ms[0]), 8, 2)}")
            if liger:
                line += (f" {_cell(ms[3], 9, 3)} {_cell(gbps[3], 10, 1)} "
                         f"{_cell(_ratio(ms[3], ms[0]), 8, 2)}")
            records.append({
                "kernel": name, "size": row["size"], "rows": args.rows, "dtype": args.dtype,
                "mode": args.mode, "meshlab_ms": ms[0], "eager_ms": ms[1], "compiled_ms": ms[2],
                "liger_ms": ms[3], "meshlab_gbps": gbps[0], "eager_gbps": gbps[1],
                "compiled_gbps": gbps[2], "liger_gbps": gbps[3],
                "meshlab_peak_pct": _value(ml, "peak_pct"),
                "liger_over_meshlab": _ratio(ms[3], ms[0]),
                "errors": {p: r.get("error") for p, r in (("meshlab", ml), ("eager", eager),
                                                          ("compiled", comp), ("liger", lig))
                           if r is not None and r.get("error")}})
            if peak:
                pct = _value(ml, "peak_pct")
                line += f" {_cell(pct, 6, 1)}"
                if pct is not None and pct < PEAK_GOAL:
                    line, below = line + " <", True
            print(line)
            for provider, r in (("meshlab", ml), ("eager", eager), ("compiled", comp),
                                ("liger", lig)):
                if r is None:
                    continue
                if r.get("error") and _value(r, "median_ms") is None:
                    print(f"{'':<14} {provider} failed: {r['error']}")
                elif _value(r, "correct") is not None and not _value(r, "correct"):
                    warnings.append(f"{name} size {row['size']} {provider}: {r['error']}")
    if below:
        print(f"\n< : meshlab below the {PEAK_GOAL:.0f}% goal")
    for warning in warnings:
        print(f"WARNING: wrong result, {warning}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if gpu else "cpu",
                       "peak_bandwidth": peak, "liger": _version("liger_kernel") if liger
                       else why, "rows": records}, f, indent=1)


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module.replace("_", "-"))
    except Exception:  # not installed as a distribution
        return "?"


if __name__ == "__main__":
    main()
