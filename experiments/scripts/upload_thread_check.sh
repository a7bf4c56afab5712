#!/usr/bin/env bash
# One device call: is the CPU lane's upload thread (dos/uploads.py) correct and faster on the GPU?
#   DOS_GIT_SHA=<sha> BATCH=<batch prefix> bash experiments/scripts/upload_thread_check.sh
# Writes under $OUT: pytest-uploads.log (the race tests with the thread and the CPU tests of it),
# upload-thread-ab.csv/.log (experiments/scripts/upload_thread_ab.py: fp32 and bf16-split all-CPU
# steps, thread on/off, round-robin in one process), copy-call.csv/.log
# (experiments/scripts/copy_call_cost.py), machine.txt. ~4 min with the kernel's compile.
set -u
: "${OUT:?set OUT}" "${DOS_GIT_SHA:?set DOS_GIT_SHA: the git HEAD of the device copy is stale}"
B=${BATCH:-$(date -u +%Y%m%dT%H%MZ)}
{ nvidia-smi --query-gpu=name,uuid --format=csv,noheader; cat /proc/sys/kernel/random/boot_id; echo "code $DOS_GIT_SHA"; } > $OUT/machine.txt
timeout 240 python -m pytest -q tests/test_uploads.py tests/test_gpu_races.py \
  > $OUT/pytest-uploads.log 2>&1; tail -3 $OUT/pytest-uploads.log
BATCH_ID=$B-upload-thread-ab timeout 200 python experiments/scripts/upload_thread_ab.py $OUT/upload-thread-ab.csv \
  > $OUT/upload-thread-ab.log 2>&1; tail -14 $OUT/upload-thread-ab.log
BATCH_ID=$B-copy-call timeout 60 python experiments/scripts/copy_call_cost.py $OUT/copy-call.csv \
  > $OUT/copy-call.log 2>&1; tail -13 $OUT/copy-call.log
