"""The CPU lane's driver: when a CPU subgroup's update runs, behind one interface.

- `InlineCpuLane`: every CPU subgroup is updated by `step()` (Lanes.run), after the GPU lanes are
  enqueued. Its hooks do nothing.
- `ThreadedCpuLane` (`overlap_backward=True`): the CPU lane starts during backward. The gradient
  router calls `submit(s)` once a CPU-lane subgroup's gradient is final and its D2H has been
  issued; a worker thread waits for that copy and updates the subgroup with the same code as
  `step()` (`Lanes.cpu_update`: the state in place, the new weights over the host gradient, their
  upload queued). By the end of backward part of the CPU lane is done; `step()` enqueues the GPU
  lanes first, then `drain()`s the worker (its backlog overlaps them) and runs the CPU subgroups
  it was not given.

Interface (both): `guard(subgroups)` / `submit(s)` from the gradient hooks; `check_hyper(hyper)`,
`progress()`, `started` (dos.params refuses changes to those), `drain()`, `take_spans()`, `after_step()` from the step; `paused()` (gradient
accumulation), `require_idle(what)` (zero_grad / state_dict between backward and step), `close()`.

Why the threaded lane is safe:
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

import contextlib
import queue
import threading
import time
import weakref
from typing import Callable, NamedTuple, Optional, Sequence

import torch


class Progress(NamedTuple):
    """Where a lane that started during backward stood when `step()` began."""

    window_s: float  # from its first update to now
    done: tuple  # subgroups it has updated
    backlog: bool  # submitted ones still waiting or running


class InlineCpuLane:
    """The CPU lane runs inside `step()`: nothing happens during backward."""

    starts_in_backward = False
    started = frozenset()  # CPU subgroups updated (or being updated) since the last step

    def guard(self, subgroups: Sequence[int]) -> None:
        pass

    def submit(self, s: int) -> None:
        pass

    def check_hyper(self, hyper: list) -> None:
        pass

    def progress(self) -> Optional[Progress]:
        return None

    def drain(self) -> frozenset:
        return frozenset()

    def take_spans(self) -> list:
        return []

    def after_step(self) -> None:
        pass

    @contextlib.contextmanager
    def paused(self):
        yield

    def require_idle(self, what: str) -> None:
        pass

    def close(self) -> None:
        pass


class ThreadedCpuLane:
    """`update`, `hyper`: bound methods, held weakly (the worker thread must not keep the
    optimizer, and its pinned memory, alive); `hyper(1)` gives the coming step's hyperparameters.
    `restart_counts`: the gradient router's, called when accumulation ends. `enabled`: False
    until the first step has sized the lanes (gpu_fraction="auto" may re-plan them)."""

    starts_in_backward = True

    def __init__(self, update: Callable, hyper: Callable, restart_counts: Callable,
                 device: torch.device, enabled: bool = True):
        self._update_ref, self._hyper_ref = weakref.WeakMethod(update), weakref.WeakMethod(hyper)
        self._restart_counts = restart_counts
        self._device = device
        self._q: "queue.Queue" = queue.Queue()
        self._started = set()  # subgroups submitted this step
        self.finished: list = []  # ... and updated, in order (appended by the worker)
        self.hyper: Optional[list] = None  # the hyperparameters this step's early updates use
        self.spans: list = []  # spans of the early CPU updates and their uploads (for the timeline)
        self.enabled = enabled
        self.paused_n = 0  # > 0 inside `paused()` (`opt.accumulate()`)
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
        if not self.enabled or self.paused_n:
            return
        if self.hyper is None:
            self.hyper = self._hyper_ref()(1)
            self.first_submit = time.perf_counter()  # the CPU lane's head start begins
        self._started.add(s)
        self._q.put((s, self.hyper))

    # -- called from step() -------------------------------------------------------------------
    @property
    def started(self) -> frozenset:
        """Subgroups submitted this step: their gradients and weights are consumed."""
        return frozenset(self._started)

    def check_hyper(self, hyper: list) -> None:
        """The step's hyperparameters must be those the early updates started with."""
        if self.hyper is not None and self.hyper != hyper:
            self.drain()  # nothing may still run when the error reaches the caller
            raise RuntimeError("dos: the hyperparameters changed between backward and step() "
                               "with overlap_backward=True (the CPU lane started during "
                               "backward with the old ones): set lr etc. before backward")

    def progress(self) -> Optional[Progress]:
        """Where the lane stands at `step()`'s start (None: it did not start in this backward)."""
        if self.hyper is None:
            return None
        done = tuple(self.finished)
        return Progress(time.perf_counter() - self.first_submit, done, len(done) < len(self._started))

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

    def after_step(self) -> None:
        """Nothing is updated any more; the next backward may start the lane (the first step has
        sized the lanes)."""
        self._started, self.hyper, self.finished = set(), None, []
        self.enabled = True

    @contextlib.contextmanager
    def paused(self):
        """A backward inside does not start the update (gradient accumulation)."""
        self.paused_n += 1
        try:
            yield
        finally:
            self.paused_n -= 1
            if not self.paused_n:
                self._restart_counts()

    def require_idle(self, what: str) -> None:
        """Between an overlapped backward and its step() the state is half updated."""
        if self.drain():
            raise RuntimeError(f"dos: {what} between backward and step() with overlap_backward=True: "
                               "part of this step's update has already run; call step() first")

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()


def make_cpu_lane(overlap_backward: bool, lanes, hyper: Callable, grads, device: torch.device,
                  enabled: bool = True):
    """The lane the config asks for; the threaded one ends with the optimizer (weakly held)."""
    if not overlap_backward:
        return InlineCpuLane()
    return ThreadedCpuLane(lanes.cpu_update, hyper, grads.restart_counts, device, enabled)
