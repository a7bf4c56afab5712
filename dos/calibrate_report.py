"""PURE: what `python -m dos calibrate` reports about a profile: its text table and the warnings a
profile earns (a median non-monotone in the thread count, repeats that spread more than NOISY).
Split from dos/calibrate.py, which measures; `calibrate.table` etc. stay importable there."""
from __future__ import annotations

import statistics
from typing import List, Sequence

from .perfmodel import Calibration

NOISY = 0.10  # a point whose repeats spread more than this (of the median) is reported noisy
# A median that moves the wrong way by less than this (of the lower thread count's median) is not
# reported non-monotone, whatever the points' spread: the H100 profile of session 24 warned three
# times for D2H beside CPU AdamW rising 1% a step (51.4 -> 53.2 G/s), within any start-to-start
# variation of these rates (CPU AdamW at 16 threads 3.9-5.3 G/s between starts, docs/DESIGN.md §10).
MONOTONE_TOL = 0.03


def spread_of(xs: Sequence[float]) -> float:
    """(max - min) / median of repeated measurements (0: one measurement, or all equal)."""
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if len(xs) > 1 and m > 0 else 0.0


def profile_warnings(name: str, threads: Sequence[int], samples: Sequence[Sequence[float]],
                     rising: bool = True, noisy: float = NOISY, tol: float = MONOTONE_TOL) -> List[str]:
    """What looks wrong in a profile against the thread count: a median that falls where it should
    rise (`rising`; or rises where it should fall) by more than the two points' own spread and
    `tol` (both of the lower thread count's median), and points whose repeats spread more than
    `noisy`."""
    out = []
    med = [statistics.median(xs) for xs in samples]
    for i in range(1, len(threads)):
        a, b = med[i - 1], med[i]
        wrong = (a - b) if rising else (b - a)
        if wrong > a * max(tol, spread_of(samples[i - 1]), spread_of(samples[i])):
            out.append(f"{name}: non-monotone in threads, {threads[i]} threads {b / 1e9:.2f} G/s "
                       f"{'below' if rising else 'above'} {threads[i - 1]} threads {a / 1e9:.2f} G/s")
    for t, xs in zip(threads, samples):
        sp = spread_of(xs)
        if sp > noisy:
            out.append(f"{name}: noisy at {t} threads, spread {100 * sp:.0f}% "
                       f"(min {min(xs) / 1e9:.2f}, median {statistics.median(xs) / 1e9:.2f} G/s)")
    return out


def table(c: Calibration) -> str:
    """The profile as a text table (rates in G elements/s, bandwidths in GB/s)."""
    def g(x, scale=1e9):
        return f"{x / scale:8.2f}" if x is not None else "       -"

    def col(values, i):
        return values[i] if values is not None else None

    lines = [f"dos calibration ({c.source}, {c.created or 'undated'}): GPU {c.gpu_name or 'none'} | "
             f"CPU {c.cpu_model} ({c.host_cores} cores) | torch {c.torch_version} | {c.cpu_impl}",
             "threads  CPU AdamW G/s   +DMA G/s   H2D GB/s (CPU running)   D2H GB/s (CPU running)"]
    for i, t in enumerate(c.cpu_threads):
        lines.append(f"{t:7d}  {g(c.cpu_rate[i])}       {g(col(c.cpu_rate_dma, i))}   "
                     f"{g(col(c.h2d_bw_cpu, i))}                 {g(col(c.d2h_bw_cpu, i))}")
    if c.cpu_rate_spread is not None:
        lines.append("spread (max-min)/median of CPU AdamW repeats: " + ", ".join(
            f"{t}: {100 * x:.0f}%" for t, x in zip(c.cpu_threads, c.cpu_rate_spread)))
    lines += [f"GPU AdamW      {g(c.gpu_rate)} G elements/s",
              f"pinned H2D     {g(c.h2d_bw)} GB/s alone {g(c.h2d_duplex_bw)} GB/s duplex",
              f"pinned D2H     {g(c.d2h_bw)} GB/s alone {g(c.d2h_duplex_bw)} GB/s duplex",
              f"host memory    {g(c.host_mem_bw)} GB/s peak combined traffic (CPU AdamW + copies)"]
    if c.local_ranks > 1:
        lines.append(f"local ranks    {c.local_ranks} sharing this host: " + (
            "each rate above is the slowest rank's, measured with all running at once"
            if c.per_rank else "derated from a 1-rank profile (not measured with them running)"))
        for r in c.per_rank or ():
            lines.append(f"  rank {r['rank']}: CPU AdamW G/s " + ", ".join(
                f"{t}: {x / 1e9:.2f}" for t, x in zip(c.cpu_threads, r["cpu_rate"]))
                + "".join(f" | {name} {r[name] / 1e9:.1f}" for name in ("h2d_duplex_bw", "d2h_duplex_bw")
                          if r.get(name) is not None))
    lines += [f"WARNING {w}" for w in c.warnings]
    return "\n".join(lines)
