"""The one timing protocol of every system: warm-up, synchronize, measure, report medians.

Each step is forward, backward and optimizer step, each bracketed by a device synchronization
(CUDA; nothing on the CPU) and stamped on one clock, `time.perf_counter() - t0`, which the NVML
sampler uses too. Every step is kept (phase markers); the row gets medians over measured steps.
"""
from __future__ import annotations

import contextlib
import os
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


def run_steps(system, batches: List[torch.Tensor], warmup: int, steps: int, device: torch.device,
              clock: Clock, after_step: Optional[Callable[[int], None]] = None) -> List[StepTime]:
    """Run `warmup + steps` training steps of `system` (forward/backward/step callables)."""
    sync = synchronizer(device)
    out = []
    for i in range(warmup + steps):
        batch = batches[i % len(batches)].to(device, non_blocking=True)
        sync()
        clock.say(f"step {i}", clock.now())  # outside the timed span
        t0 = clock.now()
        loss = system.forward(batch)
        sync()
        t1 = clock.now()
        system.backward(loss)
        sync()
        t2 = clock.now()
        system.step()
        sync()
        t3 = clock.now()
        for name, a, b in (("fwd", t0, t1), ("bwd", t1, t2), ("step", t2, t3)):
            clock.markers.append((name, i, a, b))
        out.append(StepTime(i, i >= warmup, t0, t1 - t0, t2 - t1, t3 - t2, t3 - t0,
                            float(loss.detach().float().item())))
        if after_step is not None:
            after_step(i)
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
