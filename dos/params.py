"""What clients do to parameters and gradients between dos's own writes, detected at `step()`.

dos lays the trainable parameters out in flat per-bucket buffers at construction and sends a
CPU-lane subgroup's gradient to the host as soon as it is complete in backward. torch.optim.AdamW
reads `p`, `p.grad` at `step()`; clients rely on that (framework clipping, `GradScaler.unscale_`,
`p.grad = t`, `zero_grad(set_to_none=True)`, `model.load_state_dict`). `ParamTracker` makes dos
read the same things, at a cost of one Python pass over the parameters per step:

- Identity. Each parameter's `.data` is an *alias* of its range of the flat buffer with its own
  storage object (`torch.from_dlpack` of the slice): writes alias the flat buffer (the subgroup
  upload stays one copy), but safetensors / accelerate see no shared storage (they would keep 1 of
  N "tied" tensors). A parameter whose `.data` no longer is its alias was replaced: with the same
  dtype, device and shape its new values are adopted (as an in-place load); otherwise `step()`
  raises with what to do (dos cannot move its buffers).
- Gradients. Each `.grad` is a `.data` view of the flat gradient buffer: its own version counter
  (a plain view shares its base's, which every other gradient's accumulation bumps). The
  post-accumulate hook records it; at `step()` a different version (clipping's `_foreach_mul_`,
  `GradScaler.unscale_`, any in-place change) or a different tensor (`p.grad = t`) marks the
  parameter's subgroups for a re-send of their gradient to the host before the CPU update
  (`resent_subgroups` in `describe()`). Per parameter, not per bucket: a subgroup is re-sent only
  if one of its gradients changed. Changes made through `p.grad.data` bypass the version counter
  (as they bypass autograd's own checks) and are not seen. dos's own `max_grad_norm` scales inside
  the update instead: no re-send (the fast path).
  Under DDP with dos's comm hook (dos.ddp) the reduced gradients were sent from DDP's callbacks;
  what DDP then left in `.grad` (tensor and version, checked after its finalize) is in `ddp_ok`
  and is not a client's change.
- No gradient (`p.grad is None`, e.g. after `zero_grad(set_to_none=True)` and a backward that did not
  reach the parameter): skipped as torch.optim.AdamW does — no decay, no moment update, no step.
  Steps are therefore counted per parameter; a subgroup whose parameters are at different steps
  (or partly skipped) is updated per contiguous segment of equal step (`segments`).
- Weights changed in place (`model.load_state_dict`, `p.mul_`): the parameter's version counter
  moved (dos writes through the flat buffer, which does not bump it), so its fp32 master is
  re-seeded from the parameter. Exact for fp32 parameters; for bf16/fp16 parameters the master
  becomes the low-precision value (its extra fp32 bits are lost, as when a bf16 model is loaded).
- A parameter frozen at construction (not laid out) that now has a gradient: `step()` raises
  (torch.optim.AdamW would train it; dos has no state for it).

Where: `ParamTracker` is the plain-tensor path's (`binding.DirectBinding`: aliases, gradient
views, versions). DTensor (FSDP2) parameters (`binding.ShardBinding`) are never aliased: their
gradients and weights are copied in and out at `step()`, which reads them as they are then; they
share only `StepCounts` (per-parameter steps, skipping, segments).

Cost: `before_step` took 2.6 ms for 300 parameters (12 subgroups) on the loaded 2-core CI machine,
about 9 us per parameter (a 7B Llama has 291), against update phases of 0.3-1.6 s at 7B. Tracking
per bucket instead (the flat buffer's version) would be cheaper but re-send every CPU subgroup of
a bucket whenever any one gradient changed, and cannot tell which parameters had no gradient.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .partition import Layout, ParamSlot, subgroups_of
from .plan import CPU
from .state_format import set_master_


def alias(flat: torch.Tensor, shape) -> torch.Tensor:
    """A tensor over `flat`'s memory with a storage object of its own (see the module doc)."""
    if flat.numel() == 0:
        return torch.empty(shape, dtype=flat.dtype, device=flat.device)
    return torch.from_dlpack(flat.detach()).view(shape)


def grad_view(flat: torch.Tensor, shape) -> torch.Tensor:
    """A view of `flat` with its own version counter (`.data`), for a parameter's `.grad`."""
    return flat.view(shape).data


# describe()["clients"] without a dos DDP comm hook (dos.ddp.EarlyReduced.record)
NO_HOOK = {"ddp_early_buckets": 0, "ddp_early_subgroups": 0, "ddp_refused_params": 0}

PROBE_EVERY = 32  # steps between probes of early sends while they are deferred

class StepCounts:
    """Per-parameter step counts (torch's: a parameter without a gradient is skipped) and the
    segments of equal step of each subgroup (`Lanes.segments`). Both bindings use it."""

    def __init__(self, layout: Layout, params: Dict[ParamSlot, torch.nn.Parameter]):
        self.layout, self.params = layout, params
        self.steps: Dict[ParamSlot, int] = {slot: 0 for slot in params}
        self.pieces: List[List[Tuple[ParamSlot, int, int]]] = [[] for _ in layout.subgroups]
        self.subgroups: Dict[ParamSlot, List[int]] = {}
        for slot in params:
            self.subgroups[slot] = subgroups_of(layout, slot)
            for s in self.subgroups[slot]:
                sg = layout.subgroups[s]
                lo, hi = max(slot.offset, sg.start), min(slot.offset + slot.numel, sg.stop)
                self.pieces[s].append((slot, lo - sg.start, hi - sg.start))
        for ps in self.pieces:
            ps.sort(key=lambda x: x[1])
        self.active: Optional[set] = None  # slots with a gradient in the step being run
        self.current: Optional[Dict[int, list]] = None  # segments of the step being run
        self.skipped_params = 0  # parameter-steps skipped for lack of a gradient

    def begin(self, active: set) -> None:
        """The step being run updates the parameters `active` (those with a gradient)."""
        self.skipped_params += len(self.params) - len(active)
        self.active = active
        self.current = {s: self._segments(s, active) for s in range(len(self.layout.subgroups))}

    def after_step(self) -> None:
        for slot in self.active or ():
            self.steps[slot] += 1
        self.active = self.current = None

    def segments(self, s: int, step: int) -> List[Tuple[int, int, Optional[int]]]:
        """(start, stop, step) pieces of subgroup s, covering it: step None = no gradient this
        step (left untouched). `step`: the bucket's step, used where s holds no parameter. Outside
        step() (updates during backward), every parameter of s counts as having its gradient."""
        current = self.current
        segs = current[s] if current is not None else self._segments(s, None)
        return segs or [(0, self.layout.subgroups[s].numel, step)]

    def _segments(self, s: int, active: Optional[set]) -> list:
        out: list = []
        pieces = self.pieces[s]
        for k, (slot, lo, _) in enumerate(pieces):
            step = self.steps[slot] + 1 if active is None or slot in active else None
            lo = 0 if k == 0 else lo  # padding goes with its neighbour (all zeros: a no-op)
            if out and out[-1][2] == step:
                continue
            if out:
                out[-1] = (out[-1][0], lo, out[-1][2])
            out.append((lo, None, step))
        if out:
            out[-1] = (out[-1][0], self.layout.subgroups[s].numel, out[-1][2])
        return out

    def record(self) -> dict:
        return {"resent_subgroups": 0, "resynced_params": 0, "skipped_params": self.skipped_params,
                "followed_params": 0, "deferred_steps": 0, **NO_HOOK}


class ParamTracker(StepCounts):
    """Per-parameter bookkeeping of one optimizer's plain-tensor parameters (see the module doc).
    `dev`, `host`: the engine's DeviceBuffers and HostArena; `attach` gives the GradRouter and
    the Lanes once they exist."""

    def __init__(self, layout: Layout, params: Dict[ParamSlot, torch.nn.Parameter], dev, host):
        super().__init__(layout, params)
        self.dev, self.host = dev, host
        self.grads = self.lanes = None
        self.alias: Dict[ParamSlot, torch.Tensor] = {}
        self.pver: Dict[ParamSlot, int] = {}  # p._version after dos last synced the master to p
        self.gver: Dict[int, int] = {}  # id(p) -> p.grad._version when the hook last saw it
        self.resent_subgroups = 0  # CPU-lane subgroups whose gradient was sent again
        self.resynced_params = 0  # parameters whose master was re-seeded from the weights
        self.followed_params = 0  # parameters whose replaced `.data` was adopted
        self.steps_seen = 0
        self.deferred_steps = 0  # steps whose backward sent no CPU-lane gradient early
        # dos.ddp: id(p) -> (the .grad DDP left, its version) for gradients whose reduced values
        # the comm hook already sent (`settle`); unchanged at step(), they are not stale.
        self.ddp = None
        self.ddp_ok: Dict[int, tuple] = {}

    # -- construction --------------------------------------------------------------------------
    def adopt(self, slot: ParamSlot, p: torch.nn.Parameter, flat: torch.Tensor) -> None:
        """Point p at its range `flat` of the bucket (values copied first)."""
        flat.copy_(p.detach().reshape(-1))
        a = alias(flat, p.shape)
        p.data = a
        self.alias[slot] = a
        self.pver[slot] = p._version

    def attach(self, grads, lanes) -> None:
        """The GradRouter reports each gradient's version; the Lanes update by segment."""
        self.grads, self.lanes = grads, lanes
        grads.watch, lanes.segments = self, self.segments

    # -- the gradient hook (autograd's thread) ---------------------------------------------------
    def grad_done(self, p: torch.nn.Parameter) -> None:
        self.gver[id(p)] = p.grad._version
        self.ddp_ok.pop(id(p), None)  # accumulated again: what the DDP hook sent is old

    # -- zero_grad -----------------------------------------------------------------------------
    def zero_grad(self, groups: Sequence[dict], set_to_none: bool) -> None:
        """torch semantics: set_to_none -> every `.grad` None (the flat buffer is overwritten by
        the next backward's first accumulation: the hook copies into it); else zeroed in place."""
        if set_to_none:
            for g in groups:
                for p in g["params"]:
                    p.grad = None
        else:
            for g in self.dev.grads:
                g.zero_()
            views = self.grads._views
            for g in groups:
                for p in g["params"]:
                    if p.grad is not None and p.grad is not views.get(id(p)):
                        p.grad.zero_()  # a tensor dos does not own: zeroed as torch would
        self.grads.sent = [False] * len(self.grads.sent)
        self.ddp_ok.clear()

    # -- step ------------------------------------------------------------------------------------
    def before_step(self, groups: Sequence[dict], cpu_lane=None) -> None:
        """Detect what clients changed since dos's last look and make the buffers say it: adopt
        replaced weights and gradients, re-seed masters of weights changed in place, mark
        subgroups whose host gradient is stale, zero the gradient range of parameters without a
        gradient (dos's clipping norm reads it). `cpu_lane` (dos.cpu_lane): its `started` CPU
        subgroups were already updated during backward (overlap_backward): any change to them
        raises (after its updates have drained)."""
        views, ddp_ok = self.grads._views, self.ddp_ok
        active, stale, resync = set(), set(), []
        for slot, p in self.params.items():
            a = self.alias[slot]
            if p.data_ptr() != a.data_ptr() or p.dtype != a.dtype or p.device != a.device \
                    or p.shape != a.shape:
                self._follow(slot, p)
                resync.append(slot)
            elif p._version != self.pver[slot]:
                resync.append(slot)
            view, g = views[id(p)], p.grad
            if g is None:
                if slot.numel:
                    self.dev.grads[slot.bucket][slot.offset: slot.offset + slot.numel].zero_()
                continue
            active.add(slot)
            # the DDP hook sent what DDP left in .grad (dos.ddp), and nothing changed it since
            ok = ddp_ok.get(id(p))
            reduced = ok is not None and ok[0] is g and ok[1] == g._version
            if g is not view:  # assigned or replaced after (or without) backward
                if g.shape != view.shape:
                    raise RuntimeError(f"dos: the gradient of a parameter of shape {tuple(p.shape)} "
                                       f"was replaced by a tensor of shape {tuple(g.shape)}")
                view.copy_(g)
                p.grad = view
                if not reduced:
                    stale.update(self.subgroups[slot])
            elif view._version != self.gver.get(id(p)) and not reduced:
                stale.update(self.subgroups[slot])
            self.gver[id(p)] = view._version
        ddp_ok.clear()
        _check_unfrozen(groups, self.params.values())
        started = cpu_lane.started if cpu_lane is not None else frozenset()
        bad = (stale | {s for slot in resync for s in self.subgroups[slot]}) & started
        if bad:
            cpu_lane.drain()  # nothing may still run when the error reaches the caller
            raise RuntimeError(
                "dos: gradients or weights changed between backward and step() with "
                "overlap_backward=True, after the CPU lane had already consumed them (subgroups "
                f"{sorted(bad)[:8]}): clip with dos's max_grad_norm, or run without overlap_backward "
                "(always under DistributedDataParallel: it all-reduces the gradients after backward)")
        if resync:
            self._resync(resync)
        lanes, grads = self.grads.lanes, self.grads
        early = [s for s, lane in enumerate(lanes) if lane == CPU and grads.sent[s]]
        resent = [s for s in early if s in stale]
        for s in resent:
            grads.sent[s] = False
        self.resent_subgroups += len(resent)
        self._plan_early_sends(len(early), len(resent))
        self.begin(active)

    def _plan_early_sends(self, early: int, resent: int) -> None:
        """Early sends that a client's change makes stale are paid twice. Once every early send of
        a step was redone, backward stops sending early (step() sends each gradient once) and
        tries again every PROBE_EVERY steps, in case the client stopped changing them."""
        self.steps_seen += 1
        if not self.grads.send_early:  # the backward just run sent nothing early
            self.deferred_steps += 1
        if early and resent == early:
            self.grads.send_early = False
        elif early:
            self.grads.send_early = True  # a probe found early sends worth keeping
        elif not self.grads.send_early and self.steps_seen % PROBE_EVERY == 0:
            self.grads.send_early = True  # the next backward probes

    # -- weights ---------------------------------------------------------------------------------
    def _follow(self, slot: ParamSlot, p: torch.nn.Parameter) -> None:
        a = self.alias[slot]
        if p.dtype != a.dtype or p.device != a.device or p.shape != a.shape:
            raise RuntimeError(
                f"dos: a parameter was moved, cast or reshaped after the optimizer was built "
                f"({a.dtype} {tuple(a.shape)} on {a.device} -> {p.dtype} {tuple(p.shape)} on "
                f"{p.device}). dos lays its buffers out at construction: build the optimizer after "
                "model.to(...) / accelerator.prepare(model) (with transformers.Trainer, let it "
                "create the optimizer: override create_optimizer, or pass optimizer_cls_and_kwargs), "
                "or save opt.state_dict() and load it into a new optimizer")
        a.copy_(p.detach())
        p.data = a
        self.followed_params += 1

    def _resync(self, slots: List[ParamSlot]) -> None:
        """Re-seed the fp32 master of these parameters from their current weights."""
        self.lanes.wait_host_state()
        for slot in slots:
            p = self.params[slot]
            src = self.alias[slot].reshape(-1)
            for s in self.subgroups[slot]:
                sg = self.layout.subgroups[s]
                lo, hi = max(slot.offset, sg.start), min(slot.offset + slot.numel, sg.stop)
                state = self.dev.resident[s] if s in self.dev.resident else self.host.state[s]
                set_master_(self.dev.fmt, self.dev.fmt.views(state, sg.numel),
                            src[lo - slot.offset: hi - slot.offset], lo=lo - sg.start)
            self.pver[slot] = p._version
            self.resynced_params += 1

    def record(self) -> dict:
        return {"resent_subgroups": self.resent_subgroups, "resynced_params": self.resynced_params,
                "skipped_params": self.skipped_params, "followed_params": self.followed_params,
                "deferred_steps": self.deferred_steps,
                **(self.ddp.record() if self.ddp is not None else NO_HOOK)}


def _check_unfrozen(groups: Sequence[dict], tracked) -> None:
    ids = {id(p) for p in tracked}
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            if p.grad is not None and id(p) not in ids:
                raise RuntimeError(
                    f"dos: parameter {i} of param group {g} had requires_grad=False when the "
                    "optimizer was built and now has a gradient; torch.optim.AdamW would train it, "
                    "dos has no state for it (its buffers are laid out at construction). Unfreeze "
                    "before building the optimizer (or build a new one and load this one's "
                    "state_dict into it)")
