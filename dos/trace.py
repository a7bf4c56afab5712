"""Per-subgroup lane timeline of one update phase: where the step's time goes.

GPU lanes are timed with CUDA events recorded on their streams (after the stream's waits, so a
span is the work itself); the CPU lane with the host clock.

Two uses:
- `trace=True`: the full timeline of every step (`last`), both clocks put together — the step's
  reference event is synchronized once and host times are taken relative to that moment.
- busy seconds per lane (`totals()`) for online re-planning: no synchronization at all; the
  previous step's spans are read at the next step, once their events have completed.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional, Sequence, Tuple


class Timeline:
    def __init__(self, sync, trace: bool, measure: bool = False):
        self.sync = sync
        self.trace = trace
        self.enabled = trace or measure  # spans are recorded
        self._spans: list = []  # (lane, subgroup, numel, start, end): events (GPU) or seconds (host)
        self._prev: list = []
        self._ref = None
        self._t0 = 0.0
        self.step = 0
        self.last: List[dict] = []

    def begin(self, step: int, earlier: list = ()) -> None:
        """Start a step's timeline; `earlier`: GPU spans recorded before it (gradient D2H)."""
        if not self.enabled:
            return
        self._prev, self._spans, self.step = self._spans, list(earlier), step
        if self.trace:
            self._ref = self.sync.record("main")
            self.sync.host_wait(self._ref, "trace")  # puts the two clocks together (tracing only)
            self._t0 = time.perf_counter()

    def add(self, spans: list) -> None:
        """Spans recorded elsewhere during this step (updates overlapped with backward)."""
        if self.enabled:
            self._spans.extend(spans)

    def gpu_start(self, stream: str) -> Optional[object]:
        return self.sync.record(stream) if self.enabled and self.sync.is_async else None

    @contextlib.contextmanager
    def stage(self, stream: str, after: Sequence[Tuple[object, str]] = (), lane: Optional[str] = None,
              subgroup: int = -1, numel: int = 0, sink: Optional[list] = None):
        """One hand-off stage on `stream`, the ritual every lane repeats: wait for each
        `(event, why)` in `after` (a named hand-off), the race tests' delay hook, switch to the
        stream, start the span, run the body, record the stage's event (`.event` of the yielded
        handle: what later stages wait for), end the span. The span goes to this step's timeline,
        or to `sink` (spans recorded outside a step: gradient D2H, updates during backward)."""
        sync = self.sync
        for event, why in after:
            sync.wait(stream, event, why)
        sync.delay(stream)
        handle = _Stage()
        with sync.on(stream):
            start = self.gpu_start(stream) if lane is not None else None
            yield handle
            handle.event = sync.record(stream)
            if start is not None:
                (self._spans if sink is None else sink).append((lane, subgroup, numel, start, handle.event))

    def host(self, lane: str, subgroup: int, numel: int, t_start: float, t_end: float) -> None:
        if self.enabled:
            self._spans.append((lane, subgroup, numel, t_start, t_end))

    def finish(self) -> None:
        """Tracing only: wait for the step and resolve its spans into `last`."""
        if not self.trace:
            return
        self.sync.synchronize()
        spans = []
        for lane, s, n, a, b in self._spans:
            if isinstance(a, float):
                t0, t1 = a - self._t0, b - self._t0
            else:
                t0, t1 = (self._ref.elapsed_time(a) / 1e3, self._ref.elapsed_time(b) / 1e3) \
                    if self._ref is not None else (0.0, 0.0)
            spans.append(dict(step=self.step, lane=lane, subgroup=s, numel=n, start_s=t0, end_s=t1))
        self.last = sorted(spans, key=lambda e: e["start_s"])

    def totals(self) -> Optional[Dict[str, float]]:
        """Busy seconds per lane of the previous step, or None while its GPU work is unfinished
        (never blocks)."""
        if not self._prev:
            return None
        out: Dict[str, float] = {}
        for lane, _, _, a, b in self._prev:
            if isinstance(a, float):
                dt = b - a
            elif b.query():
                dt = a.elapsed_time(b) / 1e3
            else:
                return None
            out[lane] = out.get(lane, 0.0) + dt
        return out


class _Stage:
    """What a stage leaves behind: the event recorded after its work (None on the CPU)."""

    event = None


def lane_totals(timeline: List[dict]) -> dict:
    """Busy seconds per lane and the span of the whole phase (from a `Timeline.last`)."""
    out: dict = {}
    for e in timeline:
        out[e["lane"]] = out.get(e["lane"], 0.0) + e["end_s"] - e["start_s"]
    if timeline:
        out["span"] = max(e["end_s"] for e in timeline) - min(0.0, min(e["start_s"] for e in timeline))
    return out
