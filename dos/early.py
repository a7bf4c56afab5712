"""Updates overlapped with backward (`overlap_backward=True`): the CPU lane starts during backward.

The gradient router calls `submit(s)` once a CPU-lane subgroup's gradient is final and its D2H has
been issued; a worker thread waits for that copy and updates the subgroup with the same code as
`step()` (`Lanes.cpu_update`: the state in place, the new weights over the host gradient, their
upload queued). By the end of backward part of the CPU lane is done; `step()` enqueues the GPU
lanes first, then drains the worker (its backlog overlaps them, as the CPU lane does) and runs the
CPU subgroups it was not given.

Why it is safe:
- a subgroup's weights are no longer read by this backward once every parameter in it has its
  final gradient (the post-accumulate hooks fired after the ops that read them were issued), so
  its new weights may be uploaded at once; the upload follows the gradient D2H, which follows
  the main-stream work issued up to the hook;
- one update per subgroup per step: a later backward before `step()` (gradient accumulation
  outside `opt.accumulate()`) raises in its first hook on such a subgroup, before its gradient
  changes under a running update;
- the hyperparameters are taken when the first update starts and `step()` checks they are still
  the step's (an lr set between backward and step() raises instead of being silently ignored).
"""
from __future__ import annotations

import queue
import threading
import time
import weakref
from typing import Callable, Optional, Sequence

import torch


class EarlyUpdates:
    """`update`, `hyper`: bound methods, held weakly (the worker thread must not keep the
    optimizer, and its pinned memory, alive); `hyper(1)` gives the coming step's hyperparameters."""

    def __init__(self, update: Callable, hyper: Callable, device: torch.device):
        self._update_ref, self._hyper_ref = weakref.WeakMethod(update), weakref.WeakMethod(hyper)
        self._device = device
        self._q: "queue.Queue" = queue.Queue()
        self._started = set()  # subgroups submitted this step
        self.finished: list = []  # ... and updated, in order (appended by the worker)
        self.hyper: Optional[list] = None  # the hyperparameters this step's early updates use
        self.spans: list = []  # spans of the early CPU updates and their uploads (for the timeline)
        self.enabled = True  # False until the engine allows it (after gpu_fraction="auto" sizing)
        self.paused = 0  # > 0 inside `accumulate()`
        self._error: Optional[BaseException] = None
        self.first_submit = 0.0  # perf_counter() of this step's first early update
        self._thread = threading.Thread(target=self._loop, name="dos-overlap-backward", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            item = self._q.get()
            try:
                if item is None:
                    return
                s, hyper = item
                update = self._update_ref()
                if self._error is None and update is not None:  # after a failure: step() reports
                    update(s, hyper, self.spans, spare=1)  # one core left to backward's thread
                    self.finished.append(s)
            except BaseException as e:  # noqa: BLE001 - re-raised by drain() on the caller's thread
                self._error = e
            finally:
                self._q.task_done()

    # -- called from the gradient hooks (autograd's thread) -----------------------------------
    def guard(self, subgroups: Sequence[int]) -> None:
        """Before a gradient of these subgroups changes: none may have been updated this step."""
        for s in subgroups:
            if s in self._started:
                raise RuntimeError(
                    "dos: a second backward before step() changed gradients that an update "
                    "overlapped with the first backward has consumed (overlap_backward=True). With "
                    "gradient accumulation, run the non-final micro-batches' backward inside "
                    "`with opt.accumulate():`")

    def submit(self, s: int) -> None:
        """Subgroup s's gradient is final and on its way to the host: update it now."""
        if not self.enabled or self.paused:
            return
        if self.hyper is None:
            self.hyper = self._hyper_ref()(1)
            self.first_submit = time.perf_counter()  # the CPU lane's head start begins
        self._started.add(s)
        self._q.put((s, self.hyper))

    # -- called from step() -------------------------------------------------------------------
    def progress(self) -> tuple:
        """(subgroups updated so far, whether submitted ones are still waiting or running)."""
        done = list(self.finished)
        return done, len(done) < len(self._started)

    def drain(self) -> frozenset:
        """Wait for every submitted update; the subgroups done. Re-raises a worker's error."""
        self._q.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("dos: an update overlapped with backward failed") from err
        return frozenset(self._started)

    def take_spans(self) -> list:
        spans, self.spans = self.spans, []
        return spans

    def reset(self) -> None:
        """After the step: nothing is updated any more."""
        self._started, self.hyper, self.finished = set(), None, []

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()
