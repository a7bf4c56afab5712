#!/usr/bin/env bash
# A/B of the optimizer core, one batch: the same sweep alternately run by two trees that share the
# lab (dos/lab) and differ in the core (dos/*.py, csrc/).
#   bash experiments/scripts/ab_core.sh OLD_SHA NEW_SHA SWEEP.yaml OUTDIR BATCH_ID REPEAT...
# Repetition r runs in .ab/old (OLD_SHA's core + this tree's lab) when odd, in this tree when even;
# DOS_GIT_SHA records which core ran. `make_ab_old` below builds .ab/old from git.
set -eu
old=$1; new=$2; sweep=$3; out=$4; batch=$5; shift 5
here=$PWD
for r in "$@"; do
  if [ $((r % 2)) -eq 1 ]; then tree=$here/.ab/old; sha="$old-core"; else tree=$here; sha=$new; fi
  (cd "$tree" && DOS_GIT_SHA=$sha python3 -m dos sweep "$here/$sweep" --where repeat=$r --out "$here/$out" \
     --batch-id "$batch" --no-progress) || echo "repeat $r rc=$?"
done
