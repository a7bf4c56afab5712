"""The CPU lane's weight uploads, issued from a helper thread.

In `step()` the CPU lane's thread is the CPU kernel's OpenMP master: while it issues a subgroup's
upload (`copy_` of its new weights to the GPU, non-blocking) the kernel's other threads wait for
the next subgroup. On an H100 machine's host (session 34) that call took 120-140 us of host time
per 50M-element subgroup (experiments/results/lane-memory, docs/DESIGN.md decision log
2026-12-07): ~9 ms of a 3B all-CPU step. `UploadThread.submit(fn)` runs `fn` (the upload stage:
its stream waits, the copy, its event) on one helper thread, in submission order, and returns at
once; `join()` waits until every submitted one has run and re-raises the first error.

Invariants (why the hand-offs still hold, dos/lanes.py):
- an upload reads only its own subgroup's weights, written by that subgroup's update, which
  finished before `submit`; the next update (of another subgroup) writes other memory;
- `Lanes.run` joins before the main stream waits for the upload stream ("upload->forward"), so
  every upload is on that stream, in order, before the next forward can be enqueued;
- uploads whose events a later host action needs at once (the gradient ring's next D2H into the
  same slot; updates overlapped with backward) stay on the calling thread (`Lanes._cpu`).
`torch.Tensor.copy_` and the CPU kernel (`torch.ops.dos.*`) release the GIL (checked on the CPU
build), so the helper's copy call overlaps the next update's Python and kernel. On by default on
CUDA (`enabled`; DOS_UPLOAD_THREAD=0 issues every upload on the calling thread, as before).
"""
from __future__ import annotations

import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional

import torch


def enabled(device: torch.device) -> bool:
    """Whether the CPU lane's uploads to `device` go through the helper thread: on CUDA unless
    DOS_UPLOAD_THREAD=0; DOS_UPLOAD_THREAD=1 forces it (also on a CPU device, where the "upload"
    is a small memcpy and a hand-off costs more, ~30 us on the 2-core CI machine: the CPU tests
    run the threaded path so). Gated on the GPU race tests with the thread and its A/B
    (experiments/scripts/upload_thread_gate.sh; docs/DESIGN.md decision log 2026-12-07)."""
    env = os.environ.get("DOS_UPLOAD_THREAD", "")
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(f"DOS_UPLOAD_THREAD must be 0 or 1, got {env!r}")
    return device.type == "cuda"


class UploadThread:
    """One helper thread that issues uploads in submission order (created on first use). One
    caller thread submits and joins (`Lanes._cpu`)."""

    def __init__(self, device: torch.device):
        self._device = device
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: List[Future] = []

    def _start(self) -> ThreadPoolExecutor:
        device = self._device

        def init() -> None:  # the thread's current device (its streams are the device's)
            if device.type == "cuda":
                torch.cuda.set_device(device)

        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dos-upload", initializer=init)
        # the thread ends with its owner (it holds no reference to it: `submit` passes closures)
        weakref.finalize(self, pool.shutdown, wait=True)
        return pool

    def submit(self, fn: Callable[[], object]) -> None:
        if self._pool is None:
            self._pool = self._start()
        self._pending.append(self._pool.submit(fn))

    def join(self) -> None:
        """Wait for every submitted upload to have been issued; re-raise the first error."""
        pending, self._pending = self._pending, []
        first = None
        for f in pending:  # all of them, even after an error: nothing may still run afterwards
            err = f.exception()
            if err is not None and first is None:
                first = err
        if first is not None:
            raise RuntimeError("dos: issuing a CPU-lane upload failed") from first

    def close(self) -> None:
        self.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
