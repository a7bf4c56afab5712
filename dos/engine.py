"""DeepOptimizerStates: a `torch.optim.Optimizer` whose AdamW state lives in host memory and is
updated by the CPU and the GPU at the same time, as the Plan says.

Construct it after the model is on its device: the trainable parameters become views of flat
per-bucket buffers, so that each subgroup's weights and gradients move in one copy.
"""
from __future__ import annotations

import contextlib
import os
import time
import weakref
from fractions import Fraction
from typing import Iterable, List, Optional

import torch

from . import adam, checkpoint, perfmodel, refine
from .buffers import DeviceBuffers, HostArena, arena_blocks, preflight, thirds
from .config import EngineConfig, validate_hparams
from .early import EarlyUpdates
from .grads import GradRouter
from .lanes import Hyper, Lanes
from .partition import partition
from .plan import STAGED, make_plan
from .streams import make_sync
from .trace import Timeline

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REPLAN_DRIFT = 0.02  # re-plan once a rate has moved this much since the last search


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class DeepOptimizerStates(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, `torch.optim.AdamW` semantics) with offloaded state.

    Args beyond AdamW's are those of `dos.config.EngineConfig`.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, placement: str = "interleaved", stride="auto",
                 gpu_fraction: float = 0.0, subgroup_numel: Optional[int] = None,
                 max_grad_norm: Optional[float] = None, cpu_threads: Optional[int] = None,
                 staging_slots: int = 3, replan: bool = True, trace: bool = False,
                 pin_memory: bool = True,
                 host_memory_limit_gib: Optional[float] = None, overlap_backward: bool = False,
                 amsgrad: bool = False, maximize: bool = False):
        validate_hparams(lr, betas, eps, weight_decay)
        if amsgrad or maximize:
            # NOTE: deviation from torch.optim.AdamW — these variants are not implemented.
            raise ValueError("dos.DeepOptimizerStates supports neither amsgrad nor maximize")
        self.config = EngineConfig(placement=placement, stride=stride, gpu_fraction=gpu_fraction,
                                   subgroup_numel=subgroup_numel, max_grad_norm=max_grad_norm,
                                   cpu_threads=cpu_threads, staging_slots=staging_slots, replan=replan,
                                   trace=trace, pin_memory=pin_memory,
                                   host_memory_limit_gib=host_memory_limit_gib,
                                   overlap_backward=overlap_backward)
        self._ready = False
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            validate_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        device = _check_params(trainable)
        cfg = self.config

        self.layout = partition([[(p.numel(), str(p.dtype)) for p in ps] for ps in trainable],
                                cfg.subgroup_numel)
        self._params = {slot: trainable[slot.group][slot.index] for slot in self.layout.slots()}
        dtypes = [trainable[b.slots[0].group][b.slots[0].index].dtype for b in self.layout.buckets]
        self.calibration = _calibration(device)
        self.plan = self._make_plan(dtypes[0].itemsize)
        blocks, nbytes = arena_blocks(self.layout, self.plan.lanes, [d.itemsize for d in dtypes])
        preflight(nbytes, self.layout.n_params, cfg.host_memory_limit_gib)  # before any allocation

        self._refining = (cfg.replan and cfg.placement == "interleaved" and cfg.stride == "auto"
                          and self.calibration is not None)
        self._searched = self.calibration  # the rates the current plan was searched under
        self._searched_head_start = 0.0  # ... and the head start (overlap_backward)
        self.head_start_s = 0.0  # backward seconds the CPU lane overlaps (moving average)
        # gpu_fraction="auto": the resident share is chosen at the first step, once the
        # iteration's peak GPU memory is known.
        self._sizing = cfg.gpu_fraction == "auto" and self.calibration is not None
        self._sync = make_sync(device, timing=cfg.trace or self._refining)
        self._tl = Timeline(self._sync, trace=cfg.trace, measure=self._refining)
        n_slots = self.plan.staging_slots if STAGED in self.plan.lanes else 0
        if self._refining or (self._sizing and cfg.placement == "interleaved"):
            # re-planning may stage subgroups later even if this plan does not
            n_slots = max(n_slots, cfg.staging_slots)
        self._dev = DeviceBuffers(self.layout, self.plan.lanes, dtypes, device, n_slots)
        self._host = HostArena(blocks, nbytes,
                               {s: dtypes[self.layout.subgroups[s].bucket] for s in blocks},
                               pin=cfg.pin_memory and device.type == "cuda")
        self._adopt_params()
        self._grads = GradRouter(self.layout, self.plan.lanes, self._params, self._dev,
                                 self._host.grad, self._sync, self._tl)
        self._lanes = Lanes(self.layout, self.plan, self._dev, self._host, self._grads, self._sync, self._tl)
        self._early = None
        if cfg.overlap_backward:
            self._early = EarlyUpdates(self._lanes.cpu_update, self._hyper, device)
            weakref.finalize(self, self._early.close)  # the worker ends with the optimizer
            # The first step may re-size the lanes (gpu_fraction="auto"): no early update before it.
            self._early.enabled = not self._sizing
            self._grads.early = self._early
        self._steps: List[int] = [0] * len(self.param_groups)
        self.last_grad_norm: Optional[float] = None
        self.replans: List[dict] = []  # {"step", "plan", "predicted_step_s"} of every re-plan
        self.last_overlapped = 0  # CPU subgroups the last step updated during backward
        self._itemsize = dtypes[0].itemsize
        self._ready = True

    # -- setup ---------------------------------------------------------------------------------
    def _make_plan(self, itemsize: int):
        """The plan the config asks for; with a calibration of this machine, stride="auto" is the
        performance model's choice (share and threads, resident share as configured) and every
        plan carries its predicted update-phase time."""
        cfg, calib = self.config, self.calibration
        plan = make_plan(self.layout, placement=cfg.placement, stride=cfg.stride,
                         gpu_fraction=cfg.fixed_fraction, cpu_threads=cfg.cpu_threads or default_threads(),
                         staging_slots=cfg.staging_slots)
        if calib is None:
            return plan
        if cfg.placement == "interleaved" and cfg.stride == "auto":
            plan, _ = perfmodel.choose(plan.numels, calib, free_gpu_bytes=float("inf"),
                                       max_threads=cfg.cpu_threads or default_threads(),
                                       staging_slots=cfg.staging_slots, resident=len(plan.resident),
                                       grad_bytes=itemsize, param_bytes=itemsize)
            return plan.replace(source="perfmodel")
        pred = perfmodel.predict(plan, calib, grad_bytes=itemsize, param_bytes=itemsize)
        return plan.replace(predicted_step_s=pred.total_s)

    def _adopt_params(self) -> None:
        """Move the parameters into the flat buffers and seed the fp32 master weights."""
        for slot, p in self._params.items():
            flat = self._dev.params[slot.bucket][slot.offset: slot.offset + slot.numel]
            flat.copy_(p.detach().reshape(-1))
            p.data = flat.view(p.shape)
        for sg in self.layout.subgroups:
            state = self._dev.resident.get(sg.index, self._host.state.get(sg.index))
            thirds(state, sg.numel)[0].copy_(self._dev.param(self.layout, sg.index))

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_ready", False):
            # NOTE: deviation — the flat buffers and the plan are fixed at construction.
            raise NotImplementedError("dos.DeepOptimizerStates cannot add parameter groups after "
                                      "construction; pass every group to the constructor")
        super().add_param_group(param_group)

    # -- the optimizer contract -------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            validate_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        hyper = self._hyper(1)
        early = self._early
        if early is not None and early.hyper is not None:  # the CPU lane started in backward
            if early.hyper != hyper:
                early.drain()  # nothing may still run when the error reaches the caller
                raise RuntimeError("dos: the hyperparameters changed between backward and step() "
                                   "with overlap_backward=True (the CPU lane started during "
                                   "backward with the old ones): set lr etc. before backward")
            # Its head start, measured now (after the drain, the backlog counted too: all-CPU
            # plans predicted 0.01 s took 1.35 s); its backlog runs on, overlapping the GPU
            # lanes, and is drained by the update.
            window = time.perf_counter() - early.first_submit
            done, backlog = early.progress()
            h = refine.head_start(window, sum(self.layout.subgroups[s].numel for s in done), backlog,
                                     self.calibration, self.plan.cpu_threads)
            self.head_start_s = h if not self.head_start_s else 0.5 * (self.head_start_s + h)
        self._steps = [n + 1 for n in self._steps]
        self._tl.begin(max(self._steps), earlier=self._grads.take_spans())
        if self._sizing:
            self._sizing = False
            self._size_resident()
        elif self._refining and early is None:
            self._refine()  # on the previous step's lane times, for this step
        scale_t, scale = self._clip_scale()
        done = self._lanes.run(hyper, scale_t, scale, early.drain if early is not None else None)
        self.last_overlapped = len(done)
        if early is not None:
            self._tl.add(early.take_spans())  # the early updates' spans, once all have ended
        self._tl.finish()
        if early is not None:
            # With overlap_backward, re-plan after the update instead: the next backward starts
            # the CPU lane by the plan in force (a re-plan at the next step's start could hand
            # an already-updated subgroup to the GPU). It uses the previous step's times too.
            if self._refining:
                self._refine()
            early.reset()
            early.enabled = True
        return loss

    def _hyper(self, ahead: int = 0) -> List[Hyper]:
        """Each bucket's AdamW hyperparameters for the step `ahead` steps after the last one."""
        out = []
        for b in self.layout.buckets:
            group = self.param_groups[b.group]
            out.append(Hyper(lr=float(group["lr"]), beta1=float(group["betas"][0]),
                             beta2=float(group["betas"][1]), eps=float(group["eps"]),
                             weight_decay=float(group["weight_decay"]),
                             step=self._steps[b.group] + ahead))
        return out

    @contextlib.contextmanager
    def accumulate(self):
        """Gradient accumulation with `overlap_backward=True`: a backward inside does not start
        the update (wrap every micro-batch but the last). Without overlap_backward: nothing."""
        early = self._early
        if early is None:
            yield
            return
        early.paused += 1
        try:
            yield
        finally:
            early.paused -= 1
            if not early.paused:
                self._grads.restart_counts()

    def _refine(self) -> None:
        """Online refinement: the last step's lane times move the calibrated rates; a plan
        predicted >5% faster (same resident share and slots: nothing on the GPU is reallocated)
        replaces the current one. Safe at this point: gradients routed by the old plan are
        re-sent by `flush` where the new one puts them on the CPU."""
        totals = self._tl.totals()
        if not totals:
            return
        kw = dict(grad_bytes=self._itemsize, param_bytes=self._itemsize)
        self.calibration = refine.update(self.calibration, self.plan, totals, **kw)
        # The search runs on the host, in the CPU lane's path (a full one took 54-93 ms at 3B-7B
        # on a 2-core machine; auto runs on the H200 host spent ~0.11 s more per step than a fixed
        # stride): search again only once the rates moved (they settle within a few steps).
        # With overlap_backward the backward time the CPU lane overlaps (its head start) counts too.
        h, h_searched = self.head_start_s, self._searched_head_start
        if (refine.drift(self._searched, self.calibration) < REPLAN_DRIFT
                and abs(h - h_searched) <= REPLAN_DRIFT * max(h, h_searched)):
            return
        self._searched, self._searched_head_start = self.calibration, h
        better = refine.replan(self.plan, self.calibration, staging_slots=len(self._dev.slots),
                                  max_threads=self.config.cpu_threads or default_threads(),
                                  head_start_s=h, **kw)
        if better is not None:
            self._set_plan(better[0].replace(source="replan"))

    def _size_resident(self) -> None:
        """gpu_fraction="auto", at the first step: the performance model's plan for the GPU memory
        left free at the peak of the iteration just run (resident share, staging slots, stride
        where it is "auto", threads); the new resident subgroups move to the GPU and their host
        blocks are released. Runs once, outside the steady-state loop (it synchronizes)."""
        free = _free_device_bytes(self._dev)
        if free is None:
            return
        cfg, layout = self.config, self.layout
        if cfg.placement == "static":
            staged_shares = [Fraction(0)]
        else:
            staged_shares = None if cfg.stride == "auto" else [Fraction(1, cfg.stride)]
        try:
            plan, _ = perfmodel.choose(
                self.plan.numels, self.calibration, free_gpu_bytes=free,
                max_threads=cfg.cpu_threads or default_threads(), staging_slots=len(self._dev.slots),
                subgroup_numel=layout.subgroup_numel, grad_bytes=self._itemsize,
                param_bytes=self._itemsize, placement=cfg.placement, staged_shares=staged_shares)
        except ValueError:
            return  # nothing of that shape fits: keep the plan
        self._sync.synchronize()  # no copy still reads a slot or a host block given up below
        self._lanes.keep_slots(plan.staging_slots if plan.staged_order else 0)
        for s in plan.resident:
            if s not in self._dev.resident:
                self._dev.add_resident(s, self._host.state[s])
                self._host.release(s)
        self._set_plan(plan.replace(source="perfmodel"), free_gpu_bytes=free)

    def _set_plan(self, plan, free_gpu_bytes: Optional[float] = None) -> None:
        if (plan.resident != tuple(sorted(self._dev.resident))
                or plan.staging_slots > len(self._dev.slots)):
            raise ValueError("a new plan may move subgroups between the CPU and staged lanes only")
        self.plan = self._lanes.plan = plan
        self._grads.lanes = plan.lanes
        entry = {"step": max(self._steps), "plan": plan.to_record(),
                 "predicted_step_s": plan.predicted_step_s}
        if free_gpu_bytes is not None:
            entry["free_gpu_gib"] = round(free_gpu_bytes / 2**30, 3)
        self.replans.append(entry)

    def _clip_scale(self):
        """Gradient divisor for exact global clipping over every gradient, wherever it lives."""
        if self.config.max_grad_norm is None:
            return None, 1.0
        # Every gradient is complete in the flat device buffers (CPU-lane ones are copies of them).
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in self._dev.grads])
        total = torch.linalg.vector_norm(norms)
        scale_t = 1.0 / (self.config.max_grad_norm / (total + 1e-6)).clamp(max=1.0)
        total_h, scale = torch.stack([total, scale_t]).tolist()  # one sync: the CPU lane needs it
        self.last_grad_norm = total_h
        return scale_t, scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        # NOTE: deviation — gradients stay allocated (views of the flat buffers) and are zeroed,
        # whatever `set_to_none` says.
        self._no_early_updates("zero_grad()")
        self._grads.zero_()

    def state_dict(self) -> dict:
        self._no_early_updates("state_dict()")
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        self._no_early_updates("load_state_dict()")
        checkpoint.load_state_dict(self, state_dict)

    def _no_early_updates(self, what: str) -> None:
        """Between an overlapped backward and its step() the state is half updated."""
        if self._early is not None and self._early.drain():
            raise RuntimeError(f"dos: {what} between backward and step() with overlap_backward=True: "
                               "part of this step's update has already run; call step() first")

    # -- reporting --------------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the optimizer allocated (the arena)."""
        return self._host.nbytes

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_bytes / max(1, self.layout.n_params)

    @property
    def device_bytes(self) -> int:
        """Bytes of accelerator memory the optimizer's buffers hold (params and grads included)."""
        return self._dev.nbytes

    def timeline(self) -> List[dict]:
        """Per-subgroup lane spans of the last step (empty unless trace=True)."""
        return list(self._tl.last)

    def describe(self) -> dict:
        """Everything a run record needs to know about this optimizer."""
        return {"plan": self.plan.to_record(), "config": self.config.to_record(),
                "cpu_impl": adam.cpu_impl(), "host_bytes": self.host_bytes,
                "host_bytes_per_param": round(self.host_bytes_per_param, 4),
                "n_params": self.layout.n_params, "online": self.online_record()}

    def online_record(self) -> dict:
        """What online planning did: each re-plan (step, stride, shares, threads, prediction) and
        the head start it last planned with (overlap_backward)."""
        keep = ("stride", "staged_share", "resident_fraction", "cpu_threads", "staging_slots", "source")
        return {"head_start_s": round(self.head_start_s, 6), "last_overlapped": self.last_overlapped,
                "replans": [dict({k: e["plan"].get(k) for k in keep}, step=e["step"],
                                 predicted_step_s=e["predicted_step_s"],
                                 **({"free_gpu_gib": e["free_gpu_gib"]} if "free_gpu_gib" in e else {}))
                            for e in self.replans]}

    def close(self) -> None:
        """Release the hooks and unpin the host memory (the optimizer is unusable afterwards)."""
        if self._early is not None:
            self._early.close()
        self._sync.synchronize()  # no copy may still touch the memory we unpin
        self._grads.remove()
        self._host.close()


def _calibration(device: torch.device):
    """This machine's cached calibration (`python -m dos calibrate`), for CUDA parameters."""
    if device.type != "cuda" or os.environ.get("DOS_NO_CALIBRATION"):
        return None
    from .calibrate import load_or_none

    return load_or_none()


def _free_device_bytes(dev) -> Optional[float]:
    """GPU memory the optimizer may still take for the rest of the run: what the iteration's peak
    (the allocator's reservation) left free under the process's cap and on the device, minus a
    margin, plus what its staging slots and scratch hold now (a new plan may spend it otherwise).
    None on a CPU device."""
    device = dev.scratch.device
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)
    cap = total * get_fraction(device)
    peak, now = torch.cuda.max_memory_reserved(device), torch.cuda.memory_reserved(device)
    free_now, _ = torch.cuda.mem_get_info(device)
    headroom = min(cap - peak, free_now - (peak - now))
    margin = max(2**30, 0.03 * cap)
    return max(0.0, headroom - margin) + dev.transient_bytes


def _check_params(trainable: List[List[torch.Tensor]]) -> torch.device:
    flat = [p for ps in trainable for p in ps]
    if not flat:
        raise ValueError("dos.DeepOptimizerStates got no trainable parameters (all have "
                         "requires_grad=False)")
    for p in flat:
        if p.is_sparse or p.layout != torch.strided:
            raise ValueError(f"dos.DeepOptimizerStates does not support sparse parameters "
                             f"(got layout {p.layout})")
        if p.is_complex():
            raise ValueError("dos.DeepOptimizerStates does not support complex parameters")
        if p.dtype not in _DTYPES:
            raise ValueError(f"dos.DeepOptimizerStates supports parameters of dtype "
                             f"{[str(d) for d in _DTYPES]}, got {p.dtype}")
    devices = sorted({str(p.device) for p in flat})
    if len(devices) > 1:
        raise ValueError(f"dos.DeepOptimizerStates needs all trainable parameters on one device, "
                         f"got {devices}")
    device = flat[0].device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"dos.DeepOptimizerStates runs on CUDA or CPU parameters, got {device}")
    return device
