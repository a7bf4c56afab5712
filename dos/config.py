"""Typed, frozen configuration of the engine. Serialized into every record."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

PLACEMENTS = ("interleaved", "cpu", "static", "gpu")


def validate_hparams(lr, betas, eps, weight_decay) -> None:
    """Raise ValueError for invalid AdamW hyperparameters, with torch's messages."""
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise ValueError(f"lr must be a Python number, got {type(lr).__name__} "
                         "(tensor learning rates are not supported)")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    for name, x in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not math.isfinite(float(x)):
            raise ValueError(f"Invalid {name}: {x}")


@dataclass(frozen=True)
class EngineConfig:
    """How the optimizer state is split, placed and moved. The Plan is built from it."""

    placement: str = "interleaved"
    """"interleaved" (Deep Optimizer States), "cpu" (ZeRO-Offload-like), "static"
    (TwinFlow-like: `gpu_fraction` resident, the rest on the CPU) or "gpu" (no offload)."""
    stride: Union[int, str] = "auto"
    """Update stride k >= 1 of "interleaved": every k-th non-resident subgroup is updated on the GPU;
    "auto" lets the planner choose."""
    gpu_fraction: Union[float, str] = 0.0
    """Share of the optimizer state kept resident on the GPU ("static" and "interleaved"), in [0, 1];
    or "auto": at the first step the performance model sizes the resident share (and the staging
    slots) from the GPU memory left free at the iteration's peak (CUDA with a calibration of this
    machine; on CUDA without one, as many resident subgroups as fit, the rest by the stride rule;
    on the CPU nothing is resident)."""
    subgroup_numel: Optional[int] = None
    """Elements per subgroup (None: chosen from the model size)."""
    max_grad_norm: Optional[float] = None
    """Clip the global L2 norm of all gradients to this value (None: no clipping)."""
    cpu_threads: Optional[int] = None
    """Threads of the CPU update lane (None: the cores this process may use, split evenly among the
    job's processes on this host, LOCAL_WORLD_SIZE)."""
    staging_slots: int = 3
    """GPU staging buffers for interleaved subgroups (2: double buffering; 3: H2D, update and D2H
    of three subgroups overlap)."""
    replan: bool = True
    """Online re-planning (stride="auto" with a calibration of this machine): each step's measured
    lane times refine the rates, and a plan predicted >5% faster replaces the current one."""
    trace: bool = False
    """Record a per-subgroup lane timeline of every step (CUDA events; adds one sync per step)."""
    pin_memory: bool = True
    """Page-lock the host arena (CUDA only). Off only for experiments."""
    host_memory_limit_gib: Optional[float] = None
    """Host memory the preflight may plan for (None: what the machine reports available)."""
    overlap_backward: bool = False
    """Start the CPU lane during backward: a CPU subgroup is updated (on a worker thread) as soon
    as its gradient has reached the host, while backward goes on; `step()` then runs the GPU lanes
    and whatever CPU subgroups are left. Needs `max_grad_norm=None` (clipping needs every gradient
    first) and the step's hyperparameters set before backward; with gradient accumulation, run the
    non-final micro-batches' backward inside `opt.accumulate()`."""
    state_dtype: str = "fp32"
    """Storage of the Adam moments (dos/state_format.py): "fp32" (torch.optim.AdamW exactly), "bf16"
    (round-to-nearest-even), "int8" (block-wise quantized, 2048-element blocks with an fp32
    scale each) or "bf16-split" (bf16 moments, and the fp32 master stored as its bf16 weight and
    a 16-bit remainder, dos/split_master.py: 2 B per element less host traffic on the CPU lane;
    bf16 parameters only; the weights round half away from zero at exact ties, the master is
    exact). The master weights and the math stay fp32 in every format."""
    grad_ring: Optional[int] = None
    """Host gradient slots shared by the CPU-lane subgroups (K >= 2), instead of one per subgroup:
    the host then holds only the state (and K subgroups' gradients), not 2 more bytes per
    parameter; each gradient goes down in `step()`, K subgroups ahead of the CPU lane, into the
    slot whose last occupant's weights have gone up. None: a slot per subgroup, gradients sent
    during backward. Not with overlap_backward (its updates start before step())."""

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.stride != "auto" and (not isinstance(self.stride, int) or isinstance(self.stride, bool)
                                      or self.stride < 1):
            raise ValueError(f"stride must be an int >= 1 or 'auto', got {self.stride!r}")
        f = self.gpu_fraction
        if f == "auto":
            if self.placement not in ("interleaved", "static"):
                raise ValueError(f"gpu_fraction='auto' applies to placement 'interleaved' or "
                                 f"'static', not {self.placement!r}")
        elif isinstance(f, bool) or not (isinstance(f, (int, float)) and 0.0 <= f <= 1.0):
            raise ValueError(f"gpu_fraction must be in [0, 1] or 'auto', got {f!r}")
        if self.placement == "cpu" and self.gpu_fraction:
            raise ValueError("placement='cpu' keeps no state on the GPU: gpu_fraction must be 0 "
                             "(use placement='static' for a resident share)")
        if self.subgroup_numel is not None and (not isinstance(self.subgroup_numel, int)
                                                or self.subgroup_numel < 1):
            raise ValueError(f"subgroup_numel must be a positive int or None, got {self.subgroup_numel!r}")
        if self.max_grad_norm is not None and not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ValueError(f"max_grad_norm must be a positive finite number or None, got {self.max_grad_norm!r}")
        if self.cpu_threads is not None and (not isinstance(self.cpu_threads, int) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be a positive int or None, got {self.cpu_threads!r}")
        if not isinstance(self.staging_slots, int) or self.staging_slots < 1:
            raise ValueError(f"staging_slots must be an int >= 1, got {self.staging_slots!r}")
        from .state_format import STATE_DTYPES
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}")
        if self.grad_ring is not None and (not isinstance(self.grad_ring, int) or isinstance(self.grad_ring, bool)
                                           or self.grad_ring < 2):
            raise ValueError(f"grad_ring must be an int >= 2 or None, got {self.grad_ring!r}")
        if self.grad_ring is not None and self.overlap_backward:
            raise ValueError("grad_ring needs overlap_backward=False: the ring's gradients go to the "
                             "host in step(), after backward")
        if self.overlap_backward and self.max_grad_norm is not None:
            raise ValueError("overlap_backward=True needs max_grad_norm=None: clipping needs the norm "
                             "of every gradient before any subgroup may be updated")

    @property
    def fixed_fraction(self) -> float:
        """The resident share the first plan is made with ("auto": none until the first step)."""
        return 0.0 if self.gpu_fraction == "auto" else float(self.gpu_fraction)

    def to_record(self) -> dict:
        return dataclasses.asdict(self)
