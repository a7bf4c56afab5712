"""The GPU lane's fused kernels side by side: bf16 moments with an fp32 master against the split
master (dos/split_master.py), on one CUDA device; one CSV row per kernel appended to
$OUT/split-gpu-bench.csv (or the path given). Median of `reps` launches over n elements, each after
one warm-up; bytes per element as dos/state_kernels.py counts them (bf16 20 with a bf16 gradient
and weights out; split 18: its weights are hi, written once).

    python experiments/scripts/split_gpu_bench.py [--n 400000000] [--reps 10] [--out FILE]
"""
import argparse
import os
import statistics
import subprocess
import time

import torch

from dos import split_master as sm
from dos import state_format as sf
from dos import state_kernels
from dos.lab.bench.records import append_script_rows

HP = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def timed(fn, reps):
    fn(1)
    torch.cuda.synchronize()
    ts = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i + 2)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return ts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400_000_000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "split-gpu-bench.csv"))
    a = ap.parse_args()
    n, dev = a.n, "cuda"
    g = (torch.randn(n, device=dev) * 1e-3).to(torch.bfloat16)
    fmt = sf.state_format("bf16")
    buf = torch.zeros(fmt.nbytes(n), dtype=torch.uint8, device=dev)
    views = fmt.views(buf, n)
    views.master.normal_(0, 0.02)
    w = torch.empty(n, dtype=torch.bfloat16, device=dev)
    hi, lo = sm.split(views.master)
    m16, v16 = torch.zeros_like(w), torch.zeros_like(w)
    runs = {
        "bf16": (20, lambda s: state_kernels.fused_step_("bf16", views, g, w, lo=0, hi=n, step=s,
                                                         scale_t=None, **HP)),
        "split": (18, lambda s: state_kernels.fused_split_step_(hi, lo, m16, v16, g, None, lo_i=0, hi_i=n,
                                                                step=s, scale_t=None, **HP)),
    }
    uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()
    rows = []
    for name, (nbytes, fn) in runs.items():
        ts = timed(fn, a.reps)
        med = statistics.median(ts)
        rows.append({"kernel": name, "n": n, "reps": a.reps, "median_s": round(med, 6),
                     "min_s": round(min(ts), 6), "max_s": round(max(ts), 6),
                     "gelem_per_s": round(n / med / 1e9, 3), "bytes_per_elem": nbytes,
                     "gbytes_per_s": round(nbytes * n / med / 1e9, 1),
                     "gpu": torch.cuda.get_device_name(0), "gpu_uuid": uuid,
                     "git_sha": os.environ.get("DOS_GIT_SHA", ""), "torch": torch.__version__,
                     "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        print(rows[-1], flush=True)
    append_script_rows(a.out, rows)


if __name__ == "__main__":
    main()
