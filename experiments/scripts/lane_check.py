"""Per-lane check of the performance model against recorded dos runs (no GPU needed).

For each dos run of the given sweeps: the measured busy time of every lane (median over the
measured steps of its lanes.json) beside what `dos.perfmodel.predict` gives for the run's recorded
plan under a calibration; then, per sweep, two bounds on the update phase without resident state
against the best measured one:
- no contention: the best plan when the CPU runs at its alone rate and the copies at their duplex
  rates whatever overlaps (the calibrated rates cannot do better);
- host memory: the CPU lane and the copies share the host's DRAM. Each plan also moves at least
  its host-memory traffic (CPU AdamW 28 B per element: bf16 gradient in, fp32 master, exp_avg and
  exp_avg_sq read and written, bf16 weight out; 12 B per staged element each way; 2 B per
  CPU-updated element uploaded) at the highest combined rate the calibration measured (CPU AdamW
  bytes + H2D + D2H while both run, or either alone). The bound is the best plan under both limits.
  The calibration's peak is a measured operating point, not a proven maximum: the run's own
  traffic rate is printed beside it (above the peak, the peak was not the maximum).

    python experiments/scripts/lane_check.py SWEEP=CALIBRATION [SWEEP=CALIBRATION ...]

CALIBRATION: a calibration json, or the table `python -m dos calibrate` prints (a device call's
calibration.txt). Example (the 2026-12-01 H200 records):
    python experiments/scripts/lane_check.py \\
      stride-3b=experiments/results/calibration/NVIDIA-H200-20261201-074856.json \\
      stride-7b-40g=experiments/results/gpu-tests/20261201-call3-calibration.txt
"""
import dataclasses
import json
import re
import sys
from pathlib import Path

import pandas as pd

from dos import perfmodel as pm
from dos.lab import results as R
from dos.lab.bench import records
from dos.trace import lane_totals

RESULTS = Path(__file__).resolve().parents[1] / "results"


def load_calibration(path: str) -> pm.Calibration:
    text = Path(path).read_text()
    if path.endswith(".json"):
        return pm.Calibration.from_json(text)
    rows = [ln.split() for ln in text.splitlines() if ln.split() and ln.split()[0].isdigit()]
    g = lambda pat: [float(x) * 1e9 for x in re.search(pat, text).groups()]  # noqa: E731
    (gpu,), (h2d, h2d_dx), (d2h, d2h_dx) = (g(r"GPU AdamW\s+([\d.]+)"),
                                           g(r"pinned H2D\s+([\d.]+) GB/s alone\s+([\d.]+)"),
                                           g(r"pinned D2H\s+([\d.]+) GB/s alone\s+([\d.]+)"))
    col = lambda i: tuple(float(r[i]) * 1e9 for r in rows)  # noqa: E731
    return pm.Calibration(cpu_threads=tuple(int(r[0]) for r in rows), cpu_rate=col(1), cpu_rate_dma=col(2),
                          h2d_bw_cpu=col(3), d2h_bw_cpu=col(4), gpu_rate=gpu, h2d_bw=h2d, d2h_bw=d2h,
                          h2d_duplex_bw=h2d_dx, d2h_duplex_bw=d2h_dx)


def measured(lanes_json) -> pd.Series:
    """Median over the measured steps of each lane's busy seconds and the update phase's span."""
    return pd.DataFrame([lane_totals([e for e in step["events"] if e["lane"] != "grad_d2h"])  # backward's
                         for step in lanes_json]).median()


CPU_BYTES = 28  # host-memory traffic of the CPU AdamW kernel per element (see the docstring)


def host_peak(calib: pm.Calibration) -> float:
    """The highest combined host-memory traffic (bytes/s) the calibration measured."""
    both = [CPU_BYTES * c + h + d for c, h, d in zip(calib.cpu_rate_dma, calib.h2d_bw_cpu, calib.d2h_bw_cpu)]
    alone = [CPU_BYTES * c for c in calib.cpu_rate] + [calib.h2d_duplex_bw + calib.d2h_duplex_bw]
    return max(both + alone)


def host_bytes(plan: pm.Plan, param_bytes: int = 2) -> float:
    n_cpu, staged = plan.numel(pm.CPU), plan.numel(pm.STAGED)
    return CPU_BYTES * n_cpu + 2 * pm.STATE_BYTES * staged + param_bytes * n_cpu


def host_memory_bound(numels, calib: pm.Calibration, flat: pm.Calibration):
    """min over plans (no resident state, every staged share and thread count the model searches)
    of max(no-contention prediction, host-memory traffic / host_peak)."""
    peak, best = host_peak(calib), (float("inf"), None)
    for share in pm.shares():
        for t in calib.cpu_threads:
            plan = pm.build_plan(numels, resident=0, staged_share=share, cpu_threads=t, staging_slots=3)
            s = max(pm.predict(plan, flat).total_s, host_bytes(plan) / peak)
            best = min(best, (s, plan), key=lambda x: x[0])
    return best


def check(sweep: str, calib: pm.Calibration):
    runs = R.rows(RESULTS / sweep)
    runs = runs[(runs.system == "dos") & (runs.placement != "gpu")]
    out, plans = [], []
    for r in runs.itertuples():
        lanes_json = json.loads(records.read_text(R.run_file(r._asdict(), "lanes_file")))
        plan, m = R.plan_of(r._asdict()), measured(lanes_json)
        p = pm.predict(plan, calib)
        plans.append(plan)
        out.append({"sweep": sweep, "run": r.run_id, "system": r.key, "stride": r.stride,
                    "threads": plan.cpu_threads, "step_s": r.step_s, "predicted": p.total_s,
                    "bottleneck": p.bottleneck, **{f"{k}_meas": m.get(k) for k in ("cpu", "h2d", "d2h", "upload", "span")},
                    "cpu_pred": p.cpu_s, "h2d_pred": p.h2d_s, "d2h_pred": p.d2h_s, "upload_pred": p.upload_s})
    flat = dataclasses.replace(calib, cpu_rate_dma=calib.cpu_rate,
                               h2d_bw_cpu=(calib.h2d_duplex_bw,) * len(calib.cpu_threads),
                               d2h_bw_cpu=(calib.d2h_duplex_bw,) * len(calib.cpu_threads))
    bound_plan, bound = pm.choose(plans[0].numels, flat, free_gpu_bytes=float("inf"), max_threads=16, resident=0)
    no_resident = runs[runs.gpu_fraction.eq(0)]  # as the bound
    host_s, host_plan = host_memory_bound(plans[0].numels, calib, flat)
    best_run = no_resident.loc[no_resident.step_s.idxmin()] if len(no_resident) else None
    best = best_run.step_s if best_run is not None else float("nan")
    run_rate = host_bytes(R.plan_of(best_run.to_dict())) / best if best_run is not None else float("nan")
    summary = {"sweep": sweep, "best_measured_s": best, "bound_s": bound.total_s, "bound_stride": bound_plan.stride,
               "bound_over_measured": bound.total_s / best, "host_bound_s": host_s,
               "host_bound_stride": host_plan.stride, "host_bound_over_measured": host_s / best,
               "host_peak_gbs": host_peak(calib) / 1e9, "best_run_host_gbs": run_rate / 1e9,
               "bound_over_host_bound": bound.total_s / host_s}
    return pd.DataFrame(out), summary


def main(argv) -> int:
    pd.set_option("display.width", 250)
    tables, summaries = [], []
    for arg in argv:
        sweep, path = arg.split("=", 1)
        t, s = check(sweep, load_calibration(path))
        tables.append(t)
        summaries.append(s)
    print(pd.concat(tables).round(3).to_string(index=False))
    print()
    print(pd.DataFrame(summaries).round(3).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
