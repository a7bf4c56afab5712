"""Fused accelerator-lane kernels (Triton) for the low-precision state formats.

`state_format.device_step_` without these decodes bf16/int8 moments into an fp32 scratch, runs
torch's fused AdamW and encodes back: per element ~64 B of device-memory traffic for bf16 against
the fp32 state's ~40 B (docs/DESIGN.md §3.7), so the format that moves fewer bytes ran slower on
the GPU (0.62-0.64x of fp32 on the H200). One kernel here reads each input once and writes
each output once:

    bf16: grad (2, its dtype), master 4 + 4, exp_avg 2 + 2, exp_avg_sq 2 + 2, weights out (2) = 20 B
    int8: grad 2, master 8, codes 2 + 2, weights 2, scales 16/BLOCK                             = 16 B
    bf16-split: grad 2, hi 2 + 2, lo 2 + 2, exp_avg 2 + 2, exp_avg_sq 2 + 2, weights out (2)    = 20 B

The arithmetic is `state_format`'s documented order, op for op: no FMA contraction
(`enable_fp_fusion=False`), correctly rounded division and sqrt (`div_rn`, `sqrt_rn`), constants
rounded once to fp32 on the host as `state_format._math_` does, the codes' RNE by the 1.5 * 2^23
trick (exact for their range, [0, 256.5)), bf16 storage by c10::BFloat16's integer rule. So the
result is `reference_step_`'s (on the CPU) to the bit: tests/test_state_kernels.py asserts it on
CUDA (held on the H200) and under Triton's CPU interpreter (in CI).

fp32 state keeps torch's fused AdamW (the default is equal to torch.optim.AdamW(fused=True), not
to another kernel's rounding). Triton is optional: `available(t)` says whether a tensor's device
can run these (CUDA with Triton importable, or any device under TRITON_INTERPRET=1);
DOS_NO_TRITON=1 forces the torch-op path (an A/B switch).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

try:  # optional: the CPU-only install has no Triton; the device image has it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the install
    triton = None



def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(t: torch.Tensor) -> bool:
    """Whether the fused kernels run on `t`'s device (and are not switched off)."""
    if triton is None or os.environ.get("DOS_NO_TRITON", "0") not in ("", "0"):
        return False
    return t.device.type == "cuda" or (_interpreting() and t.device.type == "cpu")


def impl_name(t: torch.Tensor, fmt: str = "bf16") -> str:
    """What the accelerator lane runs for `fmt` on `t`'s device (recorded with runs):
    'torch-fused' (fp32), 'triton-fused' or 'torch-ops'."""
    if fmt == "fp32":
        return "torch-fused"
    return "triton-fused" if available(t) else "torch-ops"


if triton is not None:
    _RNE = tl.constexpr(12582912.0)  # 1.5 * 2^23: (x + _RNE) - _RNE rounds 0 <= x < 2^22 to nearest even
    _NAN_BITS = tl.constexpr(0x7FC00000)  # fp32 NaN (a NaN constexpr would never equal itself:
    # Triton re-checks globals at every launch and refused "_NAN has changed")
    _FLT_MAX = tl.constexpr(3.4028234663852886e38)

    @triton.jit
    def _bf16_rne(x):
        # fp32 -> bf16, round to nearest even, NaN -> 0x7FC0: c10::BFloat16's rule, in integer ops
        # (Triton's interpreter truncates in `.to(tl.bfloat16)`; the GPU's cvt.rn would agree)
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        hi = tl.where(x != x, 0x7FC0, bits >> 16)
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _to_out(p, out_ptr):
        if out_ptr.dtype.element_ty == tl.bfloat16:
            return _bf16_rne(p)
        else:
            return p.to(out_ptr.dtype.element_ty)

    @triton.jit
    def _adam_math(p, g, m, v, scale_ptr, wdf, w, wm1, beta2, omb2, step_size, bc2s, eps,
                   HAS_SCALE: tl.constexpr, HAS_WD: tl.constexpr, SMALL_W: tl.constexpr):
        # state_format._math_, one fp32 operation at a time
        if HAS_SCALE:
            g = tl.div_rn(g, tl.load(scale_ptr))
        if HAS_WD:
            p = p * wdf
        d = g - m
        if SMALL_W:
            m = d * w + m
        else:
            m = d * wm1 + g
        v = v * beta2
        v = (g * omb2) * g + v
        denom = tl.div_rn(tl.sqrt_rn(v), bc2s) + eps
        p = p + tl.div_rn(m * step_size, denom)
        return p, m, v

    # Sizes and ranges are not specialized on (Triton would compile a variant per value class, e.g.
    # n % 16, in the middle of a step that the planner times); pointers' 16-byte alignment is.
    # Masks are therefore constexpr-chosen: with a mask over an unspecialized n Triton cannot
    # prove a vector's lanes share it and issues scalar loads and stores (session 18: the bf16 lane
    # at 3B took 48 ms instead of 19, slower than fp32's torch kernel). EVEN launches cover whole
    # blocks unmasked; only a range's last partial block runs masked (two variants, both compiled
    # in the first step, where a subgroup size is not a multiple of BLOCK).
    @triton.jit(do_not_specialize=["n"])
    def _bf16_kernel(p_ptr, m_ptr, v_ptr, g_ptr, out_ptr, scale_ptr, n,
                     wdf, w, wm1, beta2, omb2, step_size, bc2s, eps,
                     HAS_SCALE: tl.constexpr, HAS_WD: tl.constexpr, SMALL_W: tl.constexpr,
                     HAS_OUT: tl.constexpr, EVEN: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            mask = None
        else:
            mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        p, m, v = _adam_math(p, g, m, v, scale_ptr, wdf, w, wm1, beta2, omb2, step_size, bc2s,
                             eps, HAS_SCALE, HAS_WD, SMALL_W)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, _bf16_rne(m), mask=mask)
        tl.store(v_ptr + offs, _bf16_rne(v), mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offs, _to_out(p, out_ptr), mask=mask)

    @triton.jit(do_not_specialize=["n", "nb", "lo", "hi", "b_first"])
    def _int8_kernel(p_ptr, q_ptr, r_ptr, s_ptr, g_ptr, out_ptr, scale_ptr, n, nb, lo, hi, b_first,
                     wdf, w, wm1, beta2, omb2, step_size, bc2s, eps,
                     HAS_SCALE: tl.constexpr, HAS_WD: tl.constexpr, SMALL_W: tl.constexpr,
                     HAS_OUT: tl.constexpr, FULL: tl.constexpr, BLOCK: tl.constexpr):
        # One program per scale block b = b_first + program id, of the blocks touched by [lo, hi):
        # decode the whole block, update the elements in [lo, hi), re-encode the whole block with
        # its new scales (state_format's int8 section). Pointers are the whole subgroup's. FULL:
        # every block of the launch lies inside [lo, hi) (and so inside n): no masks, vector
        # loads and stores (see _bf16_kernel's EVEN).
        b = b_first + tl.program_id(0)
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        s_m0 = tl.load(s_ptr + b)
        s_v0 = tl.load(s_ptr + nb + b)
        if FULL:
            q = tl.load(q_ptr + offs).to(tl.float32)
            a = tl.load(r_ptr + offs).to(tl.float32) + 1.0
        else:
            inside = offs < n
            upd = (offs >= lo) & (offs < hi)
            q = tl.load(q_ptr + offs, mask=inside, other=0).to(tl.float32)
            a = tl.load(r_ptr + offs, mask=inside, other=0).to(tl.float32) + 1.0
        m = (q * tl.abs(q)) * tl.div_rn(s_m0, 16129.0)
        a = a * a
        v = (a * a) * (s_v0 * 2.3283064365386963e-10)  # 2^-32, exact
        if FULL:
            p = tl.load(p_ptr + offs)
            g = tl.load(g_ptr + offs).to(tl.float32)
            p2, m, v = _adam_math(p, g, m, v, scale_ptr, wdf, w, wm1, beta2, omb2, step_size,
                                  bc2s, eps, HAS_SCALE, HAS_WD, SMALL_W)
            tl.store(p_ptr + offs, p2)
            if HAS_OUT:
                tl.store(out_ptr + offs, _to_out(p2, out_ptr))
        else:
            m = tl.where(inside, m, 0.0)
            v = tl.where(inside, v, 0.0)
            p = tl.load(p_ptr + offs, mask=upd, other=0.0)
            g = tl.load(g_ptr + offs, mask=upd, other=0.0).to(tl.float32)
            p2, m2, v2 = _adam_math(p, g, m, v, scale_ptr, wdf, w, wm1, beta2, omb2, step_size,
                                    bc2s, eps, HAS_SCALE, HAS_WD, SMALL_W)
            m = tl.where(upd, m2, m)
            v = tl.where(upd, v2, v)
            tl.store(p_ptr + offs, p2, mask=upd)
            if HAS_OUT:
                tl.store(out_ptr + offs, _to_out(p2, out_ptr), mask=upd)
        # scales: max |.| of the block; NaN if any moment is NaN or inf (the block is poisoned)
        am, av = tl.abs(m), tl.abs(v)
        bad_m = tl.max(((am != am) | (am > _FLT_MAX)).to(tl.int32), axis=0) > 0
        bad_v = tl.max(((av != av) | (av > _FLT_MAX)).to(tl.int32), axis=0) > 0
        nan = tl.full([], _NAN_BITS, tl.uint32).to(tl.float32, bitcast=True)
        s_m = tl.where(bad_m, nan, tl.max(tl.where(am != am, 0.0, am), axis=0))
        s_v = tl.where(bad_v, nan, tl.max(tl.where(av != av, 0.0, av), axis=0))
        km = tl.where(s_m > 0, tl.div_rn(16129.0, s_m), 0.0)
        kv = tl.where(s_v > 0, tl.div_rn(1.0, s_v), 0.0)
        u = (tl.sqrt_rn(am * km) + _RNE) - _RNE
        u = tl.minimum(tl.where(u != u, 0.0, u), 127.0)
        u = tl.where(m < 0, -u, u)  # copysign; -0 stores as 0
        if FULL:
            tl.store(q_ptr + offs, u.to(tl.int8))
        else:
            tl.store(q_ptr + offs, u.to(tl.int8), mask=inside)
        u = ((tl.sqrt_rn(tl.sqrt_rn(v * kv)) * 256.0 + _RNE) - _RNE) - 1.0
        u = tl.minimum(tl.maximum(tl.where(u != u, 0.0, u), 0.0), 255.0)
        if FULL:
            tl.store(r_ptr + offs, u.to(tl.uint8))
        else:
            tl.store(r_ptr + offs, u.to(tl.uint8), mask=inside)
        tl.store(s_ptr + b, s_m)
        tl.store(s_ptr + nb + b, s_v)


    @triton.jit(do_not_specialize=["n"])
    def _split_kernel(h_ptr, l_ptr, m_ptr, v_ptr, g_ptr, out_ptr, scale_ptr, n,
                      wdf, w, wm1, beta2, omb2, step_size, bc2s, eps,
                      HAS_SCALE: tl.constexpr, HAS_WD: tl.constexpr, SMALL_W: tl.constexpr,
                      HAS_OUT: tl.constexpr, EVEN: tl.constexpr, BLOCK: tl.constexpr):
        # The split master (dos/split_master.py) with bf16 moments: h_ptr/l_ptr/out_ptr are int16
        # views (hi's bf16 bits, lo, the weights' bf16 bits); join, _adam_math, split.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if EVEN:
            mask = None
        else:
            mask = offs < n
        h = tl.load(h_ptr + offs, mask=mask).to(tl.int32) & 0xFFFF
        lo = tl.load(l_ptr + offs, mask=mask).to(tl.int32)
        u = ((h & 0x8000) << 16) | (((h & 0x7FFF) << 16) + lo)
        p = u.to(tl.float32, bitcast=True)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        p, m, v = _adam_math(p, g, m, v, scale_ptr, wdf, w, wm1, beta2, omb2, step_size, bc2s,
                             eps, HAS_SCALE, HAS_WD, SMALL_W)
        tl.store(m_ptr + offs, _bf16_rne(m), mask=mask)
        tl.store(v_ptr + offs, _bf16_rne(v), mask=mask)
        u = p.to(tl.int32, bitcast=True)
        sgn = (u >> 16) & 0x8000
        a = u & 0x7FFFFFFF
        nan = a > 0x7F800000
        ha = ((a + 0x8000) >> 16) & 0xFFFF  # a NaN lane's overflow is replaced below
        h = tl.where(nan, sgn | 0x7FC0, sgn | ha)
        lo = tl.where(nan, 0, a - (ha << 16))
        h16 = (((h & 0xFFFF) ^ 0x8000) - 0x8000).to(tl.int16)
        tl.store(h_ptr + offs, h16, mask=mask)
        tl.store(l_ptr + offs, lo.to(tl.int16), mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offs, h16, mask=mask)


def fused_split_step_(hi: torch.Tensor, lo: torch.Tensor, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, grad: torch.Tensor, out: Optional[torch.Tensor], *,
                      lo_i: int, hi_i: int, step: int, lr: float, beta1: float, beta2: float,
                      eps: float, weight_decay: float, scale_t: Optional[torch.Tensor]) -> None:
    """The accelerator lane's update of [lo_i, hi_i) of a split master (hi bf16, lo int16) with
    bf16 moments, in one kernel: `split_master.reference_step_` to the bit. `out` (bf16 or None)
    also receives the weights, which are `hi` (the GPU lanes' update for state_dtype="bf16-split")."""
    if hi.dtype != torch.bfloat16 or lo.dtype != torch.int16:
        raise TypeError(f"the split master is hi bf16 and lo int16, got {hi.dtype} and {lo.dtype}")
    if out is not None and out.dtype != torch.bfloat16:
        raise TypeError(f"out receives hi: bf16, got {out.dtype}")
    n = hi.numel()
    if not 0 <= lo_i <= hi_i <= n:
        raise ValueError(f"need 0 <= lo <= hi <= {n}, got [{lo_i}, {hi_i})")
    if lo_i == hi_i:
        return
    consts, flags = _constants(step, lr, beta1, beta2, eps, weight_decay)
    h16 = hi.view(torch.int16)
    scale = scale_t if scale_t is not None else exp_avg  # any pointer: not read
    opts = dict(HAS_SCALE=scale_t is not None, HAS_OUT=out is not None, **flags)
    if not _interpreting():
        opts["enable_fp_fusion"] = False
    B = 2048
    for a, b, even in launches_bf16(lo_i, hi_i, B):
        o = out.view(torch.int16)[a:b] if out is not None else h16[a:b]
        _split_kernel[(triton.cdiv(b - a, B),)](
            h16[a:b], lo[a:b], exp_avg[a:b], exp_avg_sq[a:b], grad[a:b], o, scale, b - a,
            **consts, EVEN=even, BLOCK=B, num_warps=8, **opts)


def _f32(x: float) -> float:
    """x rounded once to fp32 (as state_format._f32), returned as a Python float."""
    return float(torch.tensor(x, dtype=torch.float32))


def _constants(step: int, lr, beta1, beta2, eps, weight_decay):
    """The fp32 constants of state_format._math_ (computed in double, rounded once)."""
    sd = _f32(float(step))
    bc1, bc2 = 1 - beta1 ** sd, 1 - beta2 ** sd
    w = _f32(1 - beta1)
    return dict(wdf=_f32(1 - lr * weight_decay), w=w, wm1=_f32(w - 1.0), beta2=_f32(beta2),
                omb2=_f32(1 - beta2), step_size=_f32(-(lr / bc1)), bc2s=_f32(math.sqrt(bc2)),
                eps=_f32(eps)), dict(HAS_WD=weight_decay != 0.0, SMALL_W=abs(w) < 0.5)


def launches_bf16(lo: int, hi: int, block: int) -> list:
    """[(start, end, even)] covering [lo, hi): the whole blocks from lo unmasked (even), then the
    remainder (< block elements) masked."""
    mid = lo + (hi - lo) // block * block
    return [(a, b, even) for a, b, even in ((lo, mid, True), (mid, hi, False)) if b > a]


def launches_int8(lo: int, hi: int, block: int) -> list:
    """[(first block, blocks, full)] covering the scale blocks [lo, hi) touches: the blocks lying
    wholly inside [lo, hi) in one unmasked launch (full), each partly covered one (at most two: the
    first and the last) in a masked launch of its own."""
    b0, b1 = lo // block, -(-hi // block)
    f0, f1 = -(-lo // block), hi // block  # the whole blocks [f0, f1)
    if f1 <= f0:
        return [(b, 1, False) for b in range(b0, b1)]
    out = [(b0, 1, False)] if b0 < f0 else []
    out.append((f0, f1 - f0, True))
    if f1 < b1:
        out.append((f1, 1, False))
    return out


def fused_step_(fmt: str, views, grad: torch.Tensor, out: Optional[torch.Tensor], *, lo: int,
                hi: int, step: int, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, scale_t: Optional[torch.Tensor]) -> None:
    """`state_format.device_step_` for bf16/int8 in one kernel launch (see the module docstring).
    `step` is the host's step count; `scale_t` a 0-d fp32 divisor on the device or None. Never
    syncs the host; the grad is not written."""
    n = views.master.numel()
    if lo == hi:
        return
    consts, flags = _constants(step, lr, beta1, beta2, eps, weight_decay)
    has_out = out is not None and out.data_ptr() != views.master.data_ptr()
    scale = scale_t if scale_t is not None else views.master  # any pointer: not read
    opts = dict(HAS_SCALE=scale_t is not None, HAS_OUT=has_out, **flags)
    if not _interpreting():
        opts["enable_fp_fusion"] = False  # a * b + c stays two roundings (the documented order)
    if fmt == "bf16":
        B = 2048
        for a, b, even in launches_bf16(lo, hi, B):  # whole blocks unmasked, then the rest
            o = out[a:b] if has_out else views.master[a:b]
            _bf16_kernel[(triton.cdiv(b - a, B),)](
                views.master[a:b], views.exp_avg[a:b], views.exp_avg_sq[a:b], grad[a:b], o,
                scale, b - a, **consts, EVEN=even, BLOCK=B, num_warps=8, **opts)
    elif fmt == "int8":
        from .state_format import BLOCK, nblocks
        nb = nblocks(n)
        o = out if has_out else views.master
        for b_first, count, full in launches_int8(lo, hi, BLOCK):
            _int8_kernel[(count,)](
                views.master, views.exp_avg, views.exp_avg_sq, views.scales, grad, o, scale, n, nb,
                lo, hi, b_first, **consts, FULL=full, BLOCK=BLOCK, num_warps=8, **opts)
    else:
        raise ValueError(f"no fused kernel for state dtype {fmt!r} (fp32 runs torch's fused AdamW)")
