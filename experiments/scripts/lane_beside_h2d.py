"""The CPU lane's kernels alone and beside a host-to-device copy stream (issue 17, criterion 3).

    python experiments/scripts/lane_beside_h2d.py OUT.csv [--params N] [--reps R] [--threads T]

In the engine the all-CPU split lane runs at 84-89% of its kernel's rate alone, fp32's at 93-96%
(experiments/results/gpu-tests/20261207-s33-NOTES.md). Beside it, the weights' upload reads host
memory by DMA. This measures each kernel (dos.lab.bench.kernel's "dos" fp32, "dos-bf16-split",
"dos-bf16-noweight": the same 18 B) on T threads alone, then while one CUDA stream copies a pinned
1 GiB buffer to the GPU back to back (the copy's own rate recorded), then alone again; conditions
alternate per repetition (alone, beside, alone, ...), medians over R repetitions. One row per
(impl, condition), appended to OUT.csv with the batch id ($BATCH_ID), GPU UUID and boot id.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from dos.lab.bench import kernel  # noqa: E402
from dos.lab.bench.records import append_script_rows, boot_id, git_sha, gpu_uuid, now_iso  # noqa: E402


class CopyStream:
    """Back-to-back H2D copies of one pinned buffer on a side stream, in a thread, until stopped."""

    def __init__(self, nbytes: int):
        self.src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.bytes = 0
        self.stop = threading.Event()

    def _run(self):
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.dst.copy_(self.src, non_blocking=True)
                self.stream.synchronize()
                self.bytes += self.src.numel()

    def __enter__(self):
        self.stop.clear()
        self.bytes, self.t0 = 0, time.perf_counter()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.gbs = self.bytes / (time.perf_counter() - self.t0) / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--params", type=int, default=300_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    impls = kernel.make_impls(a.params, ["dos", "dos-bf16-split", "dos-bf16-noweight"])
    torch.set_num_threads(a.threads)
    copier = CopyStream(1 << 30)
    for i in impls:  # warm-up
        i.step(a.threads)
    times = {(i.name, c): [] for i in impls for c in ("alone", "beside_h2d")}
    copy_gbs = []
    for rep in range(a.reps):
        for cond in ("alone", "beside_h2d"):
            for i in impls:
                if cond == "alone":
                    t0 = time.perf_counter()
                    i.step(a.threads)
                    times[(i.name, cond)].append(time.perf_counter() - t0)
                else:
                    with copier:
                        time.sleep(0.05)  # the stream running
                        t0 = time.perf_counter()
                        i.step(a.threads)
                        times[(i.name, cond)].append(time.perf_counter() - t0)
                    copy_gbs.append(copier.gbs)
    base = {"timestamp": now_iso(), "git_sha": git_sha(), "batch_id": os.environ.get("BATCH_ID", ""),
            "gpu_name": torch.cuda.get_device_name(0), "gpu_uuid": gpu_uuid(),
            "boot_id": boot_id(), "threads": a.threads, "params": a.params, "reps": a.reps,
            "h2d_gbs_median": round(statistics.median(copy_gbs), 2)}
    rows = []
    for i in impls:
        for cond in ("alone", "beside_h2d"):
            ts = times[(i.name, cond)]
            med = statistics.median(ts)
            rows.append({**base, "impl": i.name, "condition": cond, "bytes_per_param": i.bytes_per_param,
                         "median_s": round(med, 5), "min_s": round(min(ts), 5), "max_s": round(max(ts), 5),
                         "gparams_per_s": round(a.params / med / 1e9, 4)})
    append_script_rows(a.out, rows)
    for r in rows:
        print(f"{r['impl']:<18} {r['condition']:<11} {r['gparams_per_s']:7.3f} G/s  ({r['min_s']}-{r['max_s']} s)")
    print(f"H2D beside the kernels: median {base['h2d_gbs_median']} GB/s")


if __name__ == "__main__":
    main()
