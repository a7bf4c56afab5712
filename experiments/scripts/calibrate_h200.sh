#!/usr/bin/env bash
# Calibrate the update-phase model on this machine (H200 host: ~20-30 s, plus the one-time build of
# dos's C++ kernels when they are not cached yet). Writes under $OUT (default
# experiments/results/calibration): the profile (calibration.json), its table (calibration.txt)
# and what the model predicts with it for the two issue-4 settings (plans.txt); caches the profile
# under ~/.cache/dos/calibration/ for the planner.
#   OUT=/some/dir experiments/scripts/calibrate_h200.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-experiments/results/calibration}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1 || true
"$PYTHON" -m dos.calibrate --out "$OUT/calibration.json" 2>&1 | tee "$OUT/calibration.txt"
# Predicted update phase per stride (no resident share, 3 slots, all cores) and the model's own
# choice for an assumed free GPU memory (7B on a 40 GiB cap: ~8 GiB; 3B uncapped: ~80 GiB).
"$PYTHON" - "$OUT/calibration.json" <<'PY' 2>&1 | tee "$OUT/plans.txt"
import sys
from fractions import Fraction
from dos.lab.bench.models import preset
from dos.partition import choose_subgroup_numel
from dos.perfmodel import Calibration, build_plan, choose, predict
c = Calibration.from_json(open(sys.argv[1]).read())
if not c.has_gpu:
    sys.exit("no GPU rates in the profile: nothing to predict")
threads = c.host_cores or max(c.cpu_threads)
for name, free_gib in (("7B", 8), ("3B", 80)):
    n = preset(name).n_params()
    sg = choose_subgroup_numel(n)
    numels = (sg,) * (n // sg) + ((n % sg,) if n % sg else ())
    for k in (1, 2, 3, 4, 6, 8, 0):
        plan = build_plan(numels, resident=0, staged_share=Fraction(1, k) if k else Fraction(0),
                          cpu_threads=threads, staging_slots=3)
        p = predict(plan, c)
        print(f"{name} stride {k or 'all-CPU'}: {p.total_s:.3f} s, bound by {p.bottleneck}")
    plan, p = choose(numels, c, free_gpu_bytes=free_gib * 2**30, max_threads=threads)
    print(f"{name} auto, {free_gib} GiB free: {p.total_s:.3f} s {plan.to_record()}")
PY
