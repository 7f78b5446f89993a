"""Notebook side of ``%mesh calibrate``: run meshlab.calibrate on every rank, write the
hardware profile, and lay out what was measured as tables."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from meshlab.calibrate import Calibration, write_profile
from meshlab.notebook.cluster import Cluster
from meshlab.notebook.tables.table import Table, in_byte_unit, in_second_unit, sig
from meshlab.plan.gemm import shape_factor
from meshlab.plan.hardware import Hardware
from meshlab.rank.private_files import check_target


@dataclass(slots=True)
class CalibrationReport:
    """What ``calibrate_profile`` measured and wrote."""

    hardware: Hardware
    """The profile, as ``meshlab.plan.hardware.load(path)`` reads it back."""
    path: Path
    calibration: Calibration
    """Everything measured, raw points included (plain data from the ranks)."""
    collectives: pd.DataFrame
    """One row per (axis, collective): the alpha-beta fit in the profile's units."""
    matmul: pd.DataFrame
    """One row per (dtype, shape): achieved TFLOP/s on the slowest rank."""
    points: pd.DataFrame
    """One row per measured message: measured and fitted time, to plot one beside the other."""
    algorithms: pd.DataFrame = field(default_factory=pd.DataFrame)
    """One row per message size: each all-reduce algorithm's seconds on the world group, the
    backend's, and the fastest (empty: not timed)."""

    def describe(self) -> str:
        """One line: what the profile says."""
        hw = self.hardware
        flops = ", ".join(f"{d} {t:.3g}" for d, t in hw.tflops.items())
        return (f"{hw.name}: TFLOP/s {flops}; {hw.memory_gib:.1f} GiB/rank, copy "
                f"{hw.memory_bandwidth_gbs:.3g} GB/s; {hw.layer_overhead_us:.0f} us host time "
                f"per layer (+{hw.fsdp_overhead_us:.0f} FSDP, +{hw.tp_overhead_us:.0f} TP); "
                f"{hw.gpus_per_node} ranks/node; all_reduce "
                f"{hw.intra.latency_us:.1f} us + {hw.intra.bandwidth_gbs:.3g} GB/s bus"
                + "".join(f"; {a} all-reduce below {size / 2**10:,.0f} KiB"
                          for a, size in hw.allreduce_crossover_bytes.items())
                + "; attention " + (", ".join(
                    f"{k} {share * hw.tflops['bf16']:.3g} TFLOP/s"
                    + (" (SDPA's choice)" if k == hw.attention_default else "")
                    for k, share in hw.attention_efficiency.items()) or "as two GEMMs"))


def calibrate_profile(cluster: Cluster, path: str | Path = "calibrated.toml", *,
                      name: str | None = None, sizes: list[int] | None = None,
                      quick: bool = False, timeout: float = 600) -> CalibrationReport:
    """Measure the running cluster (every axis of its mesh, else the world group), write a
    hardware profile to ``path`` and return it with the tables."""
    path = Path(path)
    folder = Path(os.path.abspath(path)).parent
    if not folder.is_dir():
        raise ValueError(f"cannot write {path}: folder {path.parent} does not exist")
    check_target(Path(os.path.abspath(path)))  # before 24 s of measuring, not after
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {path}: folder {folder} is not writable by you; name "
                         "another with -o")
    # a mesh left from before a regroup to fewer ranks no longer matches: only a live one
    target = "mesh" if cluster.mesh_spec is not None else "None"
    code = ("from meshlab.calibrate import calibrate as _meshlab_calibrate\n"
            f"_meshlab_calibrate({target}, sizes={sizes!r}, quick={quick!r})")
    result = cluster.run(code, keep_values=True, timeout=timeout)
    calibration: Calibration = result.values[min(result.values)]  # the same on every rank
    try:
        hardware = write_profile(calibration, path, name)
    except OSError as e:  # what was measured is kept beside the notebook, and said where
        kept = Path.cwd() / f"calibrated-{time.strftime('%Y%m%d-%H%M%S')}.toml"
        write_profile(calibration, kept, name)
        raise ValueError(f"cannot write {path} ({e.strerror}); the measurements are kept in "
                         f"{kept}: plan with --hardware {kept}") from None
    return CalibrationReport(hardware=hardware, path=path.resolve(), calibration=calibration,
                             collectives=collectives_frame(calibration),
                             matmul=matmul_frame(calibration), points=points_frame(calibration),
                             algorithms=algorithms_frame(calibration))


PROFILE_FIELDS = ("used_in_profile: the profile fields a fit fills (intra: all_reduce within a "
                  "node; inter: all_reduce across nodes; collectives: the per-collective "
                  "table)")
LARGEST_SHAPE = ("used_in_profile: the largest shape per dtype gives the profile's TFLOP/s; "
                 "model_tflops: the profile's GEMM curve (tiles, waves, depth K/(K + k0), "
                 "k0 fitted to every shape) at that shape")


def collectives_frame(calibration: Calibration) -> pd.DataFrame:
    """Fits by axis and collective; ``used_in_profile`` names the profile fields they fill."""
    c = calibration
    rows = []
    for f in c.collectives:
        used = []
        if f.axis == c.intra_axis:
            used.append("intra" if f.collective == "all_reduce" else "collectives")
        if f.axis == (c.inter_axis or c.intra_axis) and f.collective == "all_reduce":
            used.append("inter")
        rows.append({"axis": f.axis, "ranks": f.ranks, "collective": f.collective,
                     "latency_us": f.latency_us, "bandwidth_gbs": f.bandwidth_gbs,
                     "fit_residual": f.residual, "used_in_profile": ", ".join(used),
                     "note": f.note})
    return pd.DataFrame(rows, columns=["axis", "ranks", "collective", "latency_us",
                                       "bandwidth_gbs", "fit_residual", "used_in_profile",
                                       "note"])


def matmul_frame(calibration: Calibration) -> pd.DataFrame:
    """Matmul points; ``used_in_profile`` marks the ones whose TFLOP/s the profile took."""
    largest = max((p.m * p.n * p.k, (p.m, p.n, p.k)) for p in calibration.matmul)[1]
    c = calibration
    keeps = shape_factor(*largest, sms=c.sms, tile=c.gemm_tile, k0=c.gemm_k0)
    rows = [{"dtype": p.dtype, "m": p.m, "n": p.n, "k": p.k, "median_ms": p.seconds * 1e3,
             "tflops": p.tflops, "model_tflops": c.tflops[p.dtype] / keeps * shape_factor(
                 p.m, p.n, p.k, sms=c.sms, tile=c.gemm_tile, k0=c.gemm_k0),
             "used_in_profile": (p.m, p.n, p.k) == largest}
            for p in c.matmul]
    return pd.DataFrame(rows, columns=["dtype", "m", "n", "k", "median_ms", "tflops",
                                       "model_tflops", "used_in_profile"])


def calibration_tables(report: CalibrationReport) -> tuple[Table, ...]:
    """What ``%mesh calibrate`` shows: which all-reduce algorithm wins at which size (when
    timed), matmul speeds and collective fits, rounded to the digits a timing supports (three
    significant), each with a caption and a note."""
    three = sig(3)
    matmul = Table(report.matmul, caption="matmul: achieved TFLOP/s on the slowest rank",
                   formats={"median_ms": three, "tflops": three, "model_tflops": three},
                   note=LARGEST_SHAPE)
    collectives = report.collectives
    if not collectives["note"].any():
        collectives = collectives.drop(columns="note")
    fits = Table(collectives, note=PROFILE_FIELDS,
                 caption="collectives: time = latency + bytes / bandwidth, fitted per axis",
                 formats={"latency_us": three, "bandwidth_gbs": three,
                          "fit_residual": "{:.1%}"})
    sweep = report.calibration.allreduce
    if sweep is None or report.algorithms.empty:
        return matmul, fits
    times = in_second_unit(report.algorithms, list(sweep.seconds))
    sized = in_byte_unit(times.frame, ["size"])
    algorithms = Table(sized.frame, formats={**times.formats, **sized.formats},
                       caption=f"all-reduce algorithms on the world group ({sweep.ranks} ranks, "
                               f"{len(set(sweep.hosts))} host(s)): median on the slowest rank",
                       note="; ".join(sweep.lines() + sweep.notes))
    return algorithms, matmul, fits


def algorithms_frame(calibration: Calibration) -> pd.DataFrame:
    """Per message size: each all-reduce algorithm's seconds, the backend's, the fastest."""
    sweep = calibration.allreduce
    if sweep is None:
        return pd.DataFrame()
    frame = pd.DataFrame({"size": sweep.nbytes, **sweep.seconds})
    frame["fastest"] = sweep.fastest()
    return frame


def points_frame(calibration: Calibration) -> pd.DataFrame:
    """Every timed message: bytes, measured and fitted microseconds."""
    rows = [{"axis": f.axis, "ranks": f.ranks, "collective": f.collective, "bytes": b,
             "measured_us": s * 1e6, "fitted_us": fit * 1e6}
            for f in calibration.collectives
            for b, s, fit in zip(f.nbytes, f.seconds, f.fitted(), strict=True)]
    return pd.DataFrame(rows, columns=["axis", "ranks", "collective", "bytes", "measured_us",
                                       "fitted_us"])
