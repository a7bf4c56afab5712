"""The split and fp32 CPU kernels on the engine's kind of memory and calls (issue 17, criterion 3).

    python experiments/scripts/lane_memory.py OUT.csv [--params N] [--sub N] [--reps R] [--threads T]

In the engine the split lane runs at 84-89% of its kernel's rate alone (session 33 notes). Two
differences from dos.lab.bench.kernel: the state lives in the host arena (one anonymous mapping,
MADV_HUGEPAGE, page-locked with cudaHostRegister: dos.buffers.HostArena) and the lane updates it
one subgroup (`--sub` elements) per call. Each kernel runs over the same N elements in four ways —
{torch.empty, arena} memory x {one call, N/sub calls} — and two more ways on the arena that copy as
the engine's all-CPU step does: `uploads` (each subgroup's weights copied to the GPU, non-blocking,
after its update: the next update runs beside that copy) and `engine` (as `uploads`, after 0.3 s
of an idle CPU and the gradients' D2H into the host gradient buffer: the backward before a step) —
alternating per repetition; medians of R. For the two copying ways the rows also give the median
per-call rate of the first 3 calls and of the later ones (a slow start after idle shows there),
and the median time of the upload's `copy_` call on the host (in the engine the gap between two
subgroups' updates was 150-260 us).
Rows (one per kernel and way) append to OUT.csv with $BATCH_ID, the GPU UUID and the boot id.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from dos import split_master as sm  # noqa: E402
from dos.adam import cpu_adamw_, cpu_split_step_  # noqa: E402
from dos.lab.bench.kernel import HP, _fill, _next  # noqa: E402
from dos.lab.bench.records import append_script_rows, batch_columns  # noqa: E402


def arena(nbytes: int) -> torch.Tensor:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    assert int(err) == 0, err
    t._keep = m  # noqa: SLF001
    return t


def state(n: int, kind: str, where: str):
    """fp32: master, m, v fp32 + bf16 grad/weights; split: hi, lo, m, v 16-bit + bf16 grad."""
    if kind == "fp32":
        sizes = [(torch.float32, n)] * 3 + [(torch.bfloat16, n)]
    else:
        sizes = [(torch.bfloat16, n), (torch.int16, n), (torch.bfloat16, n), (torch.bfloat16, n),
                 (torch.bfloat16, n)]
    nb = sum(dt.itemsize * k for dt, k in sizes)
    buf = arena(nb) if where == "arena" else torch.empty(nb, dtype=torch.uint8)
    out, off = [], 0
    for dt, k in sizes:
        out.append(buf[off: off + dt.itemsize * k].view(dt))
        off += dt.itemsize * k
    if kind == "fp32":
        _fill(out[0], 0.02, 0), out[1].zero_(), out[2].zero_(), _fill(out[3], 1e-3, 1)
    else:
        hi, lo = sm.split(_fill(torch.empty(n), 0.02, 6))
        out[0].copy_(hi), out[1].copy_(lo), out[2].zero_(), out[3].zero_(), _fill(out[4], 1e-3, 1)
    return out, buf


def step(kind, s, lo, hi, threads):
    if kind == "fp32":
        p, m, v, g = s
        cpu_adamw_(p[lo:hi], m[lo:hi], v[lo:hi], g[lo:hi], g[lo:hi], step=_next(), threads=threads, **HP)
    else:
        h, l, m, v, g = s
        cpu_split_step_(h, l, m, v, g, None, lo_i=lo, hi_i=hi, step=_next(), threads=threads, **HP)


def _med(xs) -> str:
    return f"{statistics.median(xs):.4f}" if xs else ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--params", type=int, default=300_000_000)
    ap.add_argument("--sub", type=int, default=50_331_648)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    n = a.params
    bufs = {(k, w): state(n, k, w) for k in ("fp32", "split") for w in ("empty", "arena")}
    ways = [(k, w, c) for k in ("fp32", "split") for w in ("empty", "arena") for c in ("one", "subgroups")]
    ways += [(k, "arena", c) for k in ("fp32", "split") for c in ("uploads", "engine")]
    dev = torch.empty(a.sub, dtype=torch.bfloat16, device="cuda")  # the uploads' destination
    dgrad = _fill(torch.empty(n), 1e-3, 7).to(device="cuda", dtype=torch.bfloat16)  # the D2H's source
    per_call = {x: ([], []) for x in ways}
    launch = {x: [] for x in ways}  # seconds in the upload's copy_ call (the host's cost per subgroup)

    def run(k, w, c):
        s = bufs[(k, w)][0]
        spans = [(0, n)] if c == "one" else [(lo, min(n, lo + a.sub)) for lo in range(0, n, a.sub)]
        copies = c in ("uploads", "engine")
        weights = s[3] if k == "fp32" else s[0]  # fp32: over the gradient; split: hi
        if c == "engine":
            torch.cuda.synchronize()
            time.sleep(0.3)
            s[-1].copy_(dgrad, non_blocking=True)  # the gradient ("fp32": its weights go over it)
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, (lo, hi) in enumerate(spans):
            t1 = time.perf_counter()
            step(k, s, lo, hi, a.threads)
            if copies:
                per_call[(k, w, c)][i >= 3].append((hi - lo) / (time.perf_counter() - t1) / 1e9)
                t2 = time.perf_counter()
                dev[: hi - lo].copy_(weights[lo:hi], non_blocking=True)
                launch[(k, w, c)].append(time.perf_counter() - t2)
        if copies:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for x in ways:
        run(*x)
    for v in per_call.values():  # the warm-up calls' rates are not reported
        v[0].clear(), v[1].clear()
    for v in launch.values():
        v.clear()
    times = {x: [] for x in ways}
    for _ in range(a.reps):
        for x in ways:
            times[x].append(run(*x))
    base = {**batch_columns(), "threads": a.threads, "params": n, "sub": a.sub, "reps": a.reps}
    rows = [{**base, "kernel": k, "memory": w, "calls": c, "median_s": round(statistics.median(ts), 5),
             "min_s": round(min(ts), 5), "max_s": round(max(ts), 5),
             "gparams_per_s": round(n / statistics.median(ts) / 1e9, 4),
             "first_calls_gparams_per_s": _med(per_call[(k, w, c)][0]),
             "later_calls_gparams_per_s": _med(per_call[(k, w, c)][1]),
             "copy_call_us": _med([x * 1e6 for x in launch[(k, w, c)]])} for (k, w, c), ts in times.items()]
    append_script_rows(a.out, rows)
    for r in rows:
        print(f"{r['kernel']:<6} {r['memory']:<6} {r['calls']:<10} {r['gparams_per_s']:7.3f} G/s"
              f"  first/later calls {r['first_calls_gparams_per_s'] or '-'} / {r['later_calls_gparams_per_s'] or '-'}")


if __name__ == "__main__":
    main()
