"""The CPU lane's weight uploads, issued from a helper thread.

In `step()` the CPU lane's thread is the CPU kernel's OpenMP master: while it issues a subgroup's
upload (`copy_` of its new weights to the GPU, non-blocking) the kernel's other threads wait for
the next subgroup. On an H100 machine's host (session 34) that call took 120-140 us of host time
per 50M-element subgroup beside the running kernel (experiments/results/lane-memory; alone
14-23 us, experiments/results/copy-call, session 35; docs/DESIGN.md decision log 2026-12-07). `UploadThread.submit(fn)` runs `fn` (the upload stage:
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
build), so the helper's copy call overlaps the next update's Python and kernel. Opt-in
(DOS_UPLOAD_THREAD=1, `enabled`): on the GPU it was correct and no faster (below); otherwise every
upload is issued on the calling thread.
"""
from __future__ import annotations

import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional

import torch


def enabled(device: torch.device) -> bool:
    """Whether the CPU lane's uploads to `device` go through the helper thread: only with
    DOS_UPLOAD_THREAD=1 (also on a CPU device, where the CPU tests run the threaded path).
    Measured on an H100 machine (session 35, experiments/scripts/upload_thread_gate.sh, batch
    20261207T1431Z-s35-upload-thread-ab; docs/DESIGN.md decision log 2026-12-07): the race tests
    with it passed (50), but the all-CPU step was no shorter, fp32 0.2255 s against 0.2248 inline,
    bf16-split 0.1680 against 0.1681 (1.0 B parameters, 3 rounds); the copy call itself took
    14-23 us there, not the ~130 us seen beside the kernel in session 34. So it stays off."""
    env = os.environ.get("DOS_UPLOAD_THREAD", "")
    if env in ("", "0", "1"):
        return env == "1"
    raise ValueError(f"DOS_UPLOAD_THREAD must be 0 or 1, got {env!r}")


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
