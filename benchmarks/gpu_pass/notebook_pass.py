"""A notebook end to end in a real kernel (nbclient), as a user runs meshlab on a GPU node.

%load_ext meshlab; %mesh start (one rank per visible GPU unless --ranks; --backend nccl);
%mesh init dp=N; a %%mesh cell that all-reduces on the rank's device and reports device and
backend; a %%mesh cell that trains a small meshlab Transformer a few steps through
parallelize (selective activation checkpointing, bf16 autocast); %%mesh --comms; %mesh
status; %mesh memory; %mesh stop. Checks: every rank's device is cuda (cpu with --backend
gloo on a machine without one), the backend is the one asked for, the all_reduce sum is
right, the loss falls, and no cell raised. Exit 1 on a failed check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

TRAIN = """%%mesh -o trained
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, parallelize, build_optimizer
from meshlab.verify.compare import train
torch.manual_seed(0)
cfg = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768,
                  vocab_size=1024, max_seq_len=128)
plan = ParallelPlan(data_parallel="ddp", activation_checkpoint="selective",
                    mixed_precision=True, seq_len=128)
model = parallelize(Transformer(cfg).to(device), mesh, plan)
opt = build_optimizer(model, mesh, plan)
batches = [tuple(t.to(device) for t in local_batch(step=s, batch=8, seq=128,
           vocab=cfg.vocab_size, rank=rank, ranks=world_size)) for s in range(8)]
losses = train(model, opt, batches, average_over=mesh["dp"].get_group())
print(f"losses {losses[0]:.3f} -> {losses[-1]:.3f} on {next(model.parameters()).device}")
{"losses": losses, "param_device": str(next(model.parameters()).device),
 "max_memory_mib": torch.cuda.max_memory_allocated(device) / 2**20
 if device.type == "cuda" else None}"""

FACTS = """%%mesh -o facts
x = torch.full((1 << 20,), float(rank + 1), device=device)
dist.all_reduce(x)
{"device": str(device), "backend": str(dist.get_backend()), "torch": torch.__version__,
 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
 "sum_ok": bool((x == world_size * (world_size + 1) / 2).all().item()),
 "tensor_device": str(x.device)}"""

COMMS = """%%mesh --comms
y = torch.ones(4 << 20, device=device)
dist.all_reduce(y)
gathered = torch.empty(world_size * 1024, device=device)
dist.all_gather_into_tensor(gathered, torch.ones(1024, device=device))
dist.broadcast(y, 0)
torch.cuda.synchronize() if device.type == "cuda" else None
print("comms done")"""

PROFILE = """%%mesh --profile --profile-dir /tmp/gpu_pass_results
losses += train(model, opt, batches[:2], average_over=mesh["dp"].get_group())"""

REPORT = """import json
print("NB_RESULT " + json.dumps({"facts": facts, "trained": trained}, default=str))"""


def cells(backend: str, ranks: int | None, dp: int) -> list[str]:
    start = "%mesh start" + (f" {ranks}" if ranks else "") + f" --backend {backend}"
    return ["%load_ext meshlab", start, "%mesh status", f"%mesh init dp={dp}", FACTS, TRAIN,
            COMMS, PROFILE, "%mesh status", "%mesh memory model opt --inputs batches[0][0]", REPORT,
            "%mesh stop"]


def texts(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
        else:
            parts.append(out.get("data", {}).get("text/plain", ""))
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo", "auto"])
    parser.add_argument("--ranks", type=int, default=None, help="default: one per GPU")
    parser.add_argument("--executed", default="gpu_pass_executed.ipynb")
    parser.add_argument("--timeout", type=int, default=240, help="per cell, seconds")
    args = parser.parse_args()
    try:
        import torch
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    world = args.ranks or gpus or 4
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells(args.backend, args.ranks, world)]
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                            resources={"metadata": {"path": os.getcwd()}})
    started, error = time.perf_counter(), None
    try:
        client.execute()
    except CellExecutionError as e:
        error = str(e).splitlines()[-1][:300] if str(e) else type(e).__name__
    except Exception as e:
        error = f"{type(e).__name__}: {str(e)[:300]}"
    seconds = time.perf_counter() - started
    Path(args.executed).parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, args.executed)
    for i, cell in enumerate(nb.cells):
        shown = texts(cell)
        meta = cell.metadata.get("execution", {})
        took = ""
        if "iopub.execute_input" in meta and "shell.execute_reply" in meta:
            from datetime import datetime
            t0 = datetime.fromisoformat(meta["iopub.execute_input"].replace("Z", "+00:00"))
            t1 = datetime.fromisoformat(meta["shell.execute_reply"].replace("Z", "+00:00"))
            took = f" ({(t1 - t0).total_seconds():.1f} s)"
        print(f"--- In [{i}]{took}: {cell.source.splitlines()[0]}")
        print(shown[-3000:])
    found = next((m for c in nb.cells for m in re.findall(r"^NB_RESULT (.*)$", texts(c), re.M)),
                 None)
    result = json.loads(found) if found else {}
    facts = {int(k): v for k, v in (result.get("facts") or {}).items()}
    trained = {int(k): v for k, v in (result.get("trained") or {}).items()}
    want_device = "cuda" if args.backend == "nccl" or (args.backend == "auto" and gpus) else None
    checks = {
        "no cell raised": error is None,
        f"{world} ranks answered": len(facts) == world,
        "all_reduce sum right": bool(facts) and all(f["sum_ok"] for f in facts.values()),
        "loss falls": bool(trained) and all(t["losses"][-1] < t["losses"][0]
                                            for t in trained.values()),
    }
    if args.backend != "auto":
        checks[f"backend {args.backend}"] = bool(facts) and all(
            f["backend"] == args.backend for f in facts.values())
    if want_device:
        checks[f"device {want_device}"] = bool(facts) and all(
            f["device"].startswith(want_device) and f["tensor_device"].startswith(want_device)
            and t["param_device"].startswith(want_device)
            for f, t in zip(facts.values(), trained.values(), strict=False))
    comms = next((texts(c) for c in nb.cells if c.source.startswith("%%mesh --comms")), "")
    checks["--comms table shown"] = "all_reduce" in comms
    profiled = next((texts(c) for c in nb.cells if c.source.startswith("%%mesh --profile")), "")
    print("PROFILED CELL:\n" + profiled[:3000])
    checks["--profile timeline shown"] = "time per rank (ms)" in profiled
    summary = {"seconds": seconds, "error": error, "checks": checks, "facts": facts,
               "losses": {r: t["losses"] for r, t in trained.items()},
               "max_memory_mib": {r: t["max_memory_mib"] for r, t in trained.items()}}
    print("\nchecks:")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print(f"notebook: {seconds:.1f} s" + (f"; error: {error}" if error else ""))
    folder = Path(os.environ.get("GPU_PASS_RESULTS", "."))
    (folder / "notebook.json").write_text(json.dumps(summary, indent=1, default=str))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
