"""One benchmark run, as data: a frozen, validated `RunSpec` and its stable `run_id`.

Light on imports on purpose: the sweep parent validates whole grids before anything heavy loads.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Optional, Union

SYSTEMS = {
    "dos": "Deep Optimizer States (this package): placement cpu | static | interleaved | gpu",
    "torch-gpu": "no offload: bf16 model, fp32 master weights, torch fused AdamW on the GPU",
    "torch-cpu": "the torch-gpu baseline on the CPU device (CI stand-in; no offload exists there)",
    "deepspeed-zero3": "DeepSpeed ZeRO-3 without offload (DESIGN.md §8's 'no offload' column)",
    "deepspeed-zero-offload": "DeepSpeed ZeRO-3 + CPU optimizer offload (ratio 1.0), DESIGN.md §8's settings",
    "deepspeed-zero3-offload": "DeepSpeed ZeRO-3 + CPU optimizer offload tuned for one GPU (parameters "
                               "persistent, large prefetch / live limits; systems.ZERO3_ONE_GPU)",
    "deepspeed-zero2-offload": "DeepSpeed ZeRO-2 + CPU optimizer offload (the original ZeRO-Offload): "
                               "pinned, overlap_comm, contiguous gradients, tuned buckets",
    "deepspeed-zero2-offload-bf16": "deepspeed-zero2-offload in DeepSpeed's low-precision mode: bf16 "
                                    "master weights, gradients and optimizer states",
    "deepspeed-twinflow": "DeepSpeed ZeRO-3 partial offload: `ratio` of the optimizer on the CPU",
    "deepspeed-superoffload": "DeepSpeed ZeRO-3 with offload_optimizer.super_offload",
    "torchao-cpu-offload": "torchao.optim.CPUOffloadOptimizer around torch AdamW",
}
DS_OFFLOAD = ("deepspeed-zero-offload", "deepspeed-zero3-offload", "deepspeed-zero2-offload",
              "deepspeed-zero2-offload-bf16", "deepspeed-superoffload")
"""DeepSpeed systems that offload the whole optimizer (ratio 1.0)."""
CUDA_ONLY = {"torch-gpu", "deepspeed-superoffload", "torchao-cpu-offload"}
MULTI_GPU = {"dos"}
"""Systems other than DeepSpeed's that run with gpus > 1 (dos through FSDP2)."""
PLACEMENTS = ("cpu", "static", "interleaved", "gpu")
DATA = ("synthetic", "stdlib")
MOMENTS = ("fp32", "bf16", "int8", "bf16-split")
"""dos's moment formats (dos.state_format.STATE_DTYPES; not imported here: this module stays light)."""
DEVICES = ("auto", "cuda", "cpu")


class ConfigError(ValueError):
    """A run or sweep that cannot be: raised before anything runs, with what to change."""


@dataclass(frozen=True)
class RunSpec:
    """Everything that defines one run. Fields left None take the system's meaning of 'not used'."""

    system: str
    """One of `SYSTEMS`."""
    model: str = "tiny"
    """Preset name (dos.lab.bench.models.PRESETS)."""
    model_overrides: Optional[dict] = None
    """Preset fields to change, e.g. {"vocab": 256} for the stdlib corpus on a large shape."""
    device: str = "auto"
    """"cuda", "cpu" or "auto" (cuda when available)."""
    seq_len: int = 2048
    micro_batch: int = 1
    gpus: int = 1
    """GPUs (one process each, launched with torchrun by dos.lab.bench.run): dos wraps the model with
    FSDP2 (`fully_shard` per decoder layer and the root), DeepSpeed runs its engine on N ranks. On
    device "cpu" the ranks are N gloo processes (CI)."""
    dtype: str = "bf16"
    """Model parameter dtype: "bf16" (mixed precision, fp32 optimizer state) or "fp32"."""
    placement: Optional[str] = None
    """dos only: cpu | static | interleaved | gpu."""
    stride: Optional[Union[int, str]] = None
    """dos interleaved only: update stride k >= 1 or "auto" (default)."""
    gpu_fraction: Optional[Union[float, str]] = None
    """dos static/interleaved: share of the optimizer state resident on the GPU, or "auto" (sized by
    the performance model from the GPU memory free at the first step's peak)."""
    ratio: Optional[float] = None
    """DeepSpeed: share of the optimizer state on the CPU (TwinFlow's knob; 1.0 = full offload)."""
    subgroup_numel: Optional[int] = None
    """dos: elements per subgroup (None: the engine chooses)."""
    cpu_threads: Optional[int] = None
    """dos: CPU-lane threads (None: the engine chooses)."""
    staging_slots: Optional[int] = None
    """dos: GPU staging slots (None: the engine's default)."""
    overlap_backward: Optional[bool] = None
    """dos: start the CPU lane during backward (None: off; needs max_grad_norm None)."""
    grad_ring: Optional[int] = None
    """dos: host gradient slots shared by the CPU-lane subgroups, `DeepOptimizerStates(grad_ring=K)`
    (K >= 2; None: one per subgroup): 2 B less host memory per parameter (issue 17, criterion 5)."""
    moments: Optional[str] = None
    """dos: how the AdamW moments are stored, `DeepOptimizerStates(state_dtype=...)` (issue 17):
    "fp32", "bf16" (round to nearest even), "int8" (block-quantized, 2048-element blocks) or
    "bf16-split" (bf16 moments, the master as its bf16 weight and a remainder); the master weights
    and the math stay fp32. None: the engine's default (fp32). Named `moments`, not
    `state_dtype`, beside the method `state_dtype()` (what the row's `state_dtype` column says)."""
    cpu_schedule: Optional[str] = None
    """dos: how the CPU kernel's threads share a call, DOS_CSRC_SCHEDULE: "dynamic" chunks (None:
    the default) or "static" fixed per-thread ranges (the kernel before 2026-12-02): in-situ A/B
    runs of the two in one batch (the row's cpu_impl ends in "-static" for the latter)."""
    sub_group_size: Optional[int] = None
    """DeepSpeed ZeRO-3 sub_group_size (None: 1e8, as in DESIGN.md §8)."""
    ds_zero: Optional[dict] = None
    """DeepSpeed: keys merged over the system's zero_optimization section (tuning sweeps)."""
    max_grad_norm: Optional[float] = None
    """Global gradient clipping (None: none) for every system that supports it."""
    clip_by: Optional[str] = None
    """dos with max_grad_norm: who clips. "engine" (None: dos's own max_grad_norm, the fast path) or
    "client" (torch.nn.utils.clip_grad_norm_ before step(), as transformers.Trainer and accelerate
    do: dos re-sends or defers the gradients the client changed, DESIGN.md §3.5)."""
    gpu_mem_cap_gib: Optional[float] = None
    """Emulate a smaller GPU: torch.cuda.set_per_process_memory_fraction(cap / total)."""
    warmup: int = 2
    steps: int = 5
    """Measured steps after the warm-up; the row holds their medians."""
    data: str = "synthetic"
    """"synthetic" tokens (throughput) or the "stdlib" byte corpus (convergence; vocab 256)."""
    seed: int = 0
    lr: float = 1e-4
    weight_decay: float = 0.01
    checkpointing: bool = True
    """Activation checkpointing of every decoder layer."""
    trace: bool = True
    """dos: record the per-subgroup lane timeline (adds one synchronization per step)."""
    nvml_hz: float = 100.0
    """Sampling rate of the NVML / host-memory sampler."""
    repeat: Optional[int] = None
    """Which repetition of the same configuration (sweep `repeat: N`: 1..N, round-robin); None for a
    single run. Only the run_id (and the row's `repeat`) differ: seed and data are the same."""

    def __post_init__(self):
        _validate(self)
        defaults = {}
        if self.system == "dos":
            defaults = {"gpu_fraction": 0.0, "stride": "auto" if self.placement == "interleaved" else None}
        elif self.system in DS_OFFLOAD:
            defaults = {"ratio": 1.0}
        if self.system.startswith("deepspeed") and not self.system.startswith("deepspeed-zero2"):
            defaults["sub_group_size"] = 100_000_000
        for k, v in defaults.items():
            if getattr(self, k) is None:
                object.__setattr__(self, k, v)

    # ------------------------------------------------------------ identity
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def run_id(self) -> str:
        """Stable hash of the configuration: None fields are dropped, so adding an optional field
        later leaves old ids (and so the resume of old sweeps) unchanged."""
        d = {k: v for k, v in self.to_dict().items() if v is not None}
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    def state_dtype(self) -> str:
        """Precision of the optimizer state (master weights and moments) the system keeps: fp32 for
        dos, torch and DeepSpeed's mixed precision; bf16 for DeepSpeed's bf16 mode and for torchao
        (its state follows the parameters' dtype). The row's value comes from the built system
        where it can say (systems.*.describe); this is what the configuration implies (dos: its
        `moments`, fp32 by default)."""
        if self.system == "dos":
            return self.moments or "fp32"
        if self.system == "deepspeed-zero2-offload-bf16":
            return "bf16"
        if self.system == "torchao-cpu-offload":
            return "bf16" if self.dtype == "bf16" else "fp32"
        return "fp32"

    def label(self) -> str:
        parts = [self.system]
        if self.placement:
            parts.append(self.placement)
        if self.stride is not None:
            parts.append(f"k={self.stride}")
        if self.gpu_fraction:
            parts.append(f"f={self.gpu_fraction}")
        if self.moments:
            parts.append(f"moments={self.moments}")
        if self.overlap_backward:
            parts.append("overlap")
        if self.grad_ring:
            parts.append(f"ring={self.grad_ring}")
        if self.clip_by == "client":
            parts.append("client-clip")
        if self.cpu_schedule:
            parts.append(f"sched={self.cpu_schedule}")
        if self.system == "deepspeed-twinflow":
            parts.append(f"r={self.ratio}")
        # an overridden preset is another shape: the label says which, not the preset's name alone
        model = self.model + ("+" + ",".join(f"{k}={v}" for k, v in sorted(self.model_overrides.items()))
                              if self.model_overrides else "")
        parts += [model, f"s{self.seq_len}", f"mb{self.micro_batch}"]
        if self.gpu_mem_cap_gib:
            parts.append(f"cap{self.gpu_mem_cap_gib:g}G")
        if self.repeat is not None:
            parts.append(f"#{self.repeat}")
        return " ".join(parts)

    @classmethod
    def from_dict(cls, d: dict) -> "RunSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown run key(s) {unknown}; known keys: {sorted(known)}")
        if "system" not in d:
            raise ConfigError("a run needs a 'system' (one of: " + ", ".join(SYSTEMS) + ")")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(str(e)) from None


def _check_type(name, value, types, what):
    if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise ConfigError(f"{name} must be {what}, got {value!r}")


def _validate(s: RunSpec) -> None:
    if s.system not in SYSTEMS:
        raise ConfigError(f"unknown system {s.system!r}; known systems: {', '.join(SYSTEMS)}")
    for name in ("seq_len", "micro_batch", "gpus", "steps"):
        v = getattr(s, name)
        _check_type(name, v, (int,), "an int >= 1")
        if v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
    _check_type("warmup", s.warmup, (int,), "an int >= 0")
    if s.warmup < 0:
        raise ConfigError(f"warmup must be >= 0, got {s.warmup}")
    if not isinstance(s.model, str):
        raise ConfigError(f"model must be a preset name, got {s.model!r}")
    from dos.lab.bench.models import PRESETS, preset  # pure-Python dataclasses, no model code
    if s.model not in PRESETS:
        raise ConfigError(f"unknown model preset {s.model!r}; known: {', '.join(PRESETS)}")
    try:
        preset(s.model, s.model_overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    if s.device not in DEVICES:
        raise ConfigError(f"device must be one of {DEVICES}, got {s.device!r}")
    if s.dtype not in ("bf16", "fp32"):
        raise ConfigError(f"dtype must be 'bf16' or 'fp32', got {s.dtype!r}")
    if s.data not in DATA:
        raise ConfigError(f"data must be one of {DATA}, got {s.data!r}")
    if s.data == "stdlib" and preset(s.model, s.model_overrides).vocab < 256:
        raise ConfigError("data 'stdlib' is bytes: it needs a vocabulary of at least 256")
    if s.gpus > 1:
        if s.system not in MULTI_GPU and not s.system.startswith("deepspeed"):
            raise ConfigError(f"gpus={s.gpus}: {s.system} runs on one GPU only; several GPUs need "
                              "dos (FSDP2) or a DeepSpeed system")
        if s.overlap_backward:
            raise ConfigError("impossible configuration: overlap_backward is not available with "
                              "FSDP2 (gpus > 1)")
    _validate_system(s)
    if s.device == "cpu" and s.system in CUDA_ONLY:
        raise ConfigError(f"impossible configuration: {s.system} needs a CUDA GPU but device is 'cpu'"
                          + (" (use torch-cpu for the no-offload baseline on the CPU)"
                             if s.system == "torch-gpu" else ""))
    if s.device == "cuda" and s.system == "torch-cpu":
        raise ConfigError("impossible configuration: torch-cpu runs on the CPU device; use torch-gpu")
    _check_type("gpu_mem_cap_gib", s.gpu_mem_cap_gib, (int, float), "a number of GiB > 0")
    if s.gpu_mem_cap_gib is not None and (s.gpu_mem_cap_gib <= 0 or s.device == "cpu"):
        raise ConfigError(f"gpu_mem_cap_gib={s.gpu_mem_cap_gib} needs a GPU and a value > 0")
    _check_type("max_grad_norm", s.max_grad_norm, (int, float), "a number > 0")
    if s.max_grad_norm is not None and s.max_grad_norm <= 0:
        raise ConfigError(f"max_grad_norm must be > 0, got {s.max_grad_norm}")
    _check_type("lr", s.lr, (int, float), "a number >= 0")
    _check_type("nvml_hz", s.nvml_hz, (int, float), "a rate in Hz")
    if not 1 <= s.nvml_hz <= 1000:
        raise ConfigError(f"nvml_hz must be in [1, 1000], got {s.nvml_hz}")
    _check_type("repeat", s.repeat, (int,), "an int >= 1")
    if s.repeat is not None and s.repeat < 1:
        raise ConfigError(f"repeat must be >= 1, got {s.repeat}")


def _only(s: RunSpec, names, who: str):
    for n in names:
        if getattr(s, n) is not None:
            raise ConfigError(f"{n} does not apply to {who} (system {s.system!r}); remove it")


def _validate_system(s: RunSpec) -> None:
    dos_keys = ("placement", "stride", "gpu_fraction", "subgroup_numel", "cpu_threads", "staging_slots",
                "overlap_backward", "grad_ring", "clip_by", "moments", "cpu_schedule")
    if s.system == "dos":
        _only(s, ("ratio", "sub_group_size", "ds_zero"), "dos")
        if s.placement not in PLACEMENTS:
            raise ConfigError(f"dos needs placement in {PLACEMENTS}, got {s.placement!r}")
        if s.stride is not None:
            if s.placement != "interleaved":
                raise ConfigError(f"impossible configuration: stride applies to placement "
                                  f"'interleaved' only, not {s.placement!r}")
            if s.stride != "auto" and (not isinstance(s.stride, int) or isinstance(s.stride, bool)
                                       or s.stride < 1):
                raise ConfigError(f"stride must be an int >= 1 or 'auto', got {s.stride!r}")
        f = s.gpu_fraction
        if f != "auto":
            _check_type("gpu_fraction", f, (int, float), "a number in [0, 1] or 'auto'")
            if f is not None and not 0 <= f <= 1:
                raise ConfigError(f"gpu_fraction must be in [0, 1] or 'auto', got {f}")
        if f and s.placement in ("cpu", "gpu"):
            raise ConfigError(f"impossible configuration: placement {s.placement!r} takes no "
                              f"gpu_fraction (got {f}); use placement 'static' for a resident share")
        _check_type("overlap_backward", s.overlap_backward, (bool,), "true or false")
        if s.grad_ring is not None and (not isinstance(s.grad_ring, int) or isinstance(s.grad_ring, bool)
                                        or s.grad_ring < 2):
            raise ConfigError(f"grad_ring must be an int >= 2, got {s.grad_ring!r}")
        if s.grad_ring and s.overlap_backward:
            raise ConfigError("impossible configuration: grad_ring needs overlap_backward unset "
                              "(the ring's gradients go to the host in step())")
        if s.moments is not None and s.moments not in MOMENTS:
            raise ConfigError(f"moments must be one of {MOMENTS}, got {s.moments!r}")
        if s.cpu_schedule not in (None, "dynamic", "static"):
            raise ConfigError(f"cpu_schedule must be 'dynamic' or 'static', got {s.cpu_schedule!r}")
        if s.clip_by not in (None, "engine", "client"):
            raise ConfigError(f"clip_by must be 'engine' or 'client', got {s.clip_by!r}")
        if s.clip_by is not None and s.max_grad_norm is None:
            raise ConfigError("clip_by needs max_grad_norm (the norm to clip to)")
        if s.overlap_backward and s.max_grad_norm is not None:
            raise ConfigError("impossible configuration: overlap_backward needs max_grad_norm unset "
                              "(clipping needs every gradient before any update)")
        for n in ("subgroup_numel", "cpu_threads", "staging_slots"):
            _check_type(n, getattr(s, n), (int,), "an int >= 1")
            if getattr(s, n) is not None and getattr(s, n) < 1:
                raise ConfigError(f"{n} must be >= 1, got {getattr(s, n)}")
        return
    _only(s, dos_keys, "dos only")
    if s.system.startswith("deepspeed"):
        _check_type("ratio", s.ratio, (int, float), "a number in (0, 1]")
        _check_type("sub_group_size", s.sub_group_size, (int,), "an int >= 1")
        if s.ds_zero is not None and not isinstance(s.ds_zero, dict):
            raise ConfigError(f"ds_zero must be a mapping of zero_optimization keys, got {s.ds_zero!r}")
        if s.system.startswith("deepspeed-zero2"):
            _only(s, ("sub_group_size",), "ZeRO-3 only")
        if s.system == "deepspeed-zero2-offload-bf16" and s.dtype != "bf16":
            raise ConfigError("impossible configuration: deepspeed-zero2-offload-bf16 keeps bf16 master "
                              "weights: it needs dtype 'bf16'")
        if s.system == "deepspeed-twinflow":
            if s.ratio is None or not 0 < s.ratio < 1:
                raise ConfigError(f"deepspeed-twinflow needs a ratio in (0, 1) (share offloaded to the "
                                  f"CPU), got {s.ratio!r}; ratio 1.0 is deepspeed-zero-offload")
        elif s.system == "deepspeed-zero3":
            _only(s, ("ratio",), "DeepSpeed without offload")
        elif s.ratio not in (None, 1, 1.0):
            raise ConfigError(f"{s.system} offloads everything (ratio 1.0), got ratio {s.ratio}; "
                              "use deepspeed-twinflow for a partial offload")
    else:
        _only(s, ("ratio", "sub_group_size", "ds_zero"), "DeepSpeed only")
