"""Gradients: from autograd into their subgroups, and off the GPU for the CPU lane.

Every trainable parameter's `.grad` is a view of its bucket's flat gradient buffer, so autograd
accumulates in place (micro-batches add up there). A post-accumulate-grad hook counts, per
subgroup, the parameters whose gradient is final for this backward; when a CPU-lane subgroup is
complete its gradient starts its D2H on the `grad` stream, overlapping the rest of backward.
Another backward (gradient accumulation) or `zero_grad` first waits for that copy, and the copy
is sent again if the gradient changed since (`flush`), so the host copy is always the final one.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .partition import Layout, ParamSlot, subgroups_of
from .plan import CPU


class GradRouter:
    def __init__(self, layout: Layout, lanes: Sequence[str], params: Dict[ParamSlot, torch.nn.Parameter],
                 dev, host, sync, timeline):
        self.layout, self.lanes, self.dev, self.host, self.sync, self.tl = layout, lanes, dev, host, sync, timeline
        n = len(layout.subgroups)
        self.need = [0] * n  # parameters per subgroup
        self.count = [0] * n  # parameters whose gradient is final in the current backward
        self.sent = [False] * n  # the host holds the current gradient of this subgroup
        self.d2h: List = [None] * n  # event: gradient D2H done
        self.pending: List[bool] = [False] * n  # d2h in flight that the main stream has not waited for
        self.upload: List = [None] * n  # event: the host buffer's previous content (weights) uploaded
        self.spans: list = []  # traced D2H spans since the last step
        self._views: Dict[int, torch.Tensor] = {}
        self._handles = []
        for slot, p in params.items():
            sgs = subgroups_of(layout, slot)
            for s in sgs:
                self.need[s] += 1
            view = dev.grads[slot.bucket][slot.offset: slot.offset + slot.numel].view(p.shape)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self._views[id(p)] = view
            self._handles.append(p.register_hook(self._before_accumulate(sgs)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._after_accumulate(sgs)))

    def _before_accumulate(self, sgs: List[int]):
        def hook(grad):
            # Autograd is about to add into this gradient: a D2H still reading it must finish.
            for s in sgs:
                if self.pending[s]:
                    self.sync.wait("main", self.d2h[s], "grad_d2h->accumulate")
                    self.pending[s] = False
            return grad
        return hook

    def _after_accumulate(self, sgs: List[int]):
        def hook(p):
            view = self._views[id(p)]
            if p.grad.data_ptr() != view.data_ptr():  # .grad was set to None: adopt the new one
                view.copy_(p.grad)
                p.grad = view
            for s in sgs:
                self.sent[s] = False
                self.count[s] += 1
                if self.count[s] == self.need[s]:
                    self.count[s] = 0
                    if self.lanes[s] == CPU:
                        self.send(s)
        return hook

    def send(self, s: int) -> None:
        """Start the D2H of subgroup s's gradient into its host block."""
        sync = self.sync
        ready = sync.record("main")
        # The gradient is complete on the main stream only once the kernels that made it have run.
        sync.wait("grad", ready, "backward->grad_d2h")
        # The host buffer still holds last step's weights until their upload has read them.
        sync.wait("grad", self.upload[s], "upload->grad_d2h")
        sync.delay("grad")
        with sync.on("grad"):
            t = self.tl.gpu_start("grad")
            self.host[s].copy_(self.dev.grad(self.layout, s), non_blocking=True)
            self.d2h[s] = sync.record("grad")
            if t is not None:
                self.spans.append(("grad_d2h", s, self.layout.subgroups[s].numel, t, self.d2h[s]))
        self.pending[s] = sync.is_async
        self.sent[s] = True

    def flush(self) -> None:
        """Before an update: every CPU-lane subgroup's host gradient must be the final one."""
        for s, lane in enumerate(self.lanes):
            self.count[s] = 0
            if lane == CPU and not self.sent[s]:
                self.send(s)

    def after_update(self) -> None:
        """The CPU lane overwrote the host gradients with weights: nothing is sent any more."""
        self.sent = [False] * len(self.sent)

    def take_spans(self) -> list:
        spans, self.spans = self.spans, []
        return spans

    def zero_(self) -> None:
        for s in range(len(self.pending)):
            if self.pending[s]:
                self.sync.wait("main", self.d2h[s], "grad_d2h->zero_grad")
                self.pending[s] = False
        for g in self.dev.grads:
            g.zero_()
        self.sent = [False] * len(self.sent)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
