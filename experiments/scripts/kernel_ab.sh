#!/usr/bin/env bash
# The CPU kernel A/B in situ, one batch: dos.lab.bench.kernel's named implementations run by two
# trees that share the lab and differ in the optimizer core (.ab/old: make_ab_old.sh OLD_SHA; and
# this tree), in alternate processes, ROUNDS rounds (old, new, old, new, ...). Rows go to
# $OUT/<SWEEP>/runs.csv (else experiments/results/<SWEEP>), git_sha "<OLD_SHA>-core" or NEW_SHA,
# and each process logs which dos it imported. Each tree builds its own extension once (~20 s).
# BATCH_ID (default: <UTC time>-kernel-ab) goes into every row, with the GPU's UUID and the boot id.
# PACK=<file.tar.gz>: after each process, the sweep's results dir packed into that one file (a
# device call returns only a handful of files from $OUT: session 33 lost a call's rows to that).
#   [PARAMS=400000000] [REPS=5] [BATCH_ID=...] bash experiments/scripts/kernel_ab.sh OLD_SHA NEW_SHA SWEEP ROUNDS "IMPLS" THREADS...
set -eu
old=$1; new=$2; sweep=$3; rounds=$4; impls=$5; shift 5
here=$PWD; out=${OUT:-$here/experiments/results}
batch=${BATCH_ID:-$(date -u +%Y%m%dT%H%MZ)-kernel-ab}
[ -d .ab/old/dos ] || { echo "no .ab/old: run experiments/scripts/make_ab_old.sh $old first" >&2; exit 2; }
for r in $(seq 1 "$rounds"); do
  for side in old new; do
    if [ $side = old ]; then tree=$here/.ab/old; sha="$old-core"; else tree=$here; sha=$new; fi
    # PYTHONPATH names the tree first: the caller's may name this checkout (h200_call.sh's does)
    (cd "$tree" && PYTHONPATH="$tree:${DOS_SITE:-/tmp/site}" DOS_GIT_SHA=$sha python3 -c \
        'import sys, dos; print("round", sys.argv[1], "dos from", dos.__file__)' "$r" \
     && PYTHONPATH="$tree:${DOS_SITE:-/tmp/site}" DOS_GIT_SHA=$sha python3 -m dos.lab.bench.kernel \
        --threads "$@" --params "${PARAMS:-400000000}" --reps "${REPS:-5}" --sweep "$sweep" --out "$out" \
        --batch-id "$batch" --impls $impls) || echo "round $r $side rc=$?"
    if [ -n "${PACK:-}" ]; then tar -czf "$PACK.tmp" -C "$out" "$sweep" && mv "$PACK.tmp" "$PACK"; fi
  done
done
