#!/usr/bin/env bash
# One device call: calibrate (cached for stride=auto and predicted_step_s), then sweeps.
# Usage: bash experiments/scripts/h200_sweep.sh SECONDS SWEEP.yaml[:WHERE] ...   (writes under $OUT)
# A previous call's packed results can be carried in .device-in/NAME.tar.gz to resume.
set -u
budget=$1; shift
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
start=$(date +%s)
timeout 60 python3 -m dos calibrate --out $OUT/calibration.json > $OUT/calibration.txt 2>&1; echo "calibrate rc=$?"
for arg in "$@"; do
  file=${arg%%:*}; where=""; [ "$arg" != "$file" ] && where="--where ${arg#*:}"
  name=$(basename $file .yaml)
  mkdir -p /tmp/results; [ -f .device-in/$name.tar.gz ] && tar -xzf .device-in/$name.tar.gz -C /tmp/results
  left=$(( budget - ($(date +%s) - start) ))
  timeout $left python3 -m dos sweep $file $where --out /tmp/results/$name --pack $OUT/$name.tar.gz --no-progress 2>&1 | tail -15
  echo "sweep $name rc=$?"
done
