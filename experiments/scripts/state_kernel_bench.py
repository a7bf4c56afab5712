"""The accelerator lane's update of one subgroup per state format, timed on the GPU (issue 17, crit 3).

    python experiments/scripts/state_kernel_bench.py OUT.csv [--numel N] [--reps R]

For each format and implementation (fp32: torch's fused AdamW with the bf16 gradient widened and
the weights copied out, as dos.adam.device_state_step_; bf16/int8: dos.state_kernels' fused
Triton kernel and the torch-op path it replaces), on one N-element subgroup with a bf16 gradient
and bf16 weights out: the median of R timed launches (CUDA events, after 3 warm-ups; the inputs
are random). `min_bytes` counts each input read once and each output written once; `gbs` is
min_bytes / time. One row per case, appended to OUT.csv with the GPU's name and UUID; a
micro-benchmark, not a run of the engine: the engine's update phase is in the sweeps' step_s.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from dos import adam, state_kernels  # noqa: E402
from dos import state_format as sf  # noqa: E402
from dos.lab.bench.records import append_script_rows  # noqa: E402

MIN_BYTES = {"fp32": 28, "bf16": 20, "int8": 16}  # per element: grad 2, master 8, moments, weights 2


def case(fmt: str, impl: str, n: int, reps: int) -> dict:
    f = sf.state_format(fmt)
    buf = torch.zeros(f.nbytes(n), dtype=torch.uint8, device="cuda")
    v = f.views(buf, n)
    v.master.normal_()
    g = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    scratch = torch.empty(sf.scratch_numel(fmt, n) if impl != "triton-fused" else 1, device="cuda")
    step_t = torch.ones((), device="cuda")
    if impl == "torch-ops":
        os.environ["DOS_NO_TRITON"] = "1"
    try:
        def one(step):
            step_t.fill_(float(step))
            adam.device_state_step_(fmt, v, g, out, lo=0, hi=n, step=step, step_t=step_t, lr=1e-4,
                                    beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                                    scale_t=None, scratch=scratch)
        for s in range(1, 4):
            one(s)
        torch.cuda.synchronize()
        times = []
        for s in range(4, 4 + reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            one(s)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    finally:
        os.environ.pop("DOS_NO_TRITON", None)
    t = statistics.median(times)
    finite = bool(torch.isfinite(v.master).all())
    del buf, v, g, out, scratch
    torch.cuda.empty_cache()
    return dict(fmt=fmt, impl=impl, numel=n, reps=reps, median_s=round(t, 6), min_s=round(min(times), 6),
                max_s=round(max(times), 6), min_bytes=MIN_BYTES[fmt] * n,
                gbs=round(MIN_BYTES[fmt] * n / t / 1e9, 1), finite=finite)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--numel", type=int, default=256 << 20)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    uuid = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip().splitlines()[0]
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    cases = [("fp32", "torch-fused"), ("bf16", "triton-fused"), ("bf16", "torch-ops"),
             ("int8", "triton-fused"), ("int8", "torch-ops")]
    rows = []
    for fmt, impl in cases:
        r = case(fmt, impl, a.numel, a.reps)
        r.update(gpu=torch.cuda.get_device_name(), gpu_uuid=uuid, boot_id=boot,
                 git_sha=os.environ.get("DOS_GIT_SHA", ""), timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        rows.append(r)
        print(r, flush=True)
    append_script_rows(a.out, rows)


if __name__ == "__main__":
    main()
