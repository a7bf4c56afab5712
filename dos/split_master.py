"""PURE: the split master — an fp32 master stored as its bf16 weight `hi` and a 16-bit `lo`.

Why (docs/DESIGN.md §3.7, issue 17 criterion 3): with bf16 moments the CPU lane moves 20 B per
element, 2 of them the bf16 weight it writes for the upload. If the master's top half *is* that
weight, writing the master writes the weight: 18 B, and the upload reads `hi` where it read the
weight. The host bytes stay 8 per element (hi 2 + lo 2 + moments 4).

The codec, exact for every non-NaN fp32 `x` (bits `u`, sign `s`, magnitude `a = u & 0x7FFFFFFF`):

    hi_a = (a + 0x8000) >> 16            the magnitude rounded half away from zero to bf16
    hi   = (s >> 16) | hi_a              a bf16: the weight the GPU receives
    lo   = a - (hi_a << 16)              an int16 in [-0x8000, 0x7FFF]
    x    = s | ((hi_a << 16) + lo)       join: the same bits

Round-to-nearest-even cannot be split this way: at an exact tie (low half 0x8000) the even
neighbour may be above or below, so `hi` would not be recoverable from `lo` alone (an even `hi`
has 2^16 + 1 masters rounding to it). Half away from zero differs from torch's RNE cast only at
exact ties, by one bf16 ulp; the master itself is exact. Magnitudes from the largest finite bf16
plus half an ulp round to inf, as under RNE; inf splits to (inf, 0); a NaN master splits to the
quiet NaN 0x7FC0 (with its sign) and lo 0 — it joins to a NaN, not to its own payload.

The engine's `state_dtype="bf16-split"` (dos/state_format.py) uses it; this module is the codec
and the plain-torch reference its kernels (csrc `adamw_split_`, state_kernels.fused_split_step_)
are checked against.
"""
from __future__ import annotations

from typing import Optional

import torch

_SIGN = -0x80000000  # int32 bit 31
_MAG = 0x7FFFFFFF
_INF = 0x7F800000


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi bf16, lo int16) of an fp32 tensor (any device; new tensors)."""
    if x.dtype != torch.float32:
        raise TypeError(f"split needs fp32, got {x.dtype}")
    u = x.contiguous().view(torch.int32)
    s, a = u & _SIGN, u & _MAG
    hi_a = (a + 0x8000) >> 16  # no overflow for a <= 0x7F800000 (inf); NaN lanes are replaced
    nan = a > _INF
    lo = a - (hi_a << 16)
    hi = (s >> 16) & 0xFFFF | hi_a
    hi = torch.where(nan, (s >> 16) & 0xFFFF | 0x7FC0, hi)
    lo = torch.where(nan, 0, lo)
    return _low16(hi).view(torch.bfloat16), _low16(lo)


def join(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 master of (hi bf16, lo int16) (a new tensor)."""
    if hi.dtype != torch.bfloat16 or lo.dtype != torch.int16 or hi.shape != lo.shape:
        raise TypeError(f"join needs bf16 hi and int16 lo of one shape, got {hi.dtype} "
                        f"{tuple(hi.shape)} and {lo.dtype} {tuple(lo.shape)}")
    h = hi.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    s, hi_a = (h & 0x8000) << 16, h & 0x7FFF
    return (s | ((hi_a << 16) + lo.to(torch.int32))).view(torch.float32)


def _low16(x: torch.Tensor) -> torch.Tensor:
    """int32 values whose low 16 bits are wanted, as int16 with those bits."""
    return (((x & 0xFFFF) ^ 0x8000) - 0x8000).to(torch.int16)


def reference_step_(hi: torch.Tensor, lo: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, grad: torch.Tensor, *, lo_i: int, hi_i: int,
                    step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, grad_scale: float = 1.0,
                    out: Optional[torch.Tensor] = None) -> None:
    """Plain-torch oracle of one update of elements [lo_i, hi_i) with a split master and bf16
    moments: join, the update of dos/state_format.py (bf16 moments, the same fp32 operation
    order), split. `hi` afterwards holds the new weights; `out`, if given, receives them too."""
    from dos import state_format as sf

    n = hi.numel()
    if not 0 <= lo_i <= hi_i <= n:
        raise ValueError(f"need 0 <= lo <= hi <= {n}, got [{lo_i}, {hi_i})")
    if lo_i == hi_i:
        return
    p = join(hi[lo_i:hi_i], lo[lo_i:hi_i])
    m, v = exp_avg[lo_i:hi_i].float(), exp_avg_sq[lo_i:hi_i].float()
    sf._math_(p, grad[lo_i:hi_i].float(), m, v, step=step, lr=lr, beta1=beta1, beta2=beta2,
              eps=eps, weight_decay=weight_decay, grad_scale=grad_scale)
    exp_avg[lo_i:hi_i].copy_(m)
    exp_avg_sq[lo_i:hi_i].copy_(v)
    h, l = split(p)
    hi[lo_i:hi_i].copy_(h)
    lo[lo_i:hi_i].copy_(l)
    if out is not None:
        out[lo_i:hi_i].copy_(h)
