#!/usr/bin/env bash
# One device call, in three parts, each optional (empty string skips):
#   bash experiments/scripts/h200_call.sh SECONDS "PYTEST_ARGS" "NOTEBOOKS" [SWEEP.yaml[:WHERE[&WHERE]][@OUTDIR][#[+]BATCH_ID] ...]
#   (WHERE: KEY=VALUE without spaces, e.g. model=3B&system=[dos,torch-gpu]; OUTDIR: results
#   directory instead of experiments/results/<name>, e.g. a same-call recheck of recorded runs;
#   #BATCH_ID: this sweep continues that batch, #+BATCH_ID starts it — instead of the environment's
#   BATCH_ID / BATCH_NEW, so that one call can finish one batch and start another: one $OUT, a
#   handful of files, where two invocations of this script in one call returned too many and lost two)
# - PYTEST_ARGS: `pytest -m gpu` on these test files (log in $OUT/pytest-gpu.log)
# - NOTEBOOKS: `python -m dos run --rerun --only NOTEBOOKS` (papermill; each notebook runs its
#   sweeps, resumably, into experiments/results/, then plots)
# - SWEEP...: `python -m dos sweep` (after `python -m dos calibrate --cached`)
# Rows record git_sha: the device's copy of the checkout has the last landed commit's .git under
# this session's files, so prefix the command with DOS_GIT_SHA=<this checkout's short sha>.
# BATCH_ID=<id> in the environment names the batch: with BATCH_NEW=1 the call starts it, without,
# the call continues it (a sweep longer than one call, on the same warm machine) and the sweep
# refuses to start unless its results already hold rows of that batch from this boot
# (`dos sweep --continue-batch`). Sweeps write into $DOS_DEVICE_RESULTS/<sweep> (default
# /root/dos-results), outside the checkout: the checkout is copied afresh at every call, that folder
# survives between calls on a warm machine (session 10 lost that and ran a batch's first runs three
# times); it is seeded from experiments/results/<sweep> when absent and copied back after the sweep.
# Every sweep also packs its whole results dir into $OUT/<sweep>.tar.gz after each run (extract it
# into experiments/results/), so a call cut short by its time limit loses only the run in flight.
# Everything under experiments/results and figures/ that changed comes back in $OUT/results.tar.gz,
# also when the budget runs out mid-sweep (the run in flight is lost; the sweep resumes next call).
set -u
budget=$1; pytest_args=$2; notebooks=$3; shift 3
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
# Bytecode: every run is its own process, and `import transformers` took ~12-22 s in each on the
# H200 image. Python writes and reads .pyc files unless PYTHONDONTWRITEBYTECODE is set, which it is
# in this project's CPU image (likely the device's too: DeepSpeed runs compiled its sources, 3-4 s
# of `compile` in every run's init_profile, session 20). The PYTHONPYCACHEPREFIX=/tmp/pycache this
# script set until session 21 made it worse: with a prefix Python ignores the __pycache__ dirs
# beside the sources, and with writes off it compiled torch and transformers from source in every
# process (here: `import torch, transformers...llama` 8.2-8.6 s with the prefix, 3.2-3.7 s
# without). So: no prefix, writes on (the first process writes what a wheel installed without
# pyc, in /tmp/site and the checkout). machine.txt records the flags and two timed imports.
# HF_HUB_OFFLINE: the machine has no network; nothing here downloads (models are built from config).
unset PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX
export HF_HUB_OFFLINE=1
# Keep $OUT to a handful of files: the device returns a limited number, and session 9 lost a
# call's results archive to 20 extra files copied there.
# Wheels: carry `.whl` (all of gpu-wheels.sh's and the notebooks') or, where the checkout and it
# exceed the device's 64 MiB, `.whl-base` (DeepSpeed, its pure-Python deps and torchao: ~8 MiB).
# `python experiments/scripts/device_tree.py size --carry .whl` says first (free); over it,
# `device_tree.py slim` leaves the runs' folders out of the checkout (full: back) — session 36:
# 58.7 MiB + 8.0 of wheels refused.
# Installed once per machine: a warm machine keeps /tmp/site, and reinstalling gives DeepSpeed's
# C++ sources new mtimes, so that the first DeepSpeed run of every call rebuilt cpu_adam with ninja
# (42-51 s of its init, in each of session 12's four calls: `init_profile` in result.json).
wheels=$(ls .whl/*.whl 2>/dev/null || ls .whl-*/*.whl 2>/dev/null)
site_stamp=${DOS_SITE:-/tmp/site}/.dos-wheels
# (the stamp hashes the wheels' names and bytes: the checkout, copied afresh each call, has new mtimes)
if [ -n "$wheels" ] && [ "$(cat $site_stamp 2>/dev/null)" != "$(md5sum $wheels | md5sum)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target ${DOS_SITE:-/tmp/site} $wheels \
    && md5sum $wheels | md5sum > $site_stamp
fi
export PYTHONPATH=$PWD:${DOS_SITE:-/tmp/site}
touch /tmp/stamp
{ nvidia-smi -L; nproc; free -g; python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
  cat /proc/sys/kernel/random/boot_id /sys/kernel/mm/transparent_hugepage/enabled
  # NUMA nodes: where a run's arena may land; threads per core: whether 16 CPUs are 8 cores
  lscpu | grep -iE "model name|numa|socket|mhz|per core|^cpu\(s\)|flags" | cut -c1-400
  for i in 1 2; do python3 -c 'import sys, time; t = time.perf_counter(); import torch, transformers.models.llama.modeling_llama
print("import torch+transformers", round(time.perf_counter() - t, 2), "s; dont_write_bytecode", sys.flags.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix)'; done
} > $OUT/machine.txt 2>&1
if [ -n "$pytest_args" ]; then
  timeout $(( $(left) - 30 )) python3 -m pytest -q -m gpu --timeout 120 -p no:cacheprovider $pytest_args > $OUT/pytest-gpu.log 2>&1
  echo "pytest rc=$?"; tail -4 $OUT/pytest-gpu.log
fi
if [ -n "$notebooks" ]; then
  timeout -k 10 $(( $(left) - 25 )) python3 -m dos run --rerun --only $notebooks > $OUT/run.log 2>&1
  echo "dos run rc=$?"; tail -15 $OUT/run.log
fi
if [ $# -gt 0 ]; then
  # named after the GPU it ran on (until session 28 every profile was named NVIDIA-H200-*, the H100
  # calls' too: their gpu_name field says which card it was)
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print $1"-"$2}')
  timeout 60 python3 -m dos calibrate --cached --out experiments/results/calibration/${gpu:-GPU}-$(date -u +%Y%m%d-%H%M%S).json \
    > $OUT/calibration.txt 2>&1; echo "calibrate rc=$?"  # the profile the runs plan with, recorded
  for arg in "$@"; do
    bspec=""; case $arg in *'#'*) bspec=${arg##*#}; arg=${arg%#*};; esac
    out=""; case $arg in *@*) out="--out ${arg##*@}"; arg=${arg%@*};; esac
    file=${arg%%:*}; where=""
    [ "$arg" != "$file" ] && for w in $(echo "${arg#*:}" | tr '&' ' '); do where="$where --where $w"; done
    name=$(basename $file .yaml)
    if [ -z "$out" ]; then
      res=${DOS_DEVICE_RESULTS:-/root/dos-results}/$name; out="--out $res"
      [ -d $res ] || { mkdir -p $(dirname $res); if [ -d experiments/results/$name ]; then cp -a experiments/results/$name $res; else mkdir $res; fi; }
    else res=""; fi
    batch=""; [ -n "${BATCH_ID:-}" ] && batch="--continue-batch $BATCH_ID" && [ "${BATCH_NEW:-0}" = 1 ] && batch="--batch-id $BATCH_ID"
    case $bspec in "") ;; +*) batch="--batch-id ${bspec#+}";; *) batch="--continue-batch $bspec";; esac
    # --stop-by-s: no run is started that the recorded rows say would not end in time (it would be
    # killed in flight, its minute lost); `timeout` stays the backstop. H200_NO_STOP_BY=1 starts
    # the runs regardless, for a system whose expectation is only a fallback (a system never run
    # at that size is expected to take as long as the longest run there: DeepSpeed's bf16 offload
    # at 1.3B, 507 s expected, ~8.5 min left in a call after its setup)
    stop_by="--stop-by-s $(( $(left) - 35 ))"; [ "${H200_NO_STOP_BY:-0}" = 1 ] && stop_by=""
    timeout -k 10 $(( $(left) - 25 )) python3 -m dos sweep $file $where $out --no-progress \
      $stop_by $batch --pack $OUT/$name.tar.gz >> $OUT/sweeps.log 2>&1
    echo "sweep $file rc=$?"; tail -3 $OUT/sweeps.log
    [ -n "$res" ] && mkdir -p experiments/results/$name && cp -a $res/. experiments/results/$name/
  done
fi
# leftovers of a notebook or run cut off by `timeout` (the device runs nothing else; a CPU test of
# this script sets H200_CALL_KEEP_PROCS=1)
# The patterns are anchored at the interpreter (a process's command line starting with python):
# session 17's command that ran `python3 -m dos.lab.bench.kernel` after this script matched an
# unanchored "dos.lab.bench" in its own `bash -c` line and was killed with it.
[ "${H200_CALL_KEEP_PROCS:-0}" = 1 ] || { for p in ipykernel_launcher "dos\.lab\.bench" "dos\.lab\.zygote"; do
  pkill -f "^[^ ]*python[0-9.]* (-[^ ]+ )*-m $p"; done; sleep 2; }
find experiments/results figures -newer /tmp/stamp -type f > /tmp/changed
tar -czf $OUT/results.tar.gz -T /tmp/changed; echo "packed $(wc -l < /tmp/changed) files"; du -sh $OUT/results.tar.gz
