"""DeepOptimizerStates: a `torch.optim.Optimizer` whose AdamW state lives in host memory and is
updated by the CPU and the GPU at the same time, as the Plan says.

Construct it after the model is on its device: the trainable parameters become aliases of ranges
of flat per-bucket buffers, so that each subgroup's weights and gradients move in one copy; what
clients do to them between backward and step() is honoured as torch.optim.AdamW would
(dos/params.py, docs/DESIGN.md §3.5).
"""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional

import torch

from . import adam, checkpoint, state_kernels, surface
from .binding import make_binding
from .buffers import DeviceBuffers, HostArena, arena_blocks
from .config import EngineConfig
from .cpu_lane import make_cpu_lane
from .grads import GradRouter
from .lanes import Hyper, Lanes
from .partition import ParamSlot, partition
from .plan import STAGED
from .planner import Planner
from .state_format import StateViews, set_master_, state_format
from .streams import make_sync
from .trace import Timeline

class DeepOptimizerStates(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, `torch.optim.AdamW` semantics) with offloaded state.

    Args beyond AdamW's are those of `dos.config.EngineConfig`.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, placement: str = "interleaved", stride="auto",
                 gpu_fraction: float = 0.0, subgroup_numel: Optional[int] = None,
                 max_grad_norm: Optional[float] = None, cpu_threads: Optional[int] = None,
                 staging_slots: int = 3, replan: bool = True, trace: bool = False, pin_memory: bool = True,
                 host_memory_limit_gib: Optional[float] = None, overlap_backward: bool = False,
                 state_dtype: str = "fp32", grad_ring: Optional[int] = None,
                 amsgrad: bool = False, maximize: bool = False, foreach: Optional[bool] = None,
                 fused: Optional[bool] = None, capturable: bool = False, differentiable: bool = False):
        # dos.surface: torch.optim.AdamW's flags (amsgrad/maximize/differentiable refused, the
        # others ignored) and tensor lr/betas (as floats)
        torch_keys = surface.torch_keys(foreach, fused, capturable, differentiable)
        surface.check_group(dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                 **dict(torch_keys, amsgrad=amsgrad, maximize=maximize)), "the arguments")
        lr, betas = surface.as_float(lr), tuple(surface.as_float(b, "betas") for b in betas)
        self.config = cfg = EngineConfig(
            placement=placement, stride=stride, gpu_fraction=gpu_fraction, subgroup_numel=subgroup_numel,
            max_grad_norm=max_grad_norm, cpu_threads=cpu_threads, staging_slots=staging_slots,
            replan=replan, trace=trace, pin_memory=pin_memory, host_memory_limit_gib=host_memory_limit_gib,
            overlap_backward=overlap_backward, state_dtype=state_dtype, grad_ring=grad_ring)
        self.state_format = fmt = state_format(cfg.state_dtype)
        self._ready = False
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      **torch_keys))
        self.state = checkpoint.LiveState(self)  # torch's `opt.state`, read from the live storage
        self._validate_groups()
        # a parameter repeated in a group (torch warns) is laid out once
        trainable = [list({id(p): p for p in g["params"] if p.requires_grad}.values())
                     for g in self.param_groups]
        device = surface.check_params(trainable)
        # binding (FSDP2): plain parameters become aliases of the flat buffers; DTensor ones are copied
        self.binding = binding = make_binding([p for ps in trainable for p in ps], overlap_backward)
        self.layout = partition([[(binding.local(p).numel(), str(p.dtype)) for p in ps]
                                 for ps in trainable], cfg.subgroup_numel)
        self._params = {slot: trainable[slot.group][slot.index] for slot in self.layout.slots()}
        dtypes = [trainable[b.slots[0].group][b.slots[0].index].dtype for b in self.layout.buckets]
        fmt.check_param_dtypes(dtypes)
        self.planner = planner = Planner(cfg, self.layout, dtypes[0].itemsize, device,
                                         local_ranks=binding.local_ranks())
        blocks, nbytes = arena_blocks(self.layout, planner.plan.lanes, [d.itemsize for d in dtypes], fmt,
                                      cfg.grad_ring)
        # before any allocation; resident-first (gpu_fraction="auto"): a lower bound now, the exact check once
        # the first iteration has sized the resident share (Planner.materialize); + grad_ring's slots
        binding.preflight(planner.host_need_bound(blocks) + nbytes - sum(b.nbytes for b in blocks.values()),
                          self.layout.n_params, cfg.host_memory_limit_gib)
        self._sync = make_sync(device, timing=cfg.trace or planner.refining)
        self._tl = Timeline(self._sync, trace=cfg.trace, measure=planner.refining)
        n_slots = planner.plan.staging_slots if STAGED in planner.plan.lanes else 0
        if planner.may_stage_later:
            n_slots = max(n_slots, cfg.staging_slots)
        self._dev = DeviceBuffers(self.layout, planner.plan.lanes, dtypes, device, n_slots, fmt)
        self._host = HostArena(blocks, nbytes,
                               {s: dtypes[self.layout.subgroups[s].bucket] for s in blocks},
                               pin=cfg.pin_memory and device.type == "cuda" and not planner.deferred_host,
                               fmt=fmt, ring=cfg.grad_ring)
        binding.adopt(self, self._params, self._dev)
        self._dev.alloc_grads()  # after adopt: the constructor's GPU peak is 2x the weights
        self._grads = GradRouter(self.layout, planner.plan.lanes, binding.hooked(self._params), self._dev,
                                 self._host.grad, self._sync, self._tl)
        self._grads.send_early = not planner.deferred_host  # the host blocks are not real yet
        self._lanes = Lanes(self.layout, planner.plan, self._dev, self._host, self._grads, self._sync,
                            self._tl)
        binding.attach(self._grads, self._lanes)  # per-parameter steps; plain tensors: dos.params
        planner.attach(self._lanes, self._dev, self._host, self._sync, self._tl)
        # The first step may re-size the lanes (gpu_fraction="auto"): no early update before it.
        self._cpu_lane = make_cpu_lane(cfg.overlap_backward, self._lanes, self._hyper, self._grads,
                                       device, enabled=not planner.sizing)
        self._grads.cpu_lane = self._cpu_lane
        weakref.finalize(self, self._cpu_lane.close)  # a worker thread ends with the optimizer
        self._steps: List[int] = [0] * len(self.param_groups)
        self.last_grad_norm: Optional[float] = None
        self.last_overlapped = 0  # CPU subgroups the last step updated during backward
        self._ready = True

    @property
    def plan(self):
        """The Plan in force (the planner's)."""
        return self.planner.plan

    @property
    def calibration(self):
        return self.planner.calibration

    @property
    def head_start_s(self) -> float:
        """Backward seconds the CPU lane overlaps (overlap_backward; a moving average)."""
        return self.planner.head_start_s

    @property
    def replans(self) -> List[dict]:
        return self.planner.replans

    def _seed_master(self) -> None:
        """The fp32 master weights from the flat parameter buffers (the binding filled them);
        resident-first: at the first step, once the resident share is known (Planner.materialize)."""
        for sg in ([] if self.planner.deferred_host else self.layout.subgroups):
            set_master_(self.state_format, self.state_views(sg.index), self._dev.param(self.layout, sg.index))

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
        self._validate_groups()
        hyper = self._hyper(1)
        self._cpu_lane.check_hyper(hyper)
        progress = self._cpu_lane.progress()  # where a lane started in backward stands now
        self._steps = [n + 1 for n in self._steps]
        step = max(self._steps)
        self._tl.begin(step, earlier=self._grads.take_spans())
        self.planner.before_step(step, progress, self._cpu_lane.starts_in_backward)
        # What clients did since backward (plain: dos.params; FSDP2: the gradient shards come in)
        self.binding.before_update(self.param_groups, self._cpu_lane)
        scale_t, scale = self._clip_scale()
        self.last_overlapped = len(self._lanes.run(hyper, scale_t, scale, self._cpu_lane))
        self.binding.after_update()  # per-parameter steps advance (FSDP2: the weights go out)
        self._tl.finish()
        self.planner.after_step(step, self._cpu_lane.starts_in_backward)
        self._cpu_lane.after_step()
        return loss

    def _validate_groups(self) -> None:
        for group in self.param_groups:
            surface.check_group(group)  # flags set through param_groups are refused here too

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

    def accumulate(self):
        """Gradient accumulation with `overlap_backward=True`: a backward inside does not start
        the update (wrap every micro-batch but the last). Without overlap_backward: nothing."""
        return self._cpu_lane.paused()

    def _clip_scale(self):
        """Gradient divisor for exact global clipping over every gradient, wherever it lives."""
        if self.config.max_grad_norm is None:
            return None, 1.0
        # Every gradient is complete in the flat device buffers (CPU-lane ones are copies of them).
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in self._dev.grads])
        total = self.binding.total_norm(norms)  # binding (FSDP2): over every rank's shards
        scale_t = 1.0 / (self.config.max_grad_norm / (total + 1e-6)).clamp(max=1.0)
        total_h, scale = torch.stack([total, scale_t]).tolist()  # one sync: the CPU lane needs it
        self.last_grad_norm = total_h
        return scale_t, scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.require_idle("zero_grad()")
        self.binding.zero_grad(self.param_groups, set_to_none)  # torch's semantics

    def state_dict(self) -> dict:
        self.require_idle("state_dict()")
        return surface.state_dict_with_hooks(self, lambda: checkpoint.state_dict(self))

    def load_state_dict(self, state_dict: dict) -> None:
        self.require_idle("load_state_dict()")
        # NOTE: resident-first sizing has not run yet: the whole state goes to the host first
        # (its resident share moves to the GPU at the first step, as before resident-first)
        self.planner.materialize()
        surface.load_state_dict_with_hooks(self, state_dict, lambda sd: checkpoint.load_state_dict(self, sd))

    def require_idle(self, what: str) -> None:
        """overlap_backward: raises between a backward and its step() (the state is half updated)."""
        self._cpu_lane.require_idle(what)

    def __getstate__(self):
        surface.refuse_copy(self)  # NOTE: deviation — TypeError (see dos/surface.py)

    def __deepcopy__(self, memo):
        surface.refuse_copy(self)

    # -- the state, for checkpointing ---------------------------------------------------------------
    def param_slots(self) -> Dict[ParamSlot, torch.nn.Parameter]:
        """Each trainable parameter's place in the layout (group, index among the group's
        trainable parameters, bucket, offset)."""
        return dict(self._params)

    def state_storage(self, s: int) -> torch.Tensor:
        """Subgroup s's state bytes (uint8; `state_views` reads them), where they live (the GPU
        for a resident subgroup, the host arena otherwise). Call `wait_host_state()` before reading."""
        return self._dev.resident[s] if s in self._dev.resident else self._host.state[s]

    def state_views(self, s: int) -> StateViews:
        """Subgroup s's master, exp_avg, exp_avg_sq (and int8 scales) in `state_format`."""
        return self.state_format.views(self.state_storage(s), self.layout.subgroups[s].numel)

    def wait_host_state(self) -> None:
        """Block until every write-back of host state from the GPU has landed."""
        self._lanes.wait_host_state()

    @property
    def param_steps(self) -> Dict[ParamSlot, int]:
        """Steps taken by each parameter (as torch: not by one without a gradient); live."""
        return self.binding.track.steps

    @property
    def group_steps(self) -> List[int]:
        """Steps taken per parameter group (step() calls; each parameter's own: `param_steps`)."""
        return list(self._steps)

    @group_steps.setter
    def group_steps(self, steps: List[int]) -> None:
        if len(steps) != len(self._steps):
            raise ValueError(f"{len(steps)} step counts for {len(self._steps)} parameter groups")
        self._steps = [int(n) for n in steps]

    # -- reporting --------------------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the optimizer allocated (the arena, grad_ring's slots included)."""
        return self._host.nbytes

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_bytes / max(1, self.layout.n_params)

    def timeline(self) -> List[dict]:
        """Per-subgroup lane spans of the last step (empty unless trace=True)."""
        return list(self._tl.last)

    def describe(self) -> dict:
        """Everything a run record needs to know about this optimizer."""
        return {"plan": self.plan.to_record(), "config": self.config.to_record(),
                "cpu_impl": adam.cpu_impl(), "host_bytes": self.host_bytes,
                "state_dtype": self.state_format.name, "upload_thread": self._lanes.uploader is not None,
                "device_state_impl": state_kernels.impl_name(self._dev.scratch, self.state_format.name),
                "host_bytes_per_param": round(self.host_bytes_per_param, 4),
                "n_params": self.layout.n_params, "online": self.online_record(), "host_pin": self._host.pin_record,
                "clients": self.binding.track.record(),  # dos.params: re-sends, re-syncs, skips
                # ranks sharing this host (FSDP2 / DDP): the calibration they plan with (§3.4)
                **({"calibration": self.planner.calibration_record()}
                   if self.planner.local_ranks > 1 else {})}

    def online_record(self) -> dict:
        """What online planning did (`Planner.record`)."""
        return self.planner.record(self.last_overlapped)

    def close(self) -> None:
        """Release the hooks and give back the host arena and the GPU state (the parameters stay
        where they are; the optimizer is unusable afterwards)."""
        self._cpu_lane.close()
        self._lanes.close()  # its upload thread (dos/uploads.py)
        self._sync.synchronize()  # no copy may still touch the memory we give back
        self._grads.remove()
        self._host.close()
        self._dev.resident.clear()
        self._dev.keep_slots(0)

