#!/usr/bin/env bash
# A/B of the optimizer core, one batch: the same sweep alternately run by two trees that share the
# lab (dos/lab) and differ in the core (dos/*.py, csrc/).
#   [DEADLINE=<epoch s>] bash experiments/scripts/ab_core.sh OLD_SHA NEW_SHA SWEEP.yaml OUTDIR BATCH_ID REPEAT...
# Repetition r runs in .ab/old (OLD_SHA's core + this tree's lab) when odd, in this tree when even;
# DOS_GIT_SHA records which core ran; experiments/scripts/make_ab_old.sh builds .ab/old from git.
# DEADLINE: no repetition starts with less than 150 s left, and each is killed at the deadline
# (the sweep kills its run in flight; the repetition resumes when called again).
set -eu
old=$1; new=$2; sweep=$3; out=$4; batch=$5; shift 5
here=$PWD
for r in "$@"; do
  left=$(( ${DEADLINE:-$(( $(date +%s) + 86400 ))} - $(date +%s) ))
  [ $left -lt 150 ] && { echo "repeat $r: ${left}s left, not started"; continue; }
  if [ $((r % 2)) -eq 1 ]; then tree=$here/.ab/old; sha="$old-core"; else tree=$here; sha=$new; fi
  (cd "$tree" && DOS_GIT_SHA=$sha timeout -k 10 $left python3 -m dos sweep "$here/$sweep" --where repeat=$r --out "$here/$out" \
     --batch-id "$batch" --no-progress) || echo "repeat $r rc=$?"
done
