"""Is a step early in a run (where exploration measures its candidates, from step 2) as fast as the
run's steady state? Over every recorded fixed-plan run (placement cpu or an integer stride) of the
planner and stride sweeps with at least 8 warm-up steps: the ratio of each early step's iteration
(steps 2-7) to the median of the run's measured steps, and the measured steps' own spread.
Reads experiments/results/{planner,stride}-*/runs.csv and each row's steps file; prints a summary.
    python experiments/scripts/warmup_trend.py
"""
import csv
import statistics as st
from pathlib import Path

R = Path(__file__).resolve().parents[2] / "experiments" / "results"
ratios = {s: [] for s in range(1, 8)}
cv, runs = [], 0
for f in sorted(R.glob("planner-*/runs.csv")) + sorted(R.glob("stride-*/runs.csv")):
    for row in csv.DictReader(open(f)):
        if row["status"] != "ok" or row["stride"] == "auto" or not row.get("steps_file"):
            continue
        if int(row["warmup"] or 0) < 8:
            continue
        p = f.parent / row["steps_file"]
        if not p.exists():
            continue
        steps = list(csv.DictReader(open(p)))
        meas = [float(s["iter_s"]) for s in steps if s["measured"] == "True"]
        if len(meas) < 3:
            continue
        steady = st.median(meas)
        runs += 1
        cv.append(st.pstdev(meas) / st.mean(meas))
        for s in steps:
            k = int(s["step"])
            if k in ratios:
                ratios[k].append(float(s["iter_s"]) / steady)
print(f"{runs} fixed-plan runs with >= 8 warm-up steps")
for k, xs in ratios.items():
    if xs:
        q = st.quantiles(xs, n=10) if len(xs) >= 10 else [min(xs)] * 9
        print(f"step {k}: median {st.median(xs):.3f} of the steady iteration, 10-90% {q[0]:.3f}-{q[-1]:.3f} (n={len(xs)})")
if cv:
    print(f"measured steps' spread (stdev/mean) per run: median {100 * st.median(cv):.1f}%, max {100 * max(cv):.1f}%")
