"""The sweep's preflight: whether a run can start on this machine before it is launched — a CUDA
device where it needs one, its packages, and the host memory it needs (a conservative estimate
from docs/DESIGN.md §8's facts) against what is available; a refusal becomes a `skipped` row with
the reason. `settled_preflight` waits while available memory is still growing (the previous run's
pinned memory being released), at most `SETTLE_MAX_S`. Split from dos/lab/sweep.py."""
from __future__ import annotations

import importlib.util
import os
import time
from typing import Optional

import psutil

from dos.lab.bench.spec import CUDA_ONLY, RunSpec

_GIB = 2**30
SETTLE_MAX_S = 60.0   # the preflight's longest wait for host memory still being released
SETTLE_POLL_S = 1.0
SETTLE_GROWTH_GIB = 0.5  # per poll: less growth than this, and the memory has settled
RESIDENT_GPU_SHARE = 0.95  # of the GPU, and
RESIDENT_ACT_GIB = 4.0     # GiB of activations, for the preflight's resident-first estimate
MEMORY_REASON = "host memory preflight"  # how a skipped row for want of host memory begins

DOS_STATE_BPP = {"fp32": 14.0, "bf16": 10.0, "int8": 8.0 + 8 / 2048, "bf16-split": 10.0}
"""dos's host bytes per non-resident parameter by moment format (RunSpec.moments): fp32 master, the
two moments (4 + 4, 2 + 2, or 1 + 1 with two fp32 scales per 2048-element block) and the bf16
gradient slot (dos.state_format)."""


def host_bytes_estimate(spec: RunSpec) -> tuple:
    """(bytes of host memory the run needs, how it was estimated). Conservative, from §8's facts."""
    from dos.lab.bench.models import preset

    n = preset(spec.model, spec.model_overrides).n_params()
    s = spec.system
    if s == "dos":
        fixed = _auto_resident_share(spec, n) if spec.gpu_fraction == "auto" else spec.gpu_fraction or 0.0
        share = 0.0 if spec.placement == "gpu" else 1.0 - fixed
        # grad_ring=K: the CPU lane's gradients in K shared slots, no 2 B slot per subgroup (the K
        # slots, K subgroups' worth of 2 B, are in the base's slack)
        host_bpp = (DOS_STATE_BPP[spec.moments or "fp32"] - (2.0 if spec.grad_ring else 0.0)) * share
    elif s == "deepspeed-zero2-offload":
        host_bpp = 22.0  # fp32 master + moments + fp32 gradient partition, pinned (issue 16: 20-25)
    elif s == "deepspeed-zero2-offload-bf16":
        host_bpp = 12.0  # bf16 master, moments and gradients (8), pinned staging besides
    elif s in ("deepspeed-zero-offload", "deepspeed-zero3-offload", "deepspeed-twinflow",
               "deepspeed-superoffload"):
        host_bpp = 20.0 * spec.ratio  # DeepSpeed measured 19.6 B/param at 6.7B (DESIGN.md §1-2)
    elif s == "torchao-cpu-offload":
        host_bpp = 12.0
    else:
        host_bpp = 0.0
    dev_bpp = 0.0
    if spec.device == "cpu":  # the "device" memory is host memory too
        dev_bpp = 4.0 + (16.0 if s == "torch-cpu" else DOS_STATE_BPP[spec.moments or "fp32"] - host_bpp
                         if s == "dos" else 12.0)
    base = (1.5 if spec.device == "cpu" else 3.0) + (1.0 if s.startswith("deepspeed") else 0.0)
    base *= spec.gpus  # one process per GPU; the optimizer state is sharded: its total is unchanged
    need = n * (host_bpp + dev_bpp) + base * _GIB
    how = f"{host_bpp + dev_bpp:.0f} B/param x {n / 1e9:.2f}B params + {base:.1f} GiB base" + (
        f" ({spec.gpus} processes)" if spec.gpus > 1 else "")
    return need, how


def _auto_resident_share(spec: RunSpec, n: int) -> float:
    """gpu_fraction "auto" is resident-first (dos.residency): the host holds only what the GPU
    cannot. A generous estimate of the resident share — 95% of the GPU (its cap, else the device)
    less the bf16 weights and gradients (4 B/param) and RESIDENT_ACT_GIB of activations, filled with
    state — so that the sweep skips only what cannot fit; the engine's own check after the first
    step is exact (a run refused there records its HostMemoryError). 0 without a CUDA device.
    Measured (capacity, 20.3B int8 with grad_ring 4, seq 2048, mb 1, checkpointing): the engine made
    48% resident at a 133.1 GiB peak of 139.8 (95%), ~2.9 GiB beside weights, gradients and state;
    the earlier 85% and 10 GiB estimated 20% resident for 20B bf16 and skipped it (150.9 GiB)."""
    if spec.device != "cuda" or not _cuda_available():
        return 0.0
    import torch

    total = (spec.gpu_mem_cap_gib * _GIB if spec.gpu_mem_cap_gib
             else torch.cuda.get_device_properties(0).total_memory)
    room = RESIDENT_GPU_SHARE * total - 4.0 * n - RESIDENT_ACT_GIB * _GIB
    state = DOS_STATE_BPP[spec.moments or "fp32"] - 2.0  # on the GPU: no host gradient slot
    return min(1.0, max(0.0, room / (state * n)))


def available_host_gib(sweep, override: Optional[float] = None) -> tuple:
    """(GiB the preflight may plan for, where that number came from)."""
    if override:
        return float(override), "--host-memory-gib"
    if os.environ.get("DOS_HOST_MEMORY_GIB"):
        return float(os.environ["DOS_HOST_MEMORY_GIB"]), "DOS_HOST_MEMORY_GIB"
    if sweep.host_memory_gib:
        return float(sweep.host_memory_gib), "host_memory_gib in the sweep file"
    return psutil.virtual_memory().available / _GIB, "available host memory"


_CUDA = None


def _cuda_available() -> bool:
    global _CUDA
    if _CUDA is None:
        import torch

        _CUDA = bool(torch.cuda.is_available())
    return _CUDA


def preflight(spec: RunSpec, host_gib: float, host_src: str) -> Optional[str]:
    """Why `spec` cannot run here (a `skipped` row's reason), or None."""
    needs_cuda = spec.device == "cuda" or (spec.device == "auto" and spec.system in CUDA_ONLY)
    if needs_cuda and not _cuda_available():
        return f"no CUDA device on this machine ({spec.system} on device {spec.device!r})"
    # memory before packages: a run that cannot fit says so (with the GiB it needs, which
    # checks.capacity_check reports) also on a machine where its package is missing
    need, how = host_bytes_estimate(spec)
    if need > host_gib * _GIB:
        return (f"{MEMORY_REASON}: needs ~{need / _GIB:.1f} GiB ({how}) but {host_gib:.1f} GiB "
                f"({host_src}) is available; set host_memory_gib / DOS_HOST_MEMORY_GIB if that is wrong")
    module = ("deepspeed" if spec.system.startswith("deepspeed")
              else "torchao" if spec.system == "torchao-cpu-offload" else None)
    if module and importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    if spec.system in ("dos", "torch-gpu", "torch-cpu") or spec.system.startswith("deepspeed"):
        if importlib.util.find_spec("transformers") is None:
            return "transformers is not installed"
    return None


def settled_preflight(spec: RunSpec, sweep, override: Optional[float] = None) -> Optional[str]:
    """`preflight` against the host memory available now; where that is what stops the run, wait
    while it is still growing (the previous run's memory being released; e.g. ~100 GiB of pinned
    DeepSpeed buffers take seconds to free), at most `SETTLE_MAX_S`."""
    host_gib, src = available_host_gib(sweep, override)
    why = preflight(spec, host_gib, src)
    deadline = time.monotonic() + SETTLE_MAX_S
    while (why and why.startswith(MEMORY_REASON) and src == "available host memory"
           and time.monotonic() < deadline):
        time.sleep(SETTLE_POLL_S)
        before, (host_gib, src) = host_gib, available_host_gib(sweep, override)
        why = preflight(spec, host_gib, src)
        if host_gib - before < SETTLE_GROWTH_GIB:
            break
    return why
