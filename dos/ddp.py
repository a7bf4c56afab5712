"""Early gradient D2H under DistributedDataParallel: a communication hook that hands each bucket's
*reduced* gradients to dos as soon as its all-reduce completes (opt-in, docs/DESIGN.md §3.6).

Without it dos is correct under DDP by deferral (dos.params): the gradients a CPU-lane subgroup
sent during backward were the local ones, DDP's all-reduce changes them, so `step()` sends them
again — and after one such step backward sends nothing early. With it:

    dos.register_ddp(ddp_model, opt)                        # allreduce_hook, or
    dos.register_ddp(ddp_model, opt, hook=bf16_compress_hook, state=process_group)
    # = ddp_model.register_comm_hook(state, dos.ddp_comm_hook(opt, bf16_compress_hook))

the wrapper runs the user's hook (default: torch's `allreduce_hook`) and chains a callback on its
future. When a bucket's future completes, the callback copies the reduced values of its parameters
that lie in CPU-lane subgroups from the future's tensor straight into the subgroups' host gradient
blocks (no device write: `.grad` stays DDP's business), on the `grad` stream after an event
recorded on the callback's current stream (CUDA futures run callbacks on a stream synchronized with
the reduction; the hook itself records one on backward's stream). A subgroup whose every parameter
has arrived is marked sent (`GradRouter.sent`) with that copy's event; `step()` sends only the
rest. The post-accumulate hooks send nothing early while a hook is registered: inside `no_sync()`
no comm hook runs, the gradients are only accumulated locally, and are sent by `step()` (or by the
next synchronized backward's callbacks).

What was sent must be what DDP leaves in `.grad`. After DDP's own end-of-backward work
(`finalize_backward`, which copies the bucket into `.grad` with `gradient_as_bucket_view=False`,
points `.grad` at the bucket with `True`, and leaves a globally unused parameter's gradient
untouched) an autograd final callback (`settle`) checks each parameter the callbacks handled:
- `.grad` is the tensor it was at the callback with its version moved by exactly one (DDP's
  `copy_bucket_to_grad`), or it is a view of the future's tensor at the parameter's offset with
  the version it had at the callback (DDP's bucket view): kept. `step()` then sees no client change
  for it (`ParamTracker.ddp_ok`), unless a client changed it after backward (a new version: re-sent,
  as any client change);
- `.grad` is None: torch skips the parameter; so does dos (the sent range is unused);
- anything else (globally unused with a defined gradient; a gradient DDP had to create): refused —
  its CPU subgroups are marked unsent and `step()` sends them from dos's buffers
  (`ddp_refused_params`).

Counters (`describe()["clients"]`): `ddp_early_buckets` (bucket callbacks that sent gradients),
`ddp_early_subgroups` (CPU-lane subgroups wholly sent from callbacks), `ddp_refused_params`.
The deferral of dos.params still applies: if a client changes every gradient after backward
(clipping), the callbacks stop sending until a probe finds it worth it again.

Not supported: `overlap_backward` (its updates would start from the callbacks' thread; refused),
DTensor (FSDP2) parameters (refused), sparse gradients (their buckets are passed through).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .partition import subgroups_of
from .plan import CPU


def ddp_comm_hook(optimizer, hook: Optional[Callable] = None) -> Callable:
    """A DDP communication hook (`hook(state, bucket) -> Future`) that runs `hook` (default:
    `torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook`) and hands each
    bucket's reduced gradients to `optimizer` (a `dos.DeepOptimizerStates` over the DDP model's
    parameters) when its future completes. Register it with
    `ddp_model.register_comm_hook(state, ...)`, the state `hook` expects (None: the default group)."""
    early = _attach(optimizer)
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as hook

    def dos_early_d2h_hook(state, bucket):
        return early.wrap(hook(state, bucket), bucket)

    dos_early_d2h_hook.inner = hook
    return dos_early_d2h_hook


def register_ddp(ddp_model, optimizer, hook: Optional[Callable] = None, state=None) -> None:
    """`ddp_model.register_comm_hook(state, ddp_comm_hook(optimizer, hook))`, after checking that
    the optimizer holds parameters of this model. DDP takes one communication hook: pass yours as
    `hook` (with its `state`) instead of registering it yourself."""
    ours = {id(p) for p in optimizer.param_slots().values()}
    if not any(id(p) in ours for p in ddp_model.parameters()):
        raise ValueError("dos.register_ddp: the optimizer holds none of this model's parameters")
    ddp_model.register_comm_hook(state, ddp_comm_hook(optimizer, hook))


def _attach(opt) -> "EarlyReduced":
    if getattr(opt, "binding", None) is None or getattr(opt.binding, "sharded", True):
        raise ValueError("dos.ddp_comm_hook needs a dos.DeepOptimizerStates over plain (DDP) "
                         "parameters; FSDP2 (DTensor) parameters are reduced by FSDP")
    if opt.config.overlap_backward:
        raise NotImplementedError("dos.ddp_comm_hook: overlap_backward=True is not supported "
                                  "under DistributedDataParallel")
    if opt._grads.ddp is not None:
        raise RuntimeError("dos.ddp_comm_hook: this optimizer already has a DDP hook (DDP allows "
                           "one communication hook per model; one dos hook per optimizer)")
    early = EarlyReduced(opt)
    opt._grads.ddp = opt.binding.track.ddp = early
    return early


class EarlyReduced:
    """One optimizer's side of the hook: pieces to copy, per-backward counts, the settle check."""

    def __init__(self, opt):
        self.grads, self.track = opt._grads, opt.binding.track
        self.layout, self.sync, self.tl = opt.layout, opt._sync, opt._tl
        if opt._host.ring is not None:
            raise ValueError("dos's DDP comm hook sends reduced gradients to their host slots during "
                             "backward; with grad_ring they go down in step(): leave the hook off")
        self.host = opt._host.grad
        # id(p) -> (p, [(subgroup, lo, hi, at)]): elements [lo, hi) of p go to host[subgroup][at:]
        self.pieces: Dict[int, Tuple[torch.Tensor, List[Tuple[int, int, int, int]]]] = {}
        for slot, p in opt._params.items():
            ps = []
            for s in subgroups_of(self.layout, slot):
                sg = self.layout.subgroups[s]
                lo, hi = max(slot.offset, sg.start), min(slot.offset + slot.numel, sg.stop)
                ps.append((s, lo - slot.offset, hi - slot.offset, lo - sg.start))
            self.pieces[id(p)] = (p, ps)
        self.lock = threading.Lock()  # callbacks may run on the process group's threads
        self.arrived = [0] * len(self.layout.subgroups)  # parameters of s sent in this backward
        # id(p) -> (.grad at the callback, its version, the future's tensor, offset, its version)
        self.handled: Dict[int, tuple] = {}
        self.task = None  # the autograd graph task whose backward the callbacks belong to
        self.buckets = self.subgroups = self.refused = 0

    # -- in backward (autograd's thread) -------------------------------------------------------------
    def wrap(self, fut, bucket):
        if not self.grads.send_early:  # deferred (dos.params): a client redoes every early send
            return fut
        buf = bucket.buffer()
        mine = []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if id(p) in self.pieces and not g.is_sparse:
                mine.append((p, g.storage_offset() - buf.storage_offset()))
        if not mine:
            return fut
        self._backward_starts()
        # Backward's stream has produced this bucket's gradients (the hook runs after them).
        ready = self.sync.record("main")

        def reduced(f):
            value = f.value()
            t = value[0] if isinstance(value, (list, tuple)) else value
            with self.lock:
                self._send(t, mine, ready)
            return value

        return fut.then(reduced)

    def _backward_starts(self) -> None:
        """First bucket of a backward: start counting afresh and queue the settle check for after
        DDP's finalize (queued from a final callback: DDP queues its own after this hook)."""
        task = torch._C._current_graph_task_id()
        if task == self.task:
            return
        with self.lock:
            self.task = task
            self.arrived = [0] * len(self.arrived)
            self.handled.clear()
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self.settle))

    # -- when a bucket's future completes (any thread) ---------------------------------------------
    def _send(self, t: torch.Tensor, mine, ready) -> None:
        t = t.detach().reshape(-1)
        sync, grads = self.sync, self.grads
        # The callback's current stream is synchronized with the reduction (CUDA futures).
        after = [(ready, "backward->grad_d2h"), (sync.record("main"), "allreduce->grad_d2h")]
        if sync.is_async:
            t.record_stream(sync.stream("grad"))  # a hook's fresh tensor outlives our copies
        by_sg: Dict[int, list] = {}
        tver = t._version
        for p, off in mine:
            sent = False
            for s, lo, hi, at in self.pieces[id(p)][1]:
                if grads.lanes[s] == CPU:
                    by_sg.setdefault(s, []).append((at, hi - lo, off + lo))
                    sent = True
            if sent:  # settle checks it against what DDP leaves in .grad
                g = p.grad
                self.handled[id(p)] = (g, None if g is None else g._version, t, off, tver)
        for s, copies in by_sg.items():
            n = sum(c[1] for c in copies)
            with self.tl.stage("grad", after, "grad_d2h", s, n, sink=grads.spans) as copied:
                for at, n, src in copies:
                    self.host[s][at: at + n].copy_(t[src: src + n], non_blocking=True)
            after = ()  # the grad stream runs in order: it waited once
            self.arrived[s] += len(copies)
            if self.arrived[s] == grads.need[s]:  # every parameter of s is reduced
                self.arrived[s] = 0
                grads.sent[s], grads.d2h[s] = True, copied.event
                self.subgroups += 1
        if by_sg:
            self.buckets += 1

    # -- after DDP's finalize (autograd's final callbacks) -------------------------------------------
    def settle(self) -> None:
        """Keep what DDP left in `.grad` as sent where it is what the callbacks sent (module doc)."""
        with self.lock:
            ok = self.track.ddp_ok
            for pid, (g0, v0, t, off, tver) in self.handled.items():
                p, pieces = self.pieces[pid]
                g = p.grad
                if g is None:
                    ok[pid] = (None, None)
                elif (g is g0 and g._version == v0 + 1) or (
                        g.dtype == t.dtype and g.is_contiguous() and g._version == tver
                        and g.data_ptr() == t.data_ptr() + off * t.element_size()):
                    ok[pid] = (g, g._version)
                else:
                    self.refused += 1
                    for s, *_ in pieces:
                        self.grads.sent[s] = False
            self.handled.clear()
            self.arrived = [0] * len(self.arrived)
            self.task = None

    def record(self) -> dict:
        return {"ddp_early_buckets": self.buckets, "ddp_early_subgroups": self.subgroups,
                "ddp_refused_params": self.refused}

