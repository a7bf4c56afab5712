"""Measures this machine's `perfmodel.Calibration` and caches it, keyed by GPU, CPU and torch.

- CPU AdamW (`dos.adam.cpu_adamw_`: bf16 grad in, fp32 state in place, weights out over the grad)
  against the thread count, on a host arena laid out as the engine's, subgroup by subgroup.
- GPU fused AdamW (`dos.adam.device_adamw_`, bf16 grad widened, bf16 weights out).
- Pinned H2D and D2H alone and in duplex: copies enqueued up front on their own streams, timed per
  copy with CUDA events (the host's GIL and launch jitter cannot distort them).
- Contention: CPU AdamW in this thread while a long chain of duplex copies, enqueued up front,
  runs; the Adam rate counts only subgroups inside the copies' window, the copy rates only copies
  inside the Adam window.
Without CUDA only the CPU rates are measured; the rest is None. `python -m dos.calibrate --help`.

Under torch.distributed with several ranks on this host (`torchrun --nproc-per-node N -m dos
calibrate`, or `measure()` called on every rank) every rank measures at once, each on its share of
the cores, every measured point started together (a barrier), so each sees the DRAM, PCIe and
cores it will get in training; the host's profile (`hostshare.combine`: the slowest rank's rates,
each rank's kept) is cached under a key with the rank count, by the host's first rank.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from . import adam, hostshare
from .calibrate_report import profile_warnings, spread_of, table  # noqa: F401  (calibrate.table: API)
from .buffers import HostArena, arena_blocks, available_host_bytes
from .partition import partition
from .perfmodel import Calibration, host_traffic_peak, machine_key

MI = 2**20
DEVICE, PIN = "cuda", True  # tests run the GPU path on the CPU with a fake torch.cuda
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is."""

    cpu_numel: int
    """Elements of the CPU AdamW problem (host arena: 14 B/element)."""
    subgroup_numel: int
    """Elements per CPU AdamW call (and per GPU AdamW call)."""
    gpu_numel: int
    """Elements of the GPU AdamW problem (16 B/element + a subgroup of scratch)."""
    copy_bytes: int
    """Bytes per pinned copy."""
    copies: int
    """Copies per direction in the alone and duplex measurements."""
    min_s: float
    """Seconds each CPU AdamW measurement runs at least."""


def default_sizes(quick: bool = False) -> Sizes:
    """~256 Mi elements on a large host (H200: 3.5 GiB arena), less where memory is short."""
    if quick:
        return Sizes(cpu_numel=4 * MI, subgroup_numel=MI, gpu_numel=16 * MI, copy_bytes=16 * MI,
                     copies=4, min_s=0.05)
    avail, _ = available_host_bytes()
    sg = 32 * MI
    n = min(256 * MI, int(avail * 0.2) // 14)
    if n < 4 * sg:
        sg = max(MI, n // 4 // MI * MI)
    return Sizes(cpu_numel=max(sg, n // sg * sg), subgroup_numel=sg, gpu_numel=256 * MI,
                 copy_bytes=256 * MI, copies=8, min_s=0.15)


def default_threads(cores: int) -> List[int]:
    """1, 2, 4, ... up to the cores, 3/4 of them, and all of them."""
    out = {1, cores} | {2**i for i in range(1, 12) if 2**i <= cores}
    if cores >= 8:
        out.add(cores * 3 // 4)
    return sorted(out)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> Optional[str]:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


# -- cache -------------------------------------------------------------------------------------

def cache_dir() -> Path:
    root = os.environ.get("DOS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dos")
    return Path(root) / "calibration"


def cache_path(local_ranks: int = 1) -> Path:
    return cache_dir() / f"{machine_key(gpu_name(), cpu_model(), torch.__version__, local_ranks)}.json"


def _read(path: Path) -> Optional[Calibration]:
    try:
        return Calibration.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        return None


def load_or_none(local_ranks: int = 1) -> Optional[Calibration]:
    """The cached Calibration of this machine (GPU, CPU model, torch version), or None. With
    several local ranks: the profile measured with that many running; failing that, the 1-rank
    profile derated for them (`hostshare.derate`, source 'derated'); a profile of another rank
    count is never used."""
    calib = _read(cache_path(local_ranks))
    if local_ranks <= 1 or calib is not None:
        return calib if calib is None or calib.local_ranks == local_ranks else None
    one = _read(cache_path(1))
    return hostshare.derate(one, local_ranks, cores()) if one is not None and one.local_ranks == 1 else None


def save(calib: Calibration, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(calib.to_json())
    os.replace(tmp, path)  # atomic: a reader sees the old profile or the new one
    return path


# -- CPU AdamW ---------------------------------------------------------------------------------

class CpuProblem:
    """Host state laid out as the engine's arena, updated subgroup by subgroup."""

    def __init__(self, numel: int, subgroup_numel: int):
        self.layout = partition([[(numel, "torch.bfloat16")]], subgroup_numel)
        blocks, nbytes = arena_blocks(self.layout, ["cpu"] * len(self.layout.subgroups), [2])
        self.arena = HostArena(blocks, nbytes, {s: torch.bfloat16 for s in blocks}, pin=False)
        for g in self.arena.grad.values():
            g.fill_(1e-3)
        self.next = 0
        self.fallback = adam.cpu_impl() == "torch-fused"

    def update(self, threads: int) -> Tuple[int, float, float]:
        """One subgroup's AdamW -> (elements, start, end) on the host clock."""
        s = self.layout.subgroups[self.next]
        self.next = (self.next + 1) % len(self.layout.subgroups)
        master, m, v = self.arena.fmt.views(self.arena.state[s.index], s.numel)[:3]
        g = self.arena.grad[s.index]
        t0 = time.perf_counter()
        adam.cpu_adamw_(master, m, v, g, g, step=1, grad_scale=1.0, threads=threads, **HYPER)
        return s.numel, t0, time.perf_counter()

    def run(self, threads: int, min_s: float) -> List[Tuple[int, float, float]]:
        """Subgroups until `min_s` seconds passed (at least one)."""
        old = torch.get_num_threads()
        if self.fallback:  # torch's kernel ignores `threads`: its pool size is process-wide
            torch.set_num_threads(threads)
        try:
            spans, t0 = [], time.perf_counter()
            while not spans or time.perf_counter() - t0 < min_s:
                spans.append(self.update(threads))
            return spans
        finally:
            torch.set_num_threads(old)

    def warm_up(self, threads: int) -> None:
        """Touch every page once (first-touch faults are not the rate)."""
        for _ in self.layout.subgroups:
            self.update(threads)

    def close(self) -> None:
        self.arena.close()


def rate(spans: Sequence[Tuple[int, float, float]]) -> float:
    return sum(n for n, _, _ in spans) / max(1e-9, sum(b - a for _, a, b in spans))


REPEATS = 3  # each point of the profile is measured this many times; the median is kept


def cpu_rates(prob: CpuProblem, threads: Sequence[int], min_s: float, repeats: int = REPEATS) -> List[float]:
    return [statistics.median(xs) for xs in cpu_samples(prob, threads, min_s, repeats)]


def cpu_samples(prob: CpuProblem, threads: Sequence[int], min_s: float,
                repeats: int = REPEATS, sync=lambda: None) -> List[List[float]]:
    """CPU AdamW elements/s, `repeats` measurements per thread count, taken round-robin over the
    thread counts (a slow spell of the machine then hits every count, not one); `sync()` before
    each (the local ranks' barrier)."""
    out: List[List[float]] = [[] for _ in threads]
    for _ in range(repeats):
        for i, t in enumerate(threads):
            sync()
            out[i].append(rate(prob.run(t, min_s)))
    return out


# -- GPU: AdamW and copies ---------------------------------------------------------------------

def gpu_adam_rate(numel: int, subgroup_numel: int, passes: int = 5) -> float:
    dev = torch.device(DEVICE)
    numel = min(numel, torch.cuda.mem_get_info()[0] // 64)  # 20 B/element: leave most of it free
    sg = min(numel, subgroup_numel)
    n = numel // sg * sg
    state = torch.zeros(3 * n, device=dev)
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16, device=dev)
    param = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    scratch = torch.empty(sg, device=dev)
    step_t = torch.ones((), device=dev)

    def one_pass():
        for lo in range(0, n, sg):
            master, m, v = (state[i * n + lo: i * n + lo + sg] for i in range(3))
            adam.device_adamw_(master, m, v, grad[lo: lo + sg], param[lo: lo + sg], step_t=step_t,
                               scale_t=None, scratch=scratch, **HYPER)

    one_pass()  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(passes):
        one_pass()
    end.record()
    end.synchronize()
    return passes * n / (start.elapsed_time(end) / 1e3)


class Copies:
    """Pinned host and device buffers, one stream per direction, per-copy CUDA events."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.host_src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=PIN)
        self.host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=PIN)
        self.dev_dst = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
        self.dev_src = torch.ones(nbytes, dtype=torch.uint8, device=DEVICE)
        self.streams = {"h2d": torch.cuda.Stream(), "d2h": torch.cuda.Stream()}

    def chain(self, direction: str, n: int, gate=None) -> List[torch.cuda.Event]:
        """Enqueue n copies in `direction` (after `gate`); events before, between and after."""
        stream = self.streams[direction]
        dst, src = (self.dev_dst, self.host_src) if direction == "h2d" else (self.host_dst, self.dev_src)
        with torch.cuda.stream(stream):
            if gate is not None:
                stream.wait_event(gate)
            events = [torch.cuda.Event(enable_timing=True)]
            events[0].record()
            for _ in range(n):
                dst.copy_(src, non_blocking=True)
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
        return events

    @staticmethod
    def gate(seconds: float = 2e-3) -> torch.cuda.Event:
        """An event that fires after a GPU spin: chains behind it start together, enqueued up front."""
        torch.cuda._sleep(int(seconds * 2e9))
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev


def spans_of(events: List[torch.cuda.Event], ref: torch.cuda.Event, t_ref: float) -> List[Tuple[float, float]]:
    """Per-copy (start, end) on the host clock (ref happened at host time t_ref)."""
    ts = [t_ref + ref.elapsed_time(e) / 1e3 for e in events]
    return list(zip(ts, ts[1:]))


def bandwidth(nbytes: int, spans, lo: float = -math.inf, hi: float = math.inf) -> Optional[float]:
    """Bytes/s over the copies that lie inside [lo, hi]."""
    inside = [(a, b) for a, b in spans if a >= lo and b <= hi]
    if not inside:
        return None
    return len(inside) * nbytes / sum(b - a for a, b in inside)


def copy_rates(cp: Copies, copies: int, sync=lambda: None) -> dict:
    """Alone and duplex bandwidth of each direction (`sync()` before each measurement)."""
    out = {}
    for d in ("h2d", "d2h"):
        sync()
        ev = cp.chain(d, copies, cp.gate())
        torch.cuda.synchronize()
        out[f"{d}_bw"] = bandwidth(cp.nbytes, spans_of(ev, ev[0], 0.0))
    sync()
    gate = cp.gate()
    ev = {d: cp.chain(d, copies, gate) for d in ("h2d", "d2h")}
    torch.cuda.synchronize()
    spans = {d: spans_of(e, ev["h2d"][0], 0.0) for d, e in ev.items()}
    lo = max(s[0][0] for s in spans.values())
    hi = min(s[-1][1] for s in spans.values())
    for d in ("h2d", "d2h"):  # copies of the window both directions ran in (all, if none fit)
        out[f"{d}_duplex_bw"] = bandwidth(cp.nbytes, spans[d], lo, hi) or bandwidth(cp.nbytes, spans[d])
    return out


def contended(prob: CpuProblem, cp: Copies, threads: int, min_s: float, copy_bw: float,
              alone_rate: float) -> Tuple[float, float, float]:
    """(CPU AdamW elements/s, H2D bytes/s, D2H bytes/s) while both run at once. `copy_bw`: the
    faster direction's duplex bytes/s, `alone_rate`: CPU AdamW's (size the copy chain to outlast
    the CPU work, however much the two slow each other down)."""
    sg_s = prob.layout.subgroup_numel / alone_rate
    n = math.ceil(2.0 * (min_s + 2 * sg_s) * copy_bw / cp.nbytes) + 2
    ref = torch.cuda.Event(enable_timing=True)
    ref.record(cp.streams["h2d"])
    ref.synchronize()
    t_ref = time.perf_counter()
    ev = {d: cp.chain(d, n) for d in ("h2d", "d2h")}
    work = prob.run(threads, min_s)
    torch.cuda.synchronize()
    spans = {d: spans_of(e, ref, t_ref) for d, e in ev.items()}
    lo = max(s[0][0] for s in spans.values())
    hi = min(s[-1][1] for s in spans.values())
    inside = [w for w in work if w[1] >= lo and w[2] <= hi] or work
    a0, a1 = work[0][1], work[-1][2]
    bws = [bandwidth(cp.nbytes, spans[d], a0, a1) or bandwidth(cp.nbytes, spans[d]) for d in ("h2d", "d2h")]
    return rate(inside), bws[0], bws[1]


# -- the whole measurement ---------------------------------------------------------------------

def measure(sizes: Optional[Sizes] = None, threads: Optional[Sequence[int]] = None,
            gpu: Optional[bool] = None, log=print, peers: Optional[hostshare.Peers] = None) -> Calibration:
    """Measure this machine (GPU parts only where CUDA is available and `gpu` is not False).

    `peers` (default: `hostshare.Peers.current()`, a collective under torch.distributed): with
    several ranks on this host every rank calls this at once; each measures on its share of the
    cores (default threads up to cores // ranks), every point after a barrier, and all return the
    host's combined profile (`hostshare.combine`, local_ranks = the ranks). Logs: the host's
    first rank only."""
    peers = peers if peers is not None else hostshare.Peers.current()
    if peers.n > 1:
        calib = _measure(sizes, threads, gpu, log if peers.leader else (lambda *_: None),
                         peers, max(1, cores() // peers.n))
        mine = peers.gather_local(calib.to_json())
        return hostshare.combine([Calibration.from_json(x) for x in mine], peers.local)
    return _measure(sizes, threads, gpu, log, peers, cores())


def _measure(sizes, threads, gpu, log, peers: hostshare.Peers, share: int) -> Calibration:
    """One process's measurement (`peers.barrier()` before each point; `share`: its cores)."""
    sizes = sizes or default_sizes()
    threads = sorted(set(threads or default_threads(share)))
    gpu = torch.cuda.is_available() if gpu is None else gpu
    sync = peers.barrier
    t0 = time.perf_counter()
    prob = CpuProblem(sizes.cpu_numel, sizes.subgroup_numel)
    try:
        prob.warm_up(max(threads))
        log(f"calibrate: CPU AdamW over {sizes.cpu_numel / 1e6:.0f}M elements, threads {threads}"
            + (f", on each of {peers.n} local ranks at once" if peers.n > 1 else ""))
        samples = cpu_samples(prob, threads, sizes.min_s, sync=sync)
        cpu = [statistics.median(xs) for xs in samples]
        kw = dict(cpu_rate_spread=tuple(round(spread_of(xs), 4) for xs in samples))
        warn = profile_warnings("CPU AdamW", threads, samples)
        for t, xs in zip(threads, samples):
            log(f"calibrate: CPU AdamW {t:3d} threads  min {min(xs) / 1e9:.2f}  median "
                f"{statistics.median(xs) / 1e9:.2f} G/s  spread {100 * spread_of(xs):.0f}% ({len(xs)} runs)")
        if gpu:
            log(f"calibrate: GPU AdamW, pinned copies of {sizes.copy_bytes / MI:.0f} MiB, contention")
            sync()
            kw["gpu_rate"] = gpu_adam_rate(sizes.gpu_numel, sizes.subgroup_numel)
            cp = Copies(sizes.copy_bytes)
            kw.update(copy_rates(cp, sizes.copies, sync))
            bw = max(kw["h2d_duplex_bw"], kw["d2h_duplex_bw"])
            reps = [[sync() or contended(prob, cp, t, sizes.min_s, bw, r) for t, r in zip(threads, cpu)]
                    for _ in range(REPEATS)]  # round-robin over the thread counts
            cols = [[[rep[i][j] for rep in reps] for i in range(len(threads))] for j in range(3)]
            rows = [tuple(statistics.median(cols[j][i]) for j in range(3)) for i in range(len(threads))]
            for t, i in zip(threads, range(len(threads))):
                log(f"calibrate: beside DMA {t:3d} threads  CPU min/median {min(cols[0][i]) / 1e9:.2f}/"
                    f"{statistics.median(cols[0][i]) / 1e9:.2f} G/s  H2D {min(cols[1][i]) / 1e9:.1f}/"
                    f"{statistics.median(cols[1][i]) / 1e9:.1f}  D2H {min(cols[2][i]) / 1e9:.1f}/"
                    f"{statistics.median(cols[2][i]) / 1e9:.1f} GB/s")
            warn += profile_warnings("CPU AdamW + DMA", threads, cols[0])
            warn += profile_warnings("H2D beside CPU AdamW", threads, cols[1], rising=False)
            warn += profile_warnings("D2H beside CPU AdamW", threads, cols[2], rising=False)
            # DMA never speeds the CPU up: a contended rate above the alone one is noise.
            kw.update(cpu_rate_dma=tuple(min(r[0], c) for r, c in zip(rows, cpu)),
                      h2d_bw_cpu=tuple(r[1] for r in rows), d2h_bw_cpu=tuple(r[2] for r in rows))
            del cp
        kw["warnings"] = tuple(warn)
        for w in warn:
            log(f"calibrate: WARNING {w}")
    finally:
        prob.close()
    log(f"calibrate: {time.perf_counter() - t0:.1f} s")
    calib = Calibration(
        cpu_threads=tuple(threads), cpu_rate=tuple(cpu), gpu_name=gpu_name() if gpu else None,
        cpu_model=cpu_model(), torch_version=torch.__version__, cpu_impl=adam.cpu_impl(),
        host_cores=cores(), created=datetime.datetime.now().isoformat(timespec="seconds"), **kw)
    # Host-memory traffic: the most the measurements above moved combined (docs/DESIGN.md §9.3).
    return dataclasses.replace(calib, host_mem_bw=host_traffic_peak(calib)) if gpu else calib


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dos calibrate",
                                description="measure this machine's update-phase rates (under a minute)")
    p.add_argument("--out", help="also write the profile (json) to this path")
    p.add_argument("--threads", help="CPU thread counts to measure, comma-separated (default: 1, 2, 4, "
                                     "..., 3/4 of the cores, all cores)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test; rates are rough)")
    p.add_argument("--cached", action="store_true", help="show the cached profile; measure only if none")
    return p


def _torchrun_group() -> bool:
    """Under torchrun with several ranks and no process group yet: start one (gloo: the
    calibration exchanges barriers and small objects only). True if started here."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo")
    return True


def main(argv=None) -> int:
    """`python -m dos calibrate`: measure, cache under ~/.cache/dos/calibration/, print the table.
    Under `torchrun --nproc-per-node N` every rank measures at once and the host's first rank
    caches and prints the N-rank profile (`--out`: rank 0 writes it)."""
    args = _parser().parse_args(argv)
    started = _torchrun_group()
    try:
        peers = hostshare.Peers.current()
        calib = load_or_none(peers.n) if args.cached else None
        if calib is not None and calib.source == "derated":
            calib = None  # --cached shows a measured profile: measure this rank count
        if args.cached and peers.n > 1:  # every rank measures, or none does
            calib = calib if all(peers.gather_local(calib is not None)) else None
        if calib is None:
            threads = [int(x) for x in args.threads.split(",")] if args.threads else None
            calib = measure(default_sizes(args.quick), threads, peers=peers)
            if not args.quick and peers.leader:  # a rough profile never replaces the cached one
                print(f"calibrate: cached {save(calib, cache_path(calib.local_ranks))}")
            peers.gather_local(None)  # every rank returns once the profile is cached
        if args.out and peers.rank == 0:
            print(f"calibrate: wrote {save(calib, Path(args.out))}")
        if peers.leader:
            print(table(calib))
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
