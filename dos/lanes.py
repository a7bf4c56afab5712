"""The update phase: executes a Plan. No placement names here — only the Plan's lanes.

Order of one step:
1. GPU lanes are enqueued first, without blocking the host: resident subgroups update in place;
   staged subgroups cycle through the staging slots (H2D of the state -> fused Adam -> D2H), the
   three copies/updates of consecutive subgroups overlapping on their own streams.
2. Meanwhile the host runs the CPU lane: for each subgroup, wait for its gradient's D2H, update
   the state in place and write the weights (param dtype) over the consumed gradient, then queue
   their upload. A CPU lane that started during backward (dos.cpu_lane) is drained first (its
   updates still running overlap the GPU lanes too) and the subgroups it updated are skipped.
3. The main stream waits for the weight writes of every lane, so the next forward never sees a
   stale or half-written weight.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from . import adam, uploads
from .partition import Layout
from .plan import Plan


@dataclass(frozen=True)
class Hyper:
    """AdamW hyperparameters of one bucket for this step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int


class Lanes:
    def __init__(self, layout: Layout, plan: Plan, dev, host, grads, sync, timeline):
        self.layout, self.plan, self.dev, self.host, self.grads = layout, plan, dev, host, grads
        self.sync, self.tl = sync, timeline
        self.written: List = [None] * len(layout.subgroups)  # event: host state written back (D2H)
        # event: a staging slot's last occupant is back in host memory. Kept across steps: the
        # first subgroups of a step reuse the slots that the last ones of the previous step used.
        self.free: List = [None] * len(dev.slots)
        device = dev.params[0].device if dev.params else torch.device("cpu")
        self.step_t = [torch.zeros((), device=device) for _ in layout.buckets]
        # dos.params.StepCounts.segments: (start, stop, step|None) pieces of a subgroup (steps are
        # per parameter; None: no gradient this step). Default: the whole subgroup at the bucket's step.
        self.segments = lambda s, step: [(0, layout.subgroups[s].numel, step)]
        # issues the CPU lane's uploads in step() (None: on the calling thread: dos.uploads.enabled;
        # the gradient ring sends its (j+K)-th gradient once the j-th upload's event exists)
        self.uploader = (uploads.UploadThread(device) if uploads.enabled(device) and grads.ring is None
                         else None)

    def set_plan(self, plan: Plan) -> None:
        """The plan in force from the next update on (the planner checked it fits the buffers)."""
        self.plan = plan
        self.grads.lanes = plan.lanes

    def run(self, hyper: Sequence[Hyper], scale_t: Optional[torch.Tensor], scale: float,
            cpu_lane) -> frozenset:
        """One update phase. `scale_t`/`scale`: gradient divisor (clipping) on device / host.
        `cpu_lane` (dos.cpu_lane): its `drain()` is called once the GPU lanes are enqueued (a
        threaded lane's updates still running overlap them) and gives the CPU subgroups it already
        updated; the rest run here. Returns those subgroups."""
        sync = self.sync
        self.grads.flush()
        # The GPU update reads gradients (and the clipping scale) that the main stream produced.
        sync.wait("compute", sync.record("main"), "backward->gpu_update")
        with sync.on("compute"):
            for b, h in enumerate(hyper):
                self.step_t[b].fill_(float(h.step))  # a kernel argument: no host->device copy
        self._resident(hyper, scale_t)
        self._staged(hyper, scale_t)
        done = cpu_lane.drain()
        self._cpu(hyper, scale, done)
        self.tl.add(cpu_lane.take_spans())  # its spans, now that all have ended
        # The next forward reads weights written by the compute and upload streams.
        sync.wait("main", sync.record("compute"), "gpu_update->forward")
        sync.wait("main", sync.record("upload"), "upload->forward")
        return done

    def _update_on_device(self, s: int, state: torch.Tensor, hyper, scale_t) -> None:
        sg = self.layout.subgroups[s]
        h = hyper[sg.bucket]
        views = self.dev.fmt.views(state, sg.numel)
        grad, param = self.dev.grad(self.layout, s), self.dev.param(self.layout, s)
        for lo, hi, step in self.segments(s, h.step):  # per-parameter steps (dos.params)
            if step is None:
                continue  # no gradient this step: untouched, as torch.optim.AdamW
            step_t = self.step_t[sg.bucket] if step == h.step else torch.full((), float(step), device=state.device)
            adam.device_state_step_(self.dev.fmt, views, grad, param, lo=lo, hi=hi, step=step, step_t=step_t,
                                    lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                                    weight_decay=h.weight_decay, scale_t=scale_t,
                                    scratch=self.dev.scratch)

    def _resident(self, hyper, scale_t) -> None:
        for s, state in self.dev.resident.items():
            with self.tl.stage("compute", lane="gpu", subgroup=s, numel=self.layout.subgroups[s].numel):
                self._update_on_device(s, state, hyper, scale_t)

    def _staged(self, hyper, scale_t) -> None:
        slots, free, tl = self.dev.slots, self.free, self.tl
        for j, s in enumerate(self.plan.staged_order):
            k, n = j % len(slots), self.layout.subgroups[s].numel
            host = self.host.state[s]
            slot = slots[k][: host.numel()]
            # H2D may overwrite the slot only after its previous subgroup's D2H has read it, and
            # may read the host state only after this subgroup's last write-back landed there.
            with tl.stage("h2d", [(free[k], "d2h->h2d(slot)"), (self.written[s], "d2h->h2d(state)")],
                          "h2d", s, n) as loaded:
                slot.copy_(host, non_blocking=True)
            # The update needs the state in the slot.
            with tl.stage("compute", [(loaded.event, "h2d->gpu_update")], "gpu", s, n) as updated:
                self._update_on_device(s, slot, hyper, scale_t)
            # The write-back must read the state after the update wrote it.
            with tl.stage("d2h", [(updated.event, "gpu_update->d2h")], "d2h", s, n) as written:
                host.copy_(slot, non_blocking=True)
            free[k] = self.written[s] = written.event

    def _cpu(self, hyper, scale: float, done: frozenset = frozenset()) -> None:
        order = [s for s in self.plan.cpu_order if s not in done]
        feed = self.grads.feed(order)  # what gradient goes down as each subgroup's weights go up
        up = self.uploader.submit if self.uploader is not None else None  # dos/uploads.py
        try:
            for j, s in enumerate(order):
                ev = self.cpu_update(s, hyper, scale=scale, upload=up)
                if up is None:
                    feed.uploaded(j, ev)
        except BaseException:
            if up is not None:  # nothing may still run when the error reaches the caller
                with contextlib.suppress(RuntimeError):
                    self.uploader.join()
            raise
        if up is not None:
            self.uploader.join()  # every upload is on its stream before run() waits for it
        self.grads.after_update()

    def cpu_update(self, s: int, hyper, spans: Optional[list] = None, scale: float = 1.0,
                   spare: int = 0, upload: Optional[Callable] = None):
        """Update CPU subgroup s on the calling thread and queue the upload of its weights; the
        upload's event. `spans`: where its spans go (None: this step's timeline); `spare`: cores
        of the plan's CPU threads left free (backward's own thread, when it runs during backward);
        `upload`: `UploadThread.submit` (dos/uploads.py) to issue the upload from there (then
        the event is None: the caller joins the thread instead)."""
        sync, sg = self.sync, self.layout.subgroups[s]
        h = hyper[sg.bucket]
        # The CPU may read the gradient only once its D2H has landed, and the state only once
        # its last write-back from the GPU has (a staged subgroup in an earlier plan).
        sync.host_wait(self.grads.d2h[s], "grad_d2h->cpu_update")
        sync.host_wait(self.written[s], "d2h->cpu_update")
        t0 = time.perf_counter()
        views = self.host.views(s)
        g = self.host.grad[s]
        # bf16-split: the state holds the weights (hi, dos/split_master.py); they go up from there
        # and nothing is written over the gradient (2 B per element less host traffic)
        src = views.hi if self.dev.fmt.split else None
        for lo, hi, step in self.segments(s, h.step):  # per-parameter steps (dos.params)
            if step is None:  # no gradient this step: untouched; its weights go up unchanged
                if src is None:
                    g[lo:hi].copy_(views.master[lo:hi])
                continue
            adam.cpu_state_step_(self.dev.fmt, views, g, g if src is None else None, lo=lo, hi=hi, step=step, lr=h.lr,
                                 beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                                 grad_scale=scale, threads=max(1, self.plan.cpu_threads - spare))
        span = ("cpu", s, sg.numel, t0, time.perf_counter())
        if spans is None:
            self.tl.host(*span)
        elif self.tl.enabled:
            spans.append(span)
        # The weights went over the gradient in the host block (bf16-split: they are the state's
        # hi): upload them from there. hi's next write is this subgroup's next update, after the
        # next backward, which the upload precedes (upload->forward).
        weights = g if src is None else src
        if upload is not None:  # issued by dos.uploads' thread; `run` joins it before the wait
            upload(lambda: self._upload(s, weights, spans))
            return None
        return self._upload(s, weights, spans)  # a gradient ring's next D2H into this slot waits for it

    def _upload(self, s: int, weights: torch.Tensor, spans: Optional[list]):
        """Queue the upload of CPU subgroup s's new weights on the upload stream; its event."""
        with self.tl.stage("upload", lane="upload", subgroup=s, numel=self.layout.subgroups[s].numel,
                           sink=spans) as up:
            self.dev.param(self.layout, s).copy_(weights, non_blocking=True)
        return up.event

    def close(self) -> None:
        if self.uploader is not None:
            self.uploader.close()

    def keep_slots(self, n: int) -> None:
        """Keep the first n staging slots (the caller has synchronized: no copy uses the others)."""
        self.dev.keep_slots(n)
        del self.free[n:]

    def wait_host_state(self) -> None:
        """Block until every write-back of host state has landed (before reading it)."""
        for ev in self.written:
            self.sync.host_wait(ev, "d2h->host_read")
