#!/usr/bin/env bash
# Race tests after the slot fix, then the 1.3B every-system sweep (issue 5, criterion 2).
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
timeout 130 python3 -m pytest -q -m gpu --timeout 60 tests/test_gpu_races.py -p no:cacheprovider > $OUT/pytest-races.log 2>&1; echo "races rc=$?"; tail -4 $OUT/pytest-races.log
bash experiments/scripts/h200_sweep.sh 420 experiments/sweeps/h200-1.3b.yaml
