"""AdamW math: the reference (the oracle of every kernel) and the dispatch to the fast kernels.

All functions update flat 1-D fp32 state in place and follow `torch.optim.AdamW` exactly:
    param *= 1 - lr * weight_decay
    exp_avg    = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    param     -= lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)
with g = grad / grad_scale (grad_scale: 1/clip coefficient, or an AMP scale).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from dos import _csrc

_CHUNK = 1 << 21  # elements per pass of the torch fallback: keeps the fp32 gradient in cache


def adamw_reference(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float, beta1: float,
                    beta2: float, eps: float, weight_decay: float, grad_scale: float = 1.0):
    """Pure reference: returns new (param, exp_avg, exp_avg_sq) in the dtype of `param`.

    Pass float64 tensors for a high-precision oracle; inputs are not modified.
    """
    dt = param.dtype
    g = grad.to(dt) / grad_scale
    p = param * (1 - lr * weight_decay)
    m = exp_avg.to(dt) * beta1 + g * (1 - beta1)
    v = exp_avg_sq.to(dt) * beta2 + g * g * (1 - beta2)
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    p = p - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)
    return p, m, v


def _fused(master, grad32, exp_avg, exp_avg_sq, step_t, lr, beta1, beta2, eps, weight_decay, scale_t):
    torch._fused_adamw_([master], [grad32], [exp_avg], [exp_avg_sq], [], [step_t], lr=lr,
                        beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                        amsgrad=False, maximize=False, grad_scale=scale_t, found_inf=None)


def torch_cpu_adamw_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     grad: torch.Tensor, out: Optional[torch.Tensor], *, step: int, lr: float,
                     beta1: float, beta2: float, eps: float, weight_decay: float,
                     grad_scale: float = 1.0) -> None:
    """CPU AdamW over one flat subgroup with torch's fused CPU kernel, in cache-sized chunks.

    `grad` may be bf16/fp16/fp32; `out` (optional) receives the updated weights in its dtype and
    may be the very tensor `grad` is (the gradient is consumed before its chunk is overwritten).
    """
    n = master.numel()
    step_t = torch.tensor(float(step))
    scale_t = None if grad_scale == 1.0 else torch.tensor(float(grad_scale))
    scratch = None if grad.dtype == torch.float32 else torch.empty(min(n, _CHUNK))
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        g = grad[lo:hi]
        if scratch is not None:
            g = scratch[: hi - lo].copy_(g)
        _fused(master[lo:hi], g, exp_avg[lo:hi], exp_avg_sq[lo:hi], step_t, lr, beta1, beta2, eps,
               weight_decay, scale_t)
        if out is not None:
            out[lo:hi].copy_(master[lo:hi])


def cpu_adamw_(master, exp_avg, exp_avg_sq, grad, out, *, step, lr, beta1, beta2, eps,
               weight_decay, grad_scale=1.0, threads: Optional[int] = None) -> None:
    """The CPU lane's update: the best available CPU kernel (see `cpu_impl()`).

    dos's fused kernel (csrc/, `torch.ops.dos.adamw_`) when it builds, else `torch_cpu_adamw_`.
    Contiguous 1-D fp32 `master`/`exp_avg`/`exp_avg_sq`; `grad` bf16/fp16/fp32; `out` None or any
    of those dtypes, and may be `grad` itself. `threads`: at most that many threads for this call
    (None: torch's thread count).
    """
    ops = _csrc.ops()
    if ops is None:
        # NOTE: the fallback ignores `threads` (torch's thread count is process-wide).
        torch_cpu_adamw_(master, exp_avg, exp_avg_sq, grad, out, step=step, lr=lr, beta1=beta1,
                         beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
        return
    ops.adamw_(master, exp_avg, exp_avg_sq, grad, out, int(step), float(lr), float(beta1),
               float(beta2), float(eps), float(weight_decay), float(grad_scale),
               0 if threads is None else int(threads), _csrc.isa())


def cpu_state_step_(fmt, views, grad, out, *, lo: int, hi: int, step, lr, beta1, beta2, eps,
                    weight_decay, grad_scale=1.0, threads: Optional[int] = None) -> None:
    """The CPU lane's update of elements [lo, hi) of one subgroup in any state format
    (dos/state_format.py: 'fp32' | 'bf16' | 'int8' | 'bf16-split', or a StateFormat).

    `views`: the subgroup's `StateViews`; `grad`/`out` whole-subgroup tensors as in `cpu_adamw_`
    (`out` None, `grad` itself, or another tensor; it receives the weights [lo, hi)).
    fp32 runs `cpu_adamw_` on the slices; bf16/int8 run `torch.ops.dos.adamw_lowp_`, or, without
    the extension, the plain-torch `state_format.reference_step_` (slow, single pass).
    """
    from dos import state_format as sf

    fmt = sf.state_format(fmt)
    n = views.numel
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"need 0 <= lo <= hi <= {n}, got [{lo}, {hi})")
    if fmt.split:  # the weights are views.hi; `out` (bf16 or None) gets a copy
        cpu_split_step_(views.hi, views.lo, views.exp_avg, views.exp_avg_sq, grad, out, lo_i=lo,
                        hi_i=hi, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, grad_scale=grad_scale, threads=threads)
        return
    if fmt.name == "fp32":
        cpu_adamw_(views.master[lo:hi], views.exp_avg[lo:hi], views.exp_avg_sq[lo:hi],
                   grad[lo:hi], None if out is None else out[lo:hi], step=step, lr=lr, beta1=beta1,
                   beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
                   threads=threads)
        return
    ops = _csrc.ops()
    if ops is None:
        sf.reference_step_(fmt, views, grad, out, lo=lo, hi=hi, step=step, lr=lr, beta1=beta1,
                           beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
        return
    ops.adamw_lowp_(views.master, views.exp_avg, views.exp_avg_sq, views.scales, grad, out,
                    int(lo), int(hi), int(step), float(lr), float(beta1), float(beta2), float(eps),
                    float(weight_decay), float(grad_scale), 0 if threads is None else int(threads),
                    _csrc.isa())


def cpu_split_step_(hi, lo, exp_avg, exp_avg_sq, grad, out, *, lo_i: int, hi_i: int, step, lr,
                    beta1, beta2, eps, weight_decay, grad_scale=1.0, threads: Optional[int] = None) -> None:
    """The CPU lane's update of elements [lo_i, hi_i) of a split master (dos/split_master.py: hi
    bf16, lo int16) with bf16 moments; `out` (None, `grad` itself or another bf16 tensor) also
    receives the weights, which are `hi`. `torch.ops.dos.adamw_split_`, or without the extension
    the plain-torch `split_master.reference_step_`. The engine's `state_dtype="bf16-split"`."""
    from dos import split_master as sm

    ops = _csrc.ops()
    if ops is None:
        sm.reference_step_(hi, lo, exp_avg, exp_avg_sq, grad, lo_i=lo_i, hi_i=hi_i, step=step, lr=lr,
                           beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                           grad_scale=grad_scale, out=out)
        return
    ops.adamw_split_(hi, lo, exp_avg, exp_avg_sq, grad, out, int(lo_i), int(hi_i), int(step),
                     float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                     float(grad_scale), 0 if threads is None else int(threads), _csrc.isa())


def cpu_impl() -> str:
    """Name of the implementation `cpu_adamw_` runs (recorded with every run):
    'dos-csrc-avx512' | 'dos-csrc-avx2' | 'dos-csrc-scalar' | 'torch-fused'."""
    return _csrc.impl_name()


def device_adamw_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  grad: torch.Tensor, out: Optional[torch.Tensor], *, step_t: torch.Tensor,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  scale_t: Optional[torch.Tensor], scratch: Optional[torch.Tensor]) -> None:
    """Accelerator lane's update (torch fused AdamW), on the current stream, never blocking the host.

    `step_t` and `scale_t` live on the device already; `scratch` is an fp32 buffer of at least
    `master.numel()` elements used to widen a low-precision gradient. `out` receives the weights
    in its dtype; it is skipped when it is `master` itself (fp32 parameters).
    """
    if grad.dtype != torch.float32:
        grad = scratch[: grad.numel()].copy_(grad)
    _fused(master, grad, exp_avg, exp_avg_sq, step_t, lr, beta1, beta2, eps, weight_decay, scale_t)
    if out is not None and out.data_ptr() != master.data_ptr():
        out.copy_(master)


def device_state_step_(fmt, views, grad: torch.Tensor, out: Optional[torch.Tensor], *, lo: int, hi: int,
                       step: int, step_t: torch.Tensor, lr: float, beta1: float, beta2: float,
                       eps: float, weight_decay: float, scale_t: Optional[torch.Tensor],
                       scratch: torch.Tensor) -> None:
    """Accelerator lane's update of elements [lo, hi) of one subgroup in any state format, on the
    current stream, never blocking the host. fp32: torch's fused AdamW on the slices (as
    `device_adamw_`). bf16/int8: one fused kernel (dos.state_kernels, Triton) where the device
    can run it, else `state_format.device_step_` (decoded into `scratch`, torch's fused kernel,
    encoded back). `step` is the host's count, `step_t` the same on the device."""
    from dos import state_format as sf
    from dos import state_kernels

    name = sf.state_format(fmt).name
    if name == "bf16-split" and state_kernels.available(views.exp_avg):
        state_kernels.fused_split_step_(views.hi, views.lo, views.exp_avg, views.exp_avg_sq, grad, out,
                                        lo_i=lo, hi_i=hi, step=step, lr=lr, beta1=beta1, beta2=beta2,
                                        eps=eps, weight_decay=weight_decay, scale_t=scale_t)
        return
    if name not in ("fp32", "bf16-split") and state_kernels.available(views.exp_avg):
        state_kernels.fused_step_(name, views, grad, out, lo=lo, hi=hi, step=step, lr=lr,
                                  beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                  scale_t=scale_t)
        return
    need = 0 if name == "fp32" and grad.dtype == torch.float32 else sf.scratch_numel(name, views.numel)
    if scratch.numel() < need:  # sized for the fused kernels (none): this call's own, stream-ordered
        scratch = torch.empty(need, dtype=torch.float32, device=views.exp_avg.device)
    sf.device_step_(fmt, views, grad, out, lo=lo, hi=hi, step_t=step_t, lr=lr, beta1=beta1,
                    beta2=beta2, eps=eps, weight_decay=weight_decay, scale_t=scale_t, scratch=scratch)
