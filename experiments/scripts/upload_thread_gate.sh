#!/usr/bin/env bash
# One device call that decides what the rest of the session's device time measures:
#   DOS_GIT_SHA=<sha> BATCH=<batch prefix> bash experiments/scripts/upload_thread_gate.sh
# 1. experiments/scripts/upload_thread_check.sh (the race tests with the CPU lane's upload thread,
#    dos/uploads.py; its A/B; the copy call's cost), its files packed into
#    $OUT/upload-check.tar.gz (a call returns at most 8 files).
# 2. The gate: every test passed, and in the A/B the thread's median step is shorter than the
#    inline uploads' in both formats (fp32, bf16-split). Printed as PASS or MISS.
# 3. PASS: a daemon (h200_daemon.sh) starts issue 17 criterion 3's batches on this commit, 3B then
#    ~5B (state-dtype-speed.yaml, moments fp32 / bf16-split, the baselines). MISS: it starts issue
#    15's planner-wide-4b batch with DOS_UPLOAD_THREAD=0 (the inline uploads that the earlier
#    batches ran). Later calls: h200_daemon.sh wait.
# Ran 2026-12-07 (session 35, code ac9d371, where the thread was on by default on CUDA: an H100
# machine GPU-4fd25794 boot d44a4320): tests 50 passed, the thread no faster (fp32 0.2255 s against
# 0.2248, bf16-split 0.1680 against 0.1681): MISS, so planner-wide-4b ran (21 runs, complete) and
# the default went back to off (docs/DESIGN.md decision log 2026-12-07;
# experiments/results/gpu-tests/20261207-s35-NOTES.md).
set -u
: "${OUT:?set OUT}" "${DOS_GIT_SHA:?set DOS_GIT_SHA}" "${BATCH:?set BATCH (a UTC prefix)}"
mkdir -p /tmp/upcheck
OUT=/tmp/upcheck bash experiments/scripts/upload_thread_check.sh
(cd /tmp/upcheck && tar -czf $OUT/upload-check.tar.gz .)
verdict=$(python - <<'PY'
import csv, re, statistics, sys
log = open("/tmp/upcheck/pytest-uploads.log").read()
tail = log.strip().splitlines()[-1] if log.strip() else ""
tests_ok = bool(re.search(r"\d+ passed", tail)) and not re.search(r"failed|error", tail)
try:
    rows = list(csv.DictReader(open("/tmp/upcheck/upload-thread-ab.csv")))
except OSError:
    rows = []
med = {}
for sd in ("fp32", "bf16-split"):
    for t in ("1", "0"):
        v = [float(r["step_s_median"]) for r in rows if r["state_dtype"] == sd and r["upload_thread"] == t]
        med[(sd, t)] = statistics.median(v) if v else None
faster = all(med[(sd, "1")] is not None and med[(sd, "0")] is not None and med[(sd, "1")] < med[(sd, "0")]
             for sd in ("fp32", "bf16-split"))
for sd in ("fp32", "bf16-split"):
    print(f"{sd}: thread {med[(sd, '1')]} s, inline {med[(sd, '0')]} s", file=sys.stderr)
print(f"tests: {tail!r}", file=sys.stderr)
print("PASS" if tests_ok and faster else "MISS")
PY
)
echo "upload thread gate: $verdict (tests pass and the thread is faster in both formats)"
if [ "$verdict" = PASS ]; then
  bash experiments/scripts/h200_daemon.sh start 5 1150 "" "" \
    "experiments/sweeps/state-dtype-speed.yaml:model=3B&moments=[fp32,bf16-split,None]#+$BATCH-state-dtype-speed-3b" \
    "experiments/sweeps/state-dtype-speed.yaml:model=5B&moments=[fp32,bf16-split,None]#+$BATCH-state-dtype-speed-5b"
else
  DOS_UPLOAD_THREAD=0 bash experiments/scripts/h200_daemon.sh start 5 1150 "" "" \
    "experiments/sweeps/planner-wide-4b.yaml#+$BATCH-planner-wide-4b"
fi
