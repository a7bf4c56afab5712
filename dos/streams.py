"""Streams and events: every hand-off between lanes goes through `wait` / `host_wait` with a name.

`CudaSync` runs each lane on its own CUDA stream. `HostSync` stands in for it when the parameters
live on the CPU: every "stream" is the calling thread, so work is ordered by program order and the
hand-offs are no-ops — the engine's code path is the same.

`DEBUG` exists for the race tests: a named hand-off can be skipped, and random delays can be
inserted on the side streams, so that a missing wait shows up as a wrong number.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Optional, Set

import torch

# The lanes' streams. "main" is the stream forward/backward run on (the current stream).
STREAMS = ("grad", "h2d", "compute", "d2h", "upload")


@dataclass
class Debug:
    skip: Set[str] = field(default_factory=set)
    """Names of hand-offs to drop (tests only: each must make the race test fail)."""
    delay_cycles: int = 0
    """Upper bound of a random GPU spin (torch.cuda._sleep) inserted before side-stream work."""
    streams: Optional[Set[str]] = None
    """Streams that get the spins (None: all)."""
    seed: int = 0
    rng: random.Random = field(default_factory=random.Random)


DEBUG = Debug()


class HostSync:
    """Synchronous stand-in: the parameters' device is the CPU."""

    is_async = False

    def __init__(self, timing: bool = False):
        self.timing = timing

    def on(self, name: str):
        return contextlib.nullcontext()

    def record(self, name: str = "main") -> Optional[object]:
        return None

    def wait(self, name: str, event, why: str) -> None:
        pass

    def host_wait(self, event, why: str) -> None:
        pass

    def delay(self, name: str) -> None:
        pass

    def synchronize(self) -> None:
        pass


class CudaSync:
    """One CUDA stream per lane; events order them; nothing here blocks the host unless asked."""

    is_async = True

    def __init__(self, device: torch.device, timing: bool = False):
        self.device = device
        self.timing = timing
        with torch.cuda.device(device):
            self.streams = {name: torch.cuda.Stream(device) for name in STREAMS}

    def stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device) if name == "main" else self.streams[name]

    def on(self, name: str):
        return torch.cuda.stream(self.stream(name))

    def record(self, name: str = "main") -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=self.timing)
        ev.record(self.stream(name))
        return ev

    def wait(self, name: str, event, why: str) -> None:
        """Stream `name` waits (on the GPU) until `event` has happened."""
        if event is None or why in DEBUG.skip:
            return
        self.stream(name).wait_event(event)

    def host_wait(self, event, why: str) -> None:
        """The calling thread blocks until `event` has happened."""
        if event is None or why in DEBUG.skip:
            return
        event.synchronize()

    def delay(self, name: str) -> None:
        """Tests only: a random spin on stream `name`, so that races surface."""
        if DEBUG.delay_cycles and (DEBUG.streams is None or name in DEBUG.streams):
            with self.on(name):
                torch.cuda._sleep(DEBUG.rng.randrange(DEBUG.delay_cycles))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def make_sync(device: torch.device, timing: bool = False):
    return CudaSync(device, timing) if device.type == "cuda" else HostSync(timing)
