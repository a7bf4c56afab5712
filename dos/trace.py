"""Per-subgroup lane timeline of one update phase: where the step's time goes.

GPU lanes are timed with CUDA events recorded on their streams (after the stream's waits, so a
span is the work itself); the CPU lane with the host clock. Both are put on one clock: the step's
reference event is synchronized once, and host times are taken relative to that moment.
"""
from __future__ import annotations

import time
from typing import List, Optional


class Timeline:
    """Collects spans during a step; `finish()` resolves them into dicts (one sync)."""

    def __init__(self, sync, enabled: bool):
        self.sync = sync
        self.enabled = enabled
        self._gpu: list = []
        self._host: list = []
        self._ref = None
        self._t0 = 0.0
        self.step = 0
        self.last: List[dict] = []

    def begin(self, step: int, earlier: list = ()) -> None:
        """Start a step's timeline; `earlier`: GPU spans recorded before it (gradient D2H)."""
        if not self.enabled:
            return
        self.step, self._gpu, self._host = step, list(earlier), []
        self._ref = self.sync.record("main")
        self.sync.host_wait(self._ref, "trace")  # puts the two clocks together (tracing only)
        self._t0 = time.perf_counter()

    def gpu_start(self, stream: str) -> Optional[object]:
        return self.sync.record(stream) if self.enabled and self.sync.is_async else None

    def gpu_end(self, start, stream: str, lane: str, subgroup: int, numel: int) -> None:
        if start is not None:
            self._gpu.append((lane, subgroup, numel, start, self.sync.record(stream)))

    def host(self, lane: str, subgroup: int, numel: int, t_start: float, t_end: float) -> None:
        if self.enabled:
            self._host.append((lane, subgroup, numel, t_start, t_end))

    def finish(self) -> None:
        if not self.enabled:
            return
        self.sync.synchronize()
        spans = []
        for lane, s, n, a, b in self._gpu:
            ms0 = self._ref.elapsed_time(a) if self._ref is not None else 0.0
            ms1 = self._ref.elapsed_time(b) if self._ref is not None else 0.0
            spans.append((lane, s, n, ms0 / 1e3, ms1 / 1e3))
        for lane, s, n, a, b in self._host:
            spans.append((lane, s, n, a - self._t0, b - self._t0))
        spans.sort(key=lambda x: x[3])
        self.last = [dict(step=self.step, lane=lane, subgroup=s, numel=n, start_s=a, end_s=b)
                     for lane, s, n, a, b in spans]


def lane_totals(timeline: List[dict]) -> dict:
    """Busy seconds per lane and the span of the whole phase (from a `Timeline.last`)."""
    out: dict = {}
    for e in timeline:
        out[e["lane"]] = out.get(e["lane"], 0.0) + e["end_s"] - e["start_s"]
    if timeline:
        out["span"] = max(e["end_s"] for e in timeline) - min(0.0, min(e["start_s"] for e in timeline))
    return out
