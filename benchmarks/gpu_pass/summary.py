"""The pass's closing table: one line per part, then its key figures (read from the JSON
each part wrote and the pytest logs). Usage: summary.py RESULTS_DIR LOG_DIR"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def load(folder: Path, name: str) -> dict:
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return {}


def pytest_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    found = [ln.strip("= ") for ln in lines if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    return found[-1][:110] if found else (lines[-1][:110] if lines else "empty log")


def main() -> None:
    results, logs = Path(sys.argv[1]), Path(sys.argv[2])
    status = [ln.split("|") for ln in (results / "status.txt").read_text().splitlines()]
    dev, nb = load(results, "device.json"), load(results, "notebook.json")
    cal, ker = load(results, "calibrate.json"), load(results, "kernels.json")
    fp8 = load(results, "fp8.json")
    figures: dict[str, str] = {}
    if dev:
        line = f"{dev.get('gpu', 'cpu')} torch {dev.get('torch')} triton {dev.get('triton')}"
        if "copy_gbs" in dev:
            line += (f"; copy {dev['copy_gbs']:.0f} GB/s, bf16 {dev['bf16_tflops']:.0f} TFLOP/s"
                     + (f", fp8 {dev['fp8_tflops']:.0f}" if "fp8_tflops" in dev else ""))
        if "copy_pct_datasheet" in dev:
            line += (f" ({dev['copy_pct_datasheet']:.0f}% / {dev['bf16_pct_datasheet']:.0f}% of "
                     "datasheet)")
        figures["device"] = line
    if nb:
        facts = nb.get("facts", {})
        first = next(iter(facts.values()), {})
        failed = [k for k, v in nb.get("checks", {}).items() if not v]
        losses = next(iter(nb.get("losses", {}).values()), [])
        figures["notebook"] = (f"{len(facts)} rank(s) {first.get('device', '?')} "
                               f"{first.get('backend', '?')}; all_reduce "
                               f"{'ok' if first.get('sum_ok') else 'WRONG'}; loss "
                               + (f"{losses[0]:.2f}->{losses[-1]:.2f}" if losses else "-")
                               + f"; {nb.get('seconds', 0):.0f}s"
                               + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if cal:
        parts = [f"{c['name']} pred {c['predicted_s'] * 1e3:.1f} / meas "
                 f"{c['measured_s'] * 1e3:.1f} ms = {c['ratio']:.2f}" if "ratio" in c
                 else f"{c['name']} error" for c in cal.get("cases", [])]
        tf = cal.get("profile", {}).get("tflops", {})
        figures["calibrate"] = ("TFLOP/s " + ", ".join(f"{k} {v:.3g}" for k, v in tf.items())
                                + "; " + "; ".join(parts))
    for name in ("tests_gpu", "tests_rank"):
        figures[name] = pytest_line(logs / f"{name}.log")
    if fp8:
        figures["tests_gpu"] += (f"; fp8/bf16 speed {fp8.get('speedup', float('nan')):.2f}x, "
                                 f"loss diff {fp8.get('max_loss_diff', float('nan')):.3g}")
    if ker:
        copy = dev.get("copy_gbs")
        rows = []
        for r in ker.get("rows", []):
            pct = r.get("meshlab_peak_pct")
            rel = 100 * r["meshlab_gbps"] / copy if copy and r.get("meshlab_gbps") else None
            liger = r.get("liger_over_meshlab")
            rows.append(f"{r['kernel']}/{r['size']}: "
                        + (f"{pct:.0f}%pk" if pct is not None else "-")
                        + (f" {rel:.0f}%cp" if rel is not None else "")
                        + (f" L{liger:.2f}" if liger is not None else ""))
        figures["kernels"] = " ".join(rows)
    print("\n" + "=" * 100)
    print(f"{'part':<11} {'status':<28} {'s':>4}  key figures")
    for name, state, secs in status:
        print(f"{name:<11} {state:<28} {secs:>4}  {figures.get(name, '')}")
    print("kernels: %pk = meshlab GB/s over datasheet HBM peak, %cp = over the measured copy; "
          "L = liger ms / meshlab ms (>1: meshlab faster)")
    print("=" * 100)


if __name__ == "__main__":
    main()
