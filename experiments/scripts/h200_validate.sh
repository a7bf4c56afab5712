#!/usr/bin/env bash
# One device call: GPU tests, calibration, CPU-kernel benchmark, engine sanity at 1.3B.
# Usage (device machine, repo root): bash experiments/scripts/h200_validate.sh   (writes under $OUT)
set -u
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
{ nvidia-smi -L; nproc; free -g; gcc --version | head -1; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'; lscpu | grep -i 'model name'; } > $OUT/machine.txt 2>&1
timeout 230 python3 -m pytest -q -m gpu --timeout 90 tests/test_engine.py tests/test_gpu_races.py tests/test_kernel.py tests/test_perfmodel.py -p no:cacheprovider > $OUT/pytest-gpu.log 2>&1; echo "pytest rc=$?"
tail -5 $OUT/pytest-gpu.log
timeout 80 python3 -m dos.calibrate --out $OUT/calibration.json > $OUT/calibration.txt 2>&1; echo "calibrate rc=$?"
tail -25 $OUT/calibration.txt
timeout 150 python3 -m dos.lab.bench.kernel --threads 16 8 --params 400000000 --sweep kernel-h200 --out $OUT > $OUT/kernel.txt 2>&1; echo "kernel rc=$?"
tail -20 $OUT/kernel.txt
timeout 100 python3 experiments/scripts/engine_scale_check.py 1.3B > $OUT/scale.txt 2>&1; echo "scale rc=$?"
cat $OUT/scale.txt | tail -12
