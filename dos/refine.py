"""PURE: online refinement of the performance model (dos/perfmodel.py) from measured steps: the
rates a measured update phase implies (`update`), whether they moved enough to search again
(`drift`), a better plan under them (`replan`), and the head start an overlapped backward gave the
CPU lane (`head_start`). The Planner calls these between steps (dos/planner.py)."""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from .perfmodel import Calibration, Prediction, choose, predict
from .plan import CPU, RESIDENT, STAGED, Plan


def drift(a: Calibration, b: Calibration) -> float:
    """Largest relative difference between the rates of two calibrations (0: the same)."""
    worst = 0.0
    for name in ("cpu_rate", "cpu_rate_dma", "h2d_bw_cpu", "d2h_bw_cpu", "gpu_rate", "h2d_bw",
                 "d2h_bw", "h2d_duplex_bw", "d2h_duplex_bw", "host_mem_bw"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            continue
        for u, v in zip(*((x, y) if isinstance(x, tuple) else ((x,), (y,)))):
            worst = max(worst, abs(v - u) / u)
    return worst


def head_start(window_s: float, done_numel: int, backlog: bool, calib: Optional[Calibration],
               cpu_threads: int) -> float:
    """The head start to plan with, from one overlapped backward: the window the CPU lane had
    (from its first update to `step()`), or, where it still had a backlog at `step()` (it did not
    keep up), the time its finished work takes at the calibrated rate, when that is shorter. A
    worker that did not keep up did less than rate x window: it also waits for each gradient's
    D2H and its queue, and shares the host with backward (docs/DESIGN.md §10). A worker that kept
    up did all it was given: the window is then what a plan with more CPU work could use."""
    if not backlog or calib is None:
        return window_s
    return min(window_s, done_numel / calib.cpu(max(1, cpu_threads - 1)))


def _ratio(predicted: float, measured: Optional[float], lo: float = 0.1, hi: float = 10.0) -> Optional[float]:
    if not measured or measured <= 0 or predicted <= 0:
        return None
    return min(hi, max(lo, predicted / measured))


def _scale(values, f: float):
    if values is None:
        return None
    return tuple(v * f for v in values) if isinstance(values, tuple) else values * f


def update(calib: Calibration, plan: Plan, lane_totals: Dict[str, float], *, alpha: float = 0.5,
           grad_bytes: int = 2, param_bytes: int = 2, split_cpu: bool = False) -> Calibration:
    """Online refinement: moves the rates a step `alpha` towards those a measured update phase
    implies (an exponential moving average of the implied rates).

    `lane_totals`: busy seconds per lane (`dos.trace.lane_totals`). Each lane's rate is scaled by
    (1 - alpha) + alpha * predicted / measured busy time, so a machine under foreign load converges
    geometrically. The CPU factor scales every thread count alike (a foreign load is assumed to
    slow them all), alone and under DMA; the H2D / D2H factors scale every rate of that direction.
    Uploads and the span are not used (too small / a mix of everything). The CPU lane's busy
    time is its whole work's, also where part of it ran during backward (overlap_backward).
    `split_cpu` (exploration, which runs plans with and without staged work): a step without staged
    work moves only the CPU rates alone, one with it only those under DMA (docs/DESIGN.md §9.6)."""
    pred = predict(plan, calib, grad_bytes=grad_bytes, param_bytes=param_bytes)
    kw = {}

    def factor(predicted, lane):
        r = _ratio(predicted, lane_totals.get(lane))
        return None if r is None else (1 - alpha) + alpha * r

    f = factor(pred.cpu_s, "cpu") if plan.numel(CPU) else None
    if f is not None and split_cpu and calib.cpu_rate_dma is not None:
        # A plan without staged work ran the CPU lane alone: it moves the alone rates; a plan with
        # it mostly beside the copies: the rates under DMA (never above the alone ones).
        if plan.staged_order:
            dma = _scale(calib.cpu_rate_dma, f)
            kw.update(cpu_rate_dma=tuple(min(d, a) for d, a in zip(dma, calib.cpu_rate)))
        else:
            alone = _scale(calib.cpu_rate, f)
            kw.update(cpu_rate=alone,
                      cpu_rate_dma=tuple(min(d, a) for d, a in zip(calib.cpu_rate_dma, alone)))
    elif f is not None:
        kw.update(cpu_rate=_scale(calib.cpu_rate, f), cpu_rate_dma=_scale(calib.cpu_rate_dma, f))
    if calib.has_gpu:
        f = factor(pred.gpu_s, "gpu") if plan.numel(STAGED) + plan.numel(RESIDENT) else None
        if f is not None:
            kw["gpu_rate"] = calib.gpu_rate * f
        for d in ("h2d", "d2h"):
            f = factor(getattr(pred, f"{d}_s"), d) if plan.staged_order else None
            if f is not None:
                kw.update({name: _scale(getattr(calib, name), f)
                           for name in (f"{d}_bw", f"{d}_duplex_bw", f"{d}_bw_cpu")})
    return dataclasses.replace(calib, source="refined", **kw) if kw else calib


def replan(plan: Plan, calib: Calibration, *, margin: float = 0.05, keep_memory: bool = True,
           **choose_kw) -> Optional[Tuple[Plan, Prediction]]:
    """A better plan when its predicted gain exceeds `margin`, else None. `keep_memory`: keep the
    resident subgroups and slots (re-planning moves only CPU/staged lanes and threads; no GPU
    allocation changes; pass `staging_slots` when more slots are allocated than the plan uses).
    `choose_kw`: as `choose` (free_gpu_bytes, max_threads, ...)."""
    current = predict(plan, calib, grad_bytes=choose_kw.get("grad_bytes", 2),
                      param_bytes=choose_kw.get("param_bytes", 2),
                      head_start_s=choose_kw.get("head_start_s", 0.0))
    if keep_memory:
        r = len(plan.resident)
        if r and plan.resident != tuple(range(r)):
            raise ValueError("keep_memory needs the resident subgroups to be the first ones")
        # `staging_slots` in choose_kw: the slots allocated (may exceed what this plan uses).
        choose_kw.update(resident=r, staging_slots=choose_kw.get("staging_slots", plan.staging_slots),
                         free_gpu_bytes=float("inf"))
        # Online, the search runs in the step: only the current thread count and the most, and
        # only with every allocated slot (what a full search costs: docs/DESIGN.md §10).
        choose_kw.setdefault("threads", [plan.cpu_threads])
        choose_kw.setdefault("exact_slots", True)
    choose_kw.setdefault("state_dtype", plan.state_dtype)
    new, pred = choose(plan.numels, calib, placement=plan.placement, **choose_kw)
    if current.total_s > (1 + margin) * pred.total_s:
        return new, pred
    return None
