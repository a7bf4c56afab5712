"""CPU AdamW kernels side by side: dos's fused kernel vs DeepSpeedCPUAdam + cast vs torch fused + cast.

    python -m dos.lab.bench.kernel --threads 1 4 8 16 --params 400000000 --sweep kernel-h200 [--out DIR]
        [--impls NAME ...]   (only these; default all)

One process, one set of arrays (fp32 master and moments, a bf16 gradient that each implementation
overwrites with the bf16 weights, as the engine's CPU lane does, and an fp32 gradient for
DeepSpeed). For each thread count: STREAM-like copy and triad (torch ops, `reps` medians), one
warm-up step of every implementation, then `reps` rounds in which each runs one full step in turn;
medians over rounds. One row per (impl, threads) is appended to `<out>/<sweep>/runs.csv`, where
`<out>` is --out, else $OUT, else experiments/results; `env-<stamp>.json` goes beside it.

bytes_per_param counts the bytes each implementation's passes read plus write per parameter, in
STREAM's convention (no write-allocate; scratch that stays in cache is free):
  dos               28 = 3 x (4 + 4) state in place + 2 bf16 grad in + 2 bf16 weight out (same lines)
  torch-fused+cast  32 = 2 bf16 grad (widened in cache) + 24 state + 4 master re-read + 2 bf16 out
  deepspeed+cast    34 = 4 fp32 grad + 24 state + 4 master re-read + 2 bf16 out
  deepspeed-step    28 = 4 fp32 grad + 24 state (the step alone, without the cast)
  torch-fused-step  28 = 4 fp32 grad + 24 state (torch._fused_adamw_ alone, one call)
  dos-bf16          20 = master 4 + 4, bf16 moments 2 x (2 + 2), 2 bf16 grad in, 2 weights out
  dos-int8          16 = master 4 + 4, int8/uint8 codes 2 x (1 + 1), 2 + 2 (scales: 16 B/2048)
  dos-bf16-noweight 18 = dos-bf16 without the weights out (`out=None`)
  dos-bf16-split    18 = split master hi 2 + 2, lo 2 + 2, bf16 moments 2 x (2 + 2), 2 bf16 grad in
(dos-bf16 and dos-int8: dos's CPU kernel on bf16 / int8 moments, dos/state_format.py; the engine's
CPU lane with `state_dtype`, measured apart from the lanes and copies: issue 17, criterion 3.
dos-bf16-noweight moves exactly the bytes of a *split master* (docs/DESIGN.md §3.7: the master
stored as its bf16 weight `hi` and a 16-bit `lo`, so writing the master writes the weight): the
measured bound of that lever on this host's CPU lane — its weights are wrong; dos-bf16-split is the
split master's own kernel, dos/split_master.py: the engine's state_dtype="bf16-split".)
stream-copy (b -> a) counts 8 B, stream-triad (a = b + 3c) 12 B and stream-add-inplace (a += b, the
kernels' read-modify-write pattern, no write-allocate) 12 B per element.
"""
from __future__ import annotations

import argparse
import csv
import fcntl
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import psutil
import torch

from dos import _csrc
from dos.adam import cpu_adamw_, cpu_impl, torch_cpu_adamw_
from dos.lab.bench.records import boot_id, environment, git_sha, gpu_uuid, now_iso

COLUMNS = (
    "run_id", "sweep", "timestamp", "git_sha", "status", "error", "impl", "threads", "params",
    "gparams_per_s", "bytes_per_param", "gbytes_per_s", "stream_copy_gbs", "stream_triad_gbs",
    "frac_of_copy", "median_s", "min_s", "max_s", "reps", "cpu_impl", "build_s", "cpu_model",
    "cores", "gpu_name", "host", "torch", "deepspeed", "batch_id", "gpu_uuid", "boot_id",
)
# batch_id ($BATCH_ID, or --batch-id), gpu_uuid and boot_id: which rows are side by side (one
# machine start); a results dir with the older header (without them) takes no new rows.
HP = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
STREAM_ELEMS = 100_000_000  # 400 MB per array: far beyond any last-level cache


class Impl:
    """One implementation: a callable doing one full step, or the reason it cannot run."""

    def __init__(self, name: str, bytes_per_param: int, step: Optional[Callable[[int], None]] = None,
                 error: str = "", build_s: Optional[float] = None):
        self.name, self.bytes_per_param, self.step = name, bytes_per_param, step
        self.error, self.build_s = error, build_s


def _fill(t: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """Random-looking contents fast (a 1M-element normal block tiled): torch.randn is serial."""
    block = torch.randn(1 << 20, generator=torch.Generator().manual_seed(seed)).mul_(std).to(t.dtype)
    for lo in range(0, t.numel(), block.numel()):
        t[lo:lo + block.numel()].copy_(block[: t.numel() - lo])
    return t


def make_impls(n: int, only: Optional[List[str]] = None) -> List[Impl]:
    """Every implementation, or those named in `only` (the others' state is never allocated)."""
    want = (lambda name: True) if not only else (lambda name: name in only)
    master, m, v = _fill(torch.empty(n), 0.02, 0), torch.zeros(n), torch.zeros(n)
    g16 = _fill(torch.empty(n, dtype=torch.bfloat16), 1e-3, 1)  # gradient in, weights out
    g32 = _fill(torch.empty(n), 1e-3, 2)  # DeepSpeed's gradient (fp32 params, fp32 grads)
    step_t = torch.tensor(1.0)
    t0 = time.perf_counter()
    _csrc.ops()  # builds or loads the extension (or warns and falls back)
    build_s = time.perf_counter() - t0

    def torch_step(t):
        torch._fused_adamw_([master], [g32], [m], [v], [], [step_t], lr=HP["lr"], beta1=HP["beta1"],
                            beta2=HP["beta2"], weight_decay=HP["weight_decay"], eps=HP["eps"],
                            amsgrad=False, maximize=False)

    ds = want("deepspeed+cast") or want("deepspeed-step")
    impls = [
        Impl("dos", 28, lambda t: cpu_adamw_(master, m, v, g16, g16, step=_next(), threads=t, **HP),
             build_s=build_s),
        *lowp_impls(n, g16, want),
        Impl("torch-fused+cast", 32, lambda t: torch_cpu_adamw_(master, m, v, g16, g16, step=_next(), **HP)),
        *(deepspeed_impls(master, m, v, g32, g16) if ds else []),
        Impl("torch-fused-step", 28, torch_step),
    ]
    return [i for i in impls if want(i.name)]


def lowp_impls(n: int, g16: torch.Tensor, want: Callable[[str], bool] = lambda name: True) -> List[Impl]:
    """dos's CPU kernel on bf16 and int8 moments (own state buffers, the shared bf16 gradient)."""
    from dos import state_format as sf
    from dos.adam import cpu_state_step_

    out = []
    for name, fmt, nbytes, weights in (("dos-bf16", "bf16", 20, g16), ("dos-int8", "int8", 16, g16),
                                       ("dos-bf16-noweight", "bf16", 18, None)):
        if not want(name):
            continue
        f = sf.state_format(fmt)
        buf = torch.zeros(f.nbytes(n), dtype=torch.uint8)
        views = f.views(buf, n)
        _fill(views.master, 0.02, 5)

        def step(t, views=views, fmt=fmt, weights=weights):
            cpu_state_step_(fmt, views, g16, weights, lo=0, hi=n, step=_next(), threads=t, **HP)
        out.append(Impl(name, nbytes, step))
    from dos import split_master as sm
    from dos.adam import cpu_split_step_

    if not want("dos-bf16-split"):
        return out
    hi, lo = sm.split(_fill(torch.empty(n), 0.02, 6))
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    out.append(Impl("dos-bf16-split", 18, lambda t: cpu_split_step_(
        hi, lo, m16, v16, g16, None, lo_i=0, hi_i=n, step=_next(), threads=t, **HP)))
    return out


IMPL_NAMES = ("dos", "dos-bf16", "dos-int8", "dos-bf16-noweight", "dos-bf16-split", "torch-fused+cast",
              "deepspeed+cast", "deepspeed-step", "torch-fused-step")

_steps = iter(range(1, 1 << 62))


def _next() -> int:
    return next(_steps)


def deepspeed_impls(master, m, v, g32, out16) -> List[Impl]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(master, requires_grad=False)
        p.grad = g32
        t0 = time.perf_counter()
        opt = DeepSpeedCPUAdam([p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                               weight_decay=HP["weight_decay"], adamw_mode=True)
        build_s = time.perf_counter() - t0  # its JIT build (or cached load)
        opt.state[p] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}  # share the moments: no 2nd copy
    except Exception as e:  # not installed, or its build failed
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        return [Impl("deepspeed+cast", 34, error=why), Impl("deepspeed-step", 28, error=why)]

    def step_and_cast(t):
        opt.step()
        out16.copy_(master)

    return [Impl("deepspeed+cast", 34, step_and_cast, build_s=build_s),
            Impl("deepspeed-step", 28, lambda t: opt.step())]


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


STREAM_BYTES = {"stream-copy": 8, "stream-triad": 12, "stream-add-inplace": 12}


def stream(n: int, reps: int) -> Dict[str, float]:
    """STREAM-like bandwidths (GB/s) with torch ops on torch's current thread count."""
    a, b, c = torch.empty(n), _fill(torch.empty(n), 1.0, 3), _fill(torch.empty(n), 1.0, 4)
    s = {"stream-copy": median_s(lambda: a.copy_(b), reps),
         "stream-triad": median_s(lambda: torch.add(b, c, alpha=3.0, out=a), reps),
         "stream-add-inplace": median_s(lambda: a.add_(b, alpha=1e-3), reps)}
    return {k: STREAM_BYTES[k] * n / t / 1e9 for k, t in s.items()}


def measure(impls: List[Impl], threads: int, reps: int) -> Dict[str, List[float]]:
    """Warm-up step of each, then `reps` rounds of one step each, in turn (drift hits all alike)."""
    runnable = [i for i in impls if i.step]
    for i in runnable:
        i.step(threads)
    times: Dict[str, List[float]] = {i.name: [] for i in runnable}
    for _ in range(reps):
        for i in runnable:
            t0 = time.perf_counter()
            i.step(threads)
            times[i.name].append(time.perf_counter() - t0)
    return times


def _host_info() -> dict:
    model = platform.processor()
    try:
        model = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        from importlib.metadata import version

        ds = version("deepspeed")
    except Exception:
        ds = ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    uuid = gpu_uuid() if gpu else ""
    return {"cpu_model": model, "cores": psutil.cpu_count(logical=False), "gpu_name": gpu,
            "host": platform.node(), "torch": torch.__version__, "deepspeed": ds,
            "gpu_uuid": uuid, "boot_id": boot_id()}


def append_rows(path: Path, rows: List[dict]) -> None:
    """Append under an exclusive lock; a new file gets the header, an old one must have ours."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        new = not path.exists() or path.stat().st_size == 0
        if not new:
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            if tuple(header) != COLUMNS:
                raise ValueError(f"{path} has other columns; use another --sweep")
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, COLUMNS)
            if new:
                w.writeheader()
            w.writerows(rows)
            f.flush()
            os.fsync(f.fileno())


def run(threads: List[int], params: int, sweep: str, reps: int, out: Path,
        only: Optional[List[str]] = None, batch_id: str = "") -> List[dict]:
    """Measure every thread count; rows are appended after each (a killed run keeps them)."""
    need = params * (12 + 2 + 4 + 8 + 6 + 8 + 8 + 4) + 3 * 4 * min(params, STREAM_ELEMS)
    avail = psutil.virtual_memory().available
    if need > 0.9 * avail:
        raise MemoryError(f"needs {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available")
    stamp = time.strftime("%Y%m%dT%H%M%S")
    sweep_dir = out / sweep
    sweep_dir.mkdir(parents=True, exist_ok=True)
    base = {"sweep": sweep, "timestamp": now_iso(), "git_sha": git_sha(), "params": params,
            "reps": reps, "batch_id": batch_id or os.environ.get("BATCH_ID", ""), **_host_info()}
    impls = make_impls(params, only)
    base["cpu_impl"] = cpu_impl()
    env = {**environment(), "csrc": _csrc.info(), "loadavg_at_start": os.getloadavg(),
           "argv": {"threads": threads, "params": params, "reps": reps, "impls": only}}
    (sweep_dir / f"env-{stamp}.json").write_text(json.dumps(env, indent=1, default=str))
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        bw = stream(min(params, STREAM_ELEMS), reps)
        times = measure(impls, t, reps)
        new = [{**base, "run_id": f"{stamp}-{name}-t{t}", "status": "ok", "impl": name, "threads": t,
                "bytes_per_param": STREAM_BYTES[name], "gbytes_per_s": round(gbs, 2),
                "params": min(params, STREAM_ELEMS)} for name, gbs in bw.items()]
        new += [impl_row(i, times.get(i.name), bw, {**base, "run_id": f"{stamp}-{i.name}-t{t}",
                                                    "threads": t}) for i in impls]
        append_rows(sweep_dir / "runs.csv", new)
        print_table(new)
        rows += new
    print(f"appended {len(rows)} rows to {sweep_dir / 'runs.csv'}")
    return rows


def impl_row(i: Impl, ts: Optional[List[float]], bw: Dict[str, float], base: dict) -> dict:
    row = {**base, "impl": i.name, "bytes_per_param": i.bytes_per_param, "build_s": i.build_s,
           "stream_copy_gbs": round(bw["stream-copy"], 2),
           "stream_triad_gbs": round(bw["stream-triad"], 2)}
    if not ts:
        return {**row, "status": "skipped", "error": i.error}
    med = statistics.median(ts)
    gbs = i.bytes_per_param * row["params"] / med / 1e9
    return {**row, "status": "ok", "median_s": round(med, 5), "min_s": round(min(ts), 5),
            "max_s": round(max(ts), 5), "gparams_per_s": round(row["params"] / med / 1e9, 4),
            "gbytes_per_s": round(gbs, 2), "frac_of_copy": round(gbs / bw["stream-copy"], 3)}


def print_table(rows: List[dict]) -> None:
    dos = next((r for r in rows if r["impl"] == "dos" and r["status"] == "ok"), None)
    print(f"\nthreads={rows[0]['threads']}  params={rows[-1]['params']:,}  ({rows[0]['cpu_model']})")
    print(f"{'impl':<18}{'Gparam/s':>10}{'B/param':>9}{'GB/s':>8}{'of copy':>9}{'dos x':>7}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['impl']:<18}  skipped: {r['error']}")
            continue
        rate = r.get("gparams_per_s")
        ratio = f"{dos['gparams_per_s'] / rate:.2f}" if dos and rate else ""
        frac = f"{r['frac_of_copy']:.0%}" if r.get("frac_of_copy") else ""
        print(f"{r['impl']:<18}{rate or '':>10}{r['bytes_per_param']:>9}{r['gbytes_per_s']:>8}"
              f"{frac:>9}{ratio:>7}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1])
    ap.add_argument("--params", type=int, default=400_000_000)
    ap.add_argument("--sweep", required=True, help="rows go to <out>/<sweep>/runs.csv")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch-id", default="", help="the rows' batch_id (default: $BATCH_ID)")
    ap.add_argument("--impls", nargs="+", default=None, choices=IMPL_NAMES,
                    help="only these implementations (default: all)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results root (default: $OUT if set, else experiments/results)")
    a = ap.parse_args(argv)
    out = a.out or Path(os.environ.get("OUT") or Path(__file__).resolve().parents[3] / "experiments" / "results")
    run(a.threads, a.params, a.sweep, a.reps, out, a.impls, a.batch_id)


if __name__ == "__main__":
    main()
