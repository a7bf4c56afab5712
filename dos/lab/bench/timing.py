"""The one timing protocol of every system: warm-up, synchronize, measure, report medians.

Each step is forward, backward and optimizer step, each bracketed by a device synchronization
(CUDA; nothing on the CPU) and stamped on one clock, `time.perf_counter() - t0`, which the NVML
sampler uses too. Every step is kept (phase markers); the row gets medians over measured steps.

Per phase a step also records where the host was (steps.csv only, not the row): `*_issue_s`,
from the phase's start until its calls returned, before the synchronization (near the phase's
time: the host issued the GPU's work no faster than the GPU ran it, a host-bound phase; well
below it: the GPU was the bound), the main thread's CPU time over that span (`*_cpu_s`; below
`*_issue_s`: the thread waited, descheduled or blocked), its involuntary context switches
(`*_nivcsw`) and the garbage collector's pauses (`*_gc_s`). Why: forward + backward of one plan
varied 0.19-0.47 s between the steps of one run (planner-deep-3.5b, docs/DESIGN.md decision
log), and the rows could not tell a slow GPU from a slow host.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch


class Clock:
    """Seconds since the run started, on `time.perf_counter()`; markers are (phase, step, start, end).
    Started by a sweep (DOS_SWEEP_PID), it also prints a line as each setup phase and each step
    begins (stderr, the run's log.txt): a run killed in flight then shows where it was."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.markers: list = []
        self.progress = bool(os.environ.get("DOS_SWEEP_PID"))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def say(self, what: str, at: float) -> None:
        if self.progress:
            print(f"[{at:8.2f} s] {what}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def phase(self, name: str, step: Optional[int] = None):
        start = self.now()
        self.say(name, start)
        try:
            yield
        finally:
            self.markers.append((name, step, start, self.now()))


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


@dataclass
class StepTime:
    step: int
    measured: bool
    start_s: float
    fwd_s: float
    bwd_s: float
    step_s: float
    iter_s: float
    loss: float
    fwd_issue_s: float = math.nan
    bwd_issue_s: float = math.nan
    step_issue_s: float = math.nan
    fwd_cpu_s: float = math.nan
    bwd_cpu_s: float = math.nan
    step_cpu_s: float = math.nan
    fwd_nivcsw: int = -1
    bwd_nivcsw: int = -1
    step_nivcsw: int = -1
    fwd_gc_s: float = math.nan
    bwd_gc_s: float = math.nan
    step_gc_s: float = math.nan


class _HostProbe:
    """The host side of one phase (module docstring): started at the phase's start, `issued()`
    right before its synchronization; `gc_s` sums the collector's pauses (gc.callbacks) since."""

    FIELDS = ("issue_s", "cpu_s", "nivcsw", "gc_s")  # issued()'s, as StepTime's `<phase>_<field>`
    _who = getattr(resource, "RUSAGE_THREAD", None)  # Linux: this thread's counters only

    def __init__(self):
        self.gc_s, self._gc_t0 = 0.0, None
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gc_s += time.perf_counter() - self._gc_t0
            self._gc_t0 = None

    def _nivcsw(self) -> int:
        return -1 if self._who is None else resource.getrusage(self._who).ru_nivcsw

    def start(self, now: float) -> None:
        self._t, self._cpu, self._sw, self._gc = now, time.thread_time(), self._nivcsw(), self.gc_s

    def issued(self, now: float) -> tuple:
        """(issue_s, cpu_s, nivcsw, gc_s) of the phase started last."""
        sw = self._nivcsw()
        return (now - self._t, time.thread_time() - self._cpu, -1 if sw < 0 else sw - self._sw,
                self.gc_s - self._gc)


def run_steps(system, batches: List[torch.Tensor], warmup: int, steps: int, device: torch.device,
              clock: Clock, after_step: Optional[Callable[[int], None]] = None) -> List[StepTime]:
    """Run `warmup + steps` training steps of `system` (forward/backward/step callables)."""
    sync = synchronizer(device)
    probe = _HostProbe()
    out = []
    try:
        for i in range(warmup + steps):
            batch = batches[i % len(batches)].to(device, non_blocking=True)
            sync()
            clock.say(f"step {i}", clock.now())  # outside the timed span
            t0 = clock.now()
            probe.start(t0)
            loss = system.forward(batch)
            host = [probe.issued(clock.now())]
            sync()
            t1 = clock.now()
            probe.start(t1)
            system.backward(loss)
            host.append(probe.issued(clock.now()))
            sync()
            t2 = clock.now()
            probe.start(t2)
            system.step()
            host.append(probe.issued(clock.now()))
            sync()
            t3 = clock.now()
            for name, a, b in (("fwd", t0, t1), ("bwd", t1, t2), ("step", t2, t3)):
                clock.markers.append((name, i, a, b))
            out.append(StepTime(i, i >= warmup, t0, t1 - t0, t2 - t1, t3 - t2, t3 - t0,
                                float(loss.detach().float().item()),
                                **{f"{ph}_{name}": v for ph, h in zip(("fwd", "bwd", "step"), host)
                                   for name, v in zip(_HostProbe.FIELDS, h)}))
            if after_step is not None:
                after_step(i)
    finally:
        probe.close()
    return out


def summarize(times: List[StepTime], tokens_per_step: int) -> dict:
    """Medians over measured steps (and the spread of the iteration time); losses of first/last step."""
    m = [t for t in times if t.measured]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    iters = [t.iter_s for t in m]
    return {
        "iter_s": med(iters), "fwd_s": med([t.fwd_s for t in m]), "bwd_s": med([t.bwd_s for t in m]),
        "step_s": med([t.step_s for t in m]), "iter_s_min": min(iters), "iter_s_max": max(iters),
        "tokens_per_s": tokens_per_step / med(iters),
        "loss_first": times[0].loss, "loss_last": times[-1].loss,
    }


def step_rows(times: List[StepTime]) -> List[dict]:
    return [asdict(t) for t in times]
