"""Gradients: from autograd into their subgroups, and off the GPU for the CPU lane.

Every trainable parameter's `.grad` is a view of its bucket's flat gradient buffer (once it has
one: None after construction and `zero_grad()`, as torch; the hook adopts the first backward's),
so autograd accumulates in place (micro-batches add up there). A post-accumulate-grad hook counts, per
subgroup, the parameters whose gradient is final for this backward; when a CPU-lane subgroup is
complete its gradient starts its D2H on the `grad` stream, overlapping the rest of backward.

A copy may be overtaken: another micro-batch (or `zero_grad`) may change the gradient while its
D2H still reads it. That copy's result is never used: any change marks the subgroup unsent, so it
is sent again (by the hook when complete, or by `flush` before the update), and the grad stream
runs its copies in order, so the last one — issued after the last change — is what the CPU reads.

With `grad_ring` (dos.buffers.GradRing) the CPU-lane gradients share K host slots: backward and
`flush` send none, and the CPU lane's loop sends them in `step()` through `feed` (_RingFeed), each
after the weight upload of its slot's last occupant.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .buffers import GradRing
from .params import grad_view
from .partition import Layout, ParamSlot, subgroups_of
from .plan import CPU


class GradRouter:
    def __init__(self, layout: Layout, lanes: Sequence[str], params: Dict[ParamSlot, torch.nn.Parameter],
                 dev, host, sync, timeline):
        self.layout, self.lanes, self.dev, self.host, self.sync, self.tl = layout, lanes, dev, host, sync, timeline
        # dos.buffers.GradRing (EngineConfig.grad_ring): the CPU lane sends each gradient itself,
        # in step(), into a shared slot (Lanes._cpu); backward and flush send none
        self.ring = host if isinstance(host, GradRing) else None
        self.feed = self._ring_feed if self.ring is not None else _SlotFeed
        n = len(layout.subgroups)
        self.need = [0] * n  # parameters per subgroup
        self.count = [0] * n  # parameters whose gradient is final in the current backward
        self.sent = [False] * n  # the host holds the current gradient of this subgroup
        self.d2h: List = [None] * n  # event: gradient D2H done
        self.spans: list = []  # traced D2H spans since the last step
        self._views: Dict[int, torch.Tensor] = {}
        self._handles = []
        self.cpu_lane = None  # dos.cpu_lane: told when a CPU subgroup's gradient is on its way
        self.watch = None  # dos.params.ParamTracker: records each gradient's version
        # Whether backward sends a CPU-lane gradient as soon as it is complete; False while every
        # such early send has been redone at step() (a client changes every gradient after
        # backward: DDP's all-reduce, a framework's clipping): `flush` then sends each once.
        self.send_early = True
        # dos.ddp.EarlyReduced while a dos DDP comm hook is registered: it sends the *reduced*
        # gradients when each bucket's all-reduce completes; backward sends nothing early itself.
        self.ddp = None
        for slot, p in params.items():
            sgs = subgroups_of(layout, slot)
            for s in sgs:
                self.need[s] += 1
            # .data: a version counter of its own (dos.params tells which gradient changed)
            view = grad_view(dev.grads[slot.bucket][slot.offset: slot.offset + slot.numel], p.shape)
            if p.grad is not None:  # else None, as torch: the first backward's hook adopts it
                view.copy_(p.grad)
                p.grad = view
            self._views[id(p)] = view
            self._handles.append(p.register_post_accumulate_grad_hook(self._after_accumulate(sgs)))

    def _after_accumulate(self, sgs: List[int]):
        def hook(p):
            self.cpu_lane.guard(sgs)  # raises before a gradient it already consumed changes
            self.sync.delay("main")  # race tests: let backward lag behind the host
            view = self._views[id(p)]
            if p.grad.data_ptr() != view.data_ptr():  # .grad was set to None: adopt the new one
                view.copy_(p.grad)
                p.grad = view
            if self.watch is not None:
                self.watch.grad_done(p)  # dos.params: the version backward left
            for s in sgs:
                self.sent[s] = False
                self.count[s] += 1
                if self.count[s] == self.need[s]:
                    self.count[s] = 0
                    if self.lanes[s] == CPU and self.ddp is None and self.ring is None and (
                            self.send_early or self.cpu_lane.starts_in_backward):
                        self.send(s)
                        self.cpu_lane.submit(s)
        return hook

    def send(self, s: int, after_upload=None) -> None:
        """Start the D2H of subgroup s's gradient into its host block (or ring slot: then after
        `after_upload`, the event of the slot's last weight upload, if any)."""
        # The gradient is complete on the main stream only once the kernels that made it have run.
        # (This also orders the copy after last step's upload of the weights out of the same host
        # buffer: the main stream waited for that upload before this step's forward.)
        after = [(self.sync.record("main"), "backward->grad_d2h")]
        if after_upload is not None:
            after.append((after_upload, "upload->grad_d2h(ring)"))
        with self.tl.stage("grad", after, "grad_d2h", s, self.layout.subgroups[s].numel,
                           sink=self.spans) as copied:
            self.host[s].copy_(self.dev.grad(self.layout, s), non_blocking=True)
        self.d2h[s] = copied.event
        self.sent[s] = True

    def flush(self) -> None:
        """Before an update: every CPU-lane subgroup's host gradient must be the final one."""
        for s, lane in enumerate(self.lanes):
            self.count[s] = 0
            if lane == CPU and not self.sent[s] and self.ring is None:
                self.send(s)

    def _ring_feed(self, order: Sequence[int]) -> "_RingFeed":
        return _RingFeed(self, self.ring, order)

    def restart_counts(self) -> None:
        """The next backward counts its gradients afresh: a subgroup is complete only once every
        parameter in it has its gradient from that backward (after accumulated micro-batches)."""
        self.count = [0] * len(self.count)

    def after_update(self) -> None:
        """The CPU lane overwrote the host gradients with weights: nothing is sent any more."""
        self.sent = [False] * len(self.sent)

    def take_spans(self) -> list:
        spans, self.spans = self.spans, []
        return spans

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class _SlotFeed:
    """A slot per subgroup: every CPU-lane gradient was sent already (backward or `flush`)."""

    def __init__(self, order: Sequence[int]):
        pass

    def uploaded(self, j: int, event) -> None:
        pass


class _RingFeed:
    """grad_ring: the j-th CPU subgroup of the step takes slot j % K; the first K gradients go down
    at once, and the (j+K)-th once the j-th's weights are queued up out of the same slot (its D2H
    waits for that upload on the GPU)."""

    def __init__(self, router: GradRouter, ring: GradRing, order: Sequence[int]):
        self.router, self.ring, self.order = router, ring, list(order)
        ring.assign(self.order)
        for j in range(min(ring.k, len(self.order))):
            router.send(self.order[j], after_upload=ring.free[j])

    def uploaded(self, j: int, event) -> None:
        k = self.ring.k
        self.ring.free[j % k] = event
        if j + k < len(self.order):
            self.router.send(self.order[j + k], after_upload=event)
