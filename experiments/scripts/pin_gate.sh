#!/usr/bin/env bash
# One device call: measure the host arena's prefault ways (dos/pages.py), run the race tests with
# the default, then start a daemon batch (h200_daemon.sh) with the way that pinned fastest:
#   DOS_GIT_SHA=<sha> BUDGET=<s> bash experiments/scripts/pin_gate.sh SPEC [SPEC...]
# (SPEC as h200_call.sh's, e.g. "experiments/sweeps/planner-7b-40g.yaml#+<BATCH_ID>"). Later calls:
# `bash experiments/scripts/h200_daemon.sh wait 560`.
# 1. experiments/scripts/pin_cost.py: 16 GiB arenas, touch / madvise / none in turn, 3 rounds;
#    tests/test_pages.py and the race tests of a pinned arena (random delays on every stream; the
#    arena pinned and exact) with the default (touch), ~1 min. Packed into
#    $OUT/pin-check.tar.gz (a call returns at most 8 files).
# 2. The way: the fastest median pin_s among those that prefaulted (touch, madvise) if it beats
#    none's, else none; a failed test: none (the registration as before). Printed, and given to
#    the batch as DOS_PIN_PREFAULT (its rows record it: config.host_pin.prefault).
set -u
: "${OUT:?set OUT}" "${DOS_GIT_SHA:?set DOS_GIT_SHA}"
[ $# -ge 1 ] || { echo "usage: $0 SPEC [SPEC...]" >&2; exit 2; }
C=/tmp/pincheck; rm -rf $C; mkdir -p $C
{ nvidia-smi --query-gpu=name,uuid --format=csv,noheader; cat /proc/sys/kernel/random/boot_id; uname -r; echo "code $DOS_GIT_SHA"; } > $C/machine.txt
BATCH_ID=${PIN_BATCH:-$(date -u +%Y%m%dT%H%MZ)-pin-cost} timeout 120 python experiments/scripts/pin_cost.py $C/pin-cost.csv \
  > $C/pin-cost.log 2>&1; tail -9 $C/pin-cost.log
timeout 150 python -m pytest -q tests/test_pages.py tests/test_gpu_races.py -k "pages or pinned_and_exact or random_delays" \
  > $C/pytest.log 2>&1; tail -2 $C/pytest.log
(cd $C && tar -czf $OUT/pin-check.tar.gz .)
way=$(python - <<'PY'
import csv, re, statistics
log = open("/tmp/pincheck/pytest.log").read().strip().splitlines()
tail = log[-1] if log else ""
if not re.search(r"\d+ passed", tail) or re.search(r"failed|error", tail):
    print("none"); raise SystemExit
try:
    rows = list(csv.DictReader(open("/tmp/pincheck/pin-cost.csv")))
except OSError:
    rows = []
med = {}
for w in ("touch", "madvise", ""):
    v = [float(r["pin_s"]) for r in rows if r["prefault"] == w and (w == "" or r["prefaulted"] == "True")]
    if v:
        med[w or "none"] = statistics.median(v)
best = min(med, key=med.get) if med else "none"
print(best)
PY
)
echo "pin prefault for the batch: $way"
DOS_PIN_PREFAULT=$way bash experiments/scripts/h200_daemon.sh start 5 ${BUDGET:-1500} "" "" "$@"
