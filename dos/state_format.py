"""Optimizer-state formats: fewer bytes per parameter for the host-side AdamW state.

A subgroup of n parameters keeps one byte buffer `[master | exp_avg | exp_avg_sq | scales]`:

    format  master  exp_avg          exp_avg_sq        scales                          bytes
    fp32    fp32    fp32             fp32              -                               12 n
    bf16    fp32    bfloat16         bfloat16          -                                8 n
    int8    fp32    int8 (codes)     uint8 (codes)     fp32 [s_m per block | s_v ...]   6 n (to 4) + 8 ceil(n/BLOCK)
    bf16-split  hi bf16 + lo int16  bfloat16  bfloat16  -       8 n  (the master is hi:lo, dos/split_master.py)

The master is always fp32 (bf16-split: exactly, as hi:lo) and the math is always fp32. One
update of element i (the order of torch's fused AdamW, as csrc/adamw_body.inc `math`; constants computed in double, rounded once
to fp32; `*` `/` `+` `-` `sqrt` are single correctly rounded fp32 operations, no FMA here):

    m, v  = decode(stored moments)                                  (fp32)
    g     = grad / grad_scale                                       (only if grad_scale != 1)
    p     = p * (1 - lr*wd)                                         (only if wd != 0)
    d     = g - m
    m     = d * w + m        if |w| < 0.5 else   d * (w - 1) + g,     w = 1 - beta1
    v     = v * beta2;   v = (g * (1 - beta2)) * g + v
    p     = p + (m * -(lr/bc1)) / (sqrt(v) / sqrt(bc2) + eps),        bc_k = 1 - beta_k**step
    stored moments = encode(m, v)    (the master used the new fp32 m and v, before rounding)

Encodings:

- fp32: identity.
- bf16: round to nearest even (`tensor.to(torch.bfloat16)`, c10::BFloat16; NaN -> 0x7FC0).
- int8: blocks of BLOCK = 2048 consecutive elements of the subgroup (element i is in block
  i // BLOCK; the last block may be short). Per block two fp32 scales, computed from the new
  fp32 moments of the whole block: s_m = max |m|, s_v = max |v| (v >= 0). A block holding a
  NaN or inf moment is poisoned: its scales become NaN (every element decodes to NaN, as the
  fp32 master of the offending element already is) and its codes 0.
    exp_avg, int8 code q in [-127, 127] (square-law companding, finer steps near zero):
        km = 127^2 / s_m if s_m > 0 else 0
        q  = copysign(min(max(RNE(sqrt(|m| * km)), 0), 127), m)       (max(NaN, 0) = 0)
        m  = (q * |q|) * dm,  dm = s_m / 127^2
    exp_avg_sq, uint8 code q in [0, 255] (fourth-root companding; code 0 means (1/256)^4 s_v,
    never 0, so a tiny v is overestimated: a smaller, safe step):
        kv = 1 / s_v if s_v > 0 else 0
        q  = min(max(RNE(sqrt(sqrt(v * kv)) * 256) - 1, 0), 255)
        v  = ((a * a) * (a * a)) * dv,  a = q + 1,  dv = s_v * 2^-32
    Zero scales decode to 0 whatever the codes: a zero-filled buffer is the zero state.
  An update of [lo, hi) re-encodes every block it touches; elements of those blocks outside
  [lo, hi) keep their decoded values, re-encoded with the block's new scales: each moves by at
  most half a code step of the new scale (in code space), and not at all when the scales stay.

The C++ kernel (`torch.ops.dos.adamw_lowp_`) follows this order; its scalar path matches
`reference_step_` bitwise, its AVX2/AVX-512 paths differ only by the FMAs in `math` (the codecs
have none). This module is pure torch: `reference_step_` is the oracle, `device_step_` the
accelerator lane's update (torch fused AdamW on decoded fp32 copies), `decode`/`encode_` the
conversion for checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

STATE_DTYPES = ("fp32", "bf16", "int8", "bf16-split")
BLOCK = 2048
_QM2 = 16129.0  # 127^2
_MOMENT_DTYPES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
                  "int8": (torch.int8, torch.uint8), "bf16-split": (torch.bfloat16, torch.bfloat16)}


class StateViews(NamedTuple):
    master: Optional[torch.Tensor]  # fp32; None for bf16-split (its master is hi:lo)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    scales: Optional[torch.Tensor]  # int8 only: fp32 [s_m of each block..., s_v of each block...]
    hi: Optional[torch.Tensor] = None  # bf16-split only: the weights (bf16), dos/split_master.py
    lo: Optional[torch.Tensor] = None  # bf16-split only: int16

    @property
    def numel(self) -> int:
        return self.exp_avg.numel()


def nblocks(n: int) -> int:
    """int8 scale blocks of an n-element subgroup."""
    return -(-n // BLOCK)


@dataclass(frozen=True)
class StateFormat:
    name: str

    def __post_init__(self):
        if self.name not in STATE_DTYPES:
            raise ValueError(f"state dtype {self.name!r}: expected one of {', '.join(STATE_DTYPES)}")

    @property
    def moment_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return _MOMENT_DTYPES[self.name]

    @property
    def quantized(self) -> bool:
        return self.name == "int8"

    @property
    def split(self) -> bool:
        """The master stored as (hi, lo) (dos/split_master.py): bf16 moments, weights = hi."""
        return self.name == "bf16-split"

    @property
    def bytes_per_element(self) -> float:
        return {"fp32": 12.0, "bf16": 8.0, "int8": 6.0 + 8.0 / BLOCK, "bf16-split": 8.0}[self.name]

    def check_param_dtypes(self, dtypes) -> None:
        """ValueError unless the parameters' dtypes suit the format (bf16-split: bf16 only)."""
        if self.split and any(d != torch.bfloat16 for d in dtypes):
            raise ValueError(f"state_dtype='bf16-split' stores the master as its bf16 weights and a "
                             f"remainder: every trainable parameter must be bfloat16, got "
                             f"{sorted({str(d) for d in dtypes})} (use state_dtype='bf16')")

    def offsets(self, n: int) -> tuple[int, int, int, Optional[int]]:
        """Byte offsets of master (bf16-split: hi, then lo at 2 n), exp_avg, exp_avg_sq and
        scales (None unless int8)."""
        es = self.moment_dtypes[0].itemsize
        m, v = 4 * n, 4 * n + es * n
        return 0, m, v, ((v + es * n + 3) // 4 * 4 if self.quantized else None)

    def nbytes(self, n: int) -> int:
        """Bytes of one n-element subgroup's state (12 n for fp32: today's layout)."""
        *_, s = self.offsets(n)
        return s + 8 * nblocks(n) if s is not None else 4 * n + 2 * self.moment_dtypes[0].itemsize * n

    def views(self, buf: torch.Tensor, n: int) -> StateViews:
        """Views of master, exp_avg, exp_avg_sq (and scales) into `buf` (1-D uint8, CPU or CUDA,
        at least nbytes(n) bytes, starting 4-byte aligned)."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < self.nbytes(n):
            raise ValueError(f"{self.name} state of {n} elements needs a 1-D uint8 buffer of "
                             f">= {self.nbytes(n)} bytes, got {buf.dtype} {tuple(buf.shape)}")
        p, m, v, s = self.offsets(n)
        md, vd = self.moment_dtypes
        sl = lambda off, dt, k: buf[off: off + dt.itemsize * k].view(dt)  # noqa: E731
        if self.split:
            return StateViews(None, sl(m, md, n), sl(v, vd, n), None,
                              sl(p, torch.bfloat16, n), sl(p + 2 * n, torch.int16, n))
        return StateViews(sl(p, torch.float32, n), sl(m, md, n), sl(v, vd, n),
                          sl(s, torch.float32, 2 * nblocks(n)) if s is not None else None)


def state_format(name) -> StateFormat:
    """The format called `name` ('fp32' | 'bf16' | 'int8'); ValueError otherwise."""
    return name if isinstance(name, StateFormat) else StateFormat(str(name))


def scratch_numel(fmt, n: int) -> int:
    """fp32 elements of `device_step_`'s scratch for any [lo, hi) of an n-element subgroup."""
    fmt = state_format(fmt)
    return {"fp32": n, "bf16": 3 * n, "bf16-split": 4 * n}.get(fmt.name, 3 * nblocks(n) * BLOCK)


def set_master_(fmt, views: StateViews, x: torch.Tensor, lo: int = 0) -> None:
    """Writes the master of elements [lo, lo + numel(x)) from `x` (weights, any float dtype);
    bf16-split: hi, lo = split_master.split(x) (a bf16 weight splits to (itself, 0) exactly)."""
    fmt, hi = state_format(fmt), lo + x.numel()
    if fmt.split:
        from dos import split_master as sm

        h, l = sm.split(x.reshape(-1).float())
        views.hi[lo:hi].copy_(h)
        views.lo[lo:hi].copy_(l)
    else:
        views.master[lo:hi].copy_(x.reshape(-1))


def master_fp32(fmt, views: StateViews) -> torch.Tensor:
    """The whole subgroup's fp32 master: the view itself, or (bf16-split) a new joined tensor."""
    fmt = state_format(fmt)
    if fmt.split:
        from dos import split_master as sm

        return sm.join(views.hi, views.lo)
    return views.master


# ---- int8 codecs (whole blocks; tensors on any device; no host sync) -------------------------

def _decode_blocks(views: StateViews, n: int, b0: int, b1: int, m_out: torch.Tensor,
                   v_out: torch.Tensor) -> None:
    """Decodes blocks [b0, b1) into m_out/v_out[: (b1-b0)*BLOCK] (zeros past the subgroup)."""
    s, e, nb = b0 * BLOCK, min(n, b1 * BLOCK), nblocks(n)
    k, L = b1 - b0, min(n, b1 * BLOCK) - b0 * BLOCK
    per = lambda x: x[:, None].expand(k, BLOCK).reshape(-1)[:L]  # noqa: E731  one per element
    dm = views.scales[b0:b1] / _QM2
    dv = views.scales[nb + b0: nb + b1] * 2.0 ** -32
    q = views.exp_avg[s:e].float()
    torch.mul(q * q.abs(), per(dm), out=m_out[:L])
    a = views.exp_avg_sq[s:e].float() + 1.0
    a = a * a
    torch.mul(a * a, per(dv), out=v_out[:L])
    m_out[L: k * BLOCK].zero_()
    v_out[L: k * BLOCK].zero_()


def _encode_blocks(views: StateViews, n: int, b0: int, b1: int, m_pad: torch.Tensor,
                   v_pad: torch.Tensor) -> None:
    """Encodes blocks [b0, b1) from fp32 m_pad/v_pad[: (b1-b0)*BLOCK] (zeros past the subgroup)."""
    s, e, nb, k = b0 * BLOCK, min(n, b1 * BLOCK), nblocks(n), b1 - b0
    m2, v2 = m_pad[: k * BLOCK].view(k, BLOCK), v_pad[: k * BLOCK].view(k, BLOCK)
    nan = torch.tensor(float("nan"), device=m2.device)
    s_m, s_v = m2.abs().amax(1), v2.abs().amax(1)
    s_m = torch.where(torch.isfinite(s_m), s_m, nan)
    s_v = torch.where(torch.isfinite(s_v), s_v, nan)
    km = torch.where(s_m > 0, torch.full_like(s_m, _QM2) / s_m, 0.0)
    kv = torch.where(s_v > 0, torch.ones_like(s_v) / s_v, 0.0)
    u = _sqrt(m2.abs() * km[:, None]).round()
    u = torch.where(u.isnan(), 0.0, u).clamp_(max=127.0)
    views.exp_avg[s:e].copy_(torch.copysign(u, m2).view(-1)[: e - s])
    u = (_sqrt(_sqrt(v2 * kv[:, None])) * 256.0).round() - 1.0
    u = torch.where(u.isnan(), 0.0, u).clamp_(0.0, 255.0)
    views.exp_avg_sq[s:e].copy_(u.view(-1)[: e - s])
    views.scales[b0:b1] = s_m
    views.scales[nb + b0: nb + b1] = s_v


def decode(fmt, views: StateViews, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole subgroup's moments as new fp32 tensors (m32, v32)."""
    fmt = state_format(fmt)
    if not fmt.quantized:
        return views.exp_avg[:n].float().clone(), views.exp_avg_sq[:n].float().clone()
    dev, k = views.exp_avg.device, nblocks(n)
    m, v = torch.empty(k * BLOCK, device=dev), torch.empty(k * BLOCK, device=dev)
    _decode_blocks(views, n, 0, k, m, v)
    return m[:n], v[:n]


def encode_(fmt, views: StateViews, m32: torch.Tensor, v32: torch.Tensor) -> None:
    """Stores fp32 moments (the whole subgroup) in `views`' format."""
    fmt = state_format(fmt)
    n = views.numel
    if not fmt.quantized:
        views.exp_avg.copy_(m32)
        views.exp_avg_sq.copy_(v32)
        return
    k = nblocks(n)
    m, v = m32.new_zeros(k * BLOCK, dtype=torch.float32), v32.new_zeros(k * BLOCK, dtype=torch.float32)
    m[:n], v[:n] = m32, v32
    _encode_blocks(views, n, 0, k, m, v)


# ---- the update ------------------------------------------------------------------------------

def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (torch's vectorized fp32 sqrt is not: Sleef, ~0.5001 ulp);
    sqrt in float64 then rounded to fp32 is (53 >= 2*24 + 2 bits: double rounding is harmless)."""
    return x.double().sqrt_().float()


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _math_(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale):
    """The documented fp32 order on fp32 tensors (p, m, v in place; g is not written)."""
    sd = float(_f32(float(step)))  # torch reads state_step as a float
    bc1, bc2 = 1 - beta1 ** sd, 1 - beta2 ** sd
    if grad_scale != 1.0:
        g = g / _f32(grad_scale)
    if weight_decay != 0.0:
        p.mul_(_f32(1 - lr * weight_decay))
    w = _f32(1 - beta1)
    d = g - m
    if abs(w) < 0.5:
        m.copy_(d * w + m)
    else:
        m.copy_(d * _f32(w - 1.0) + g)
    v.mul_(_f32(beta2))
    v.copy_((g * _f32(1 - beta2)) * g + v)
    denom = _sqrt(v) / _f32(math.sqrt(bc2)) + _f32(eps)
    p.copy_(p + (m * _f32(-(lr / bc1))) / denom)


def _range(fmt, views: StateViews, lo: int, hi: int):
    """(the StateFormat, the subgroup's elements); ValueError unless 0 <= lo <= hi <= n."""
    n = views.numel
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"need 0 <= lo <= hi <= {n}, got [{lo}, {hi})")
    return state_format(fmt), n


def reference_step_(fmt, views: StateViews, grad: torch.Tensor, out: Optional[torch.Tensor], *,
                    lo: int, hi: int, step: int, lr: float, beta1: float, beta2: float, eps: float,
                    weight_decay: float, grad_scale: float = 1.0) -> None:
    """Plain-torch oracle: updates elements [lo, hi) of a subgroup in place.

    `views`, `grad` (bf16/fp16/fp32) and `out` are whole-subgroup; `out` (None, `grad` itself, or
    another tensor) receives the new weights [lo, hi) in its dtype.
    """
    fmt, n = _range(fmt, views, lo, hi)
    if lo == hi:
        return
    hp = dict(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              grad_scale=grad_scale)
    if fmt.split:  # weights = hi; `out` (bf16) gets a copy
        from dos import split_master as sm

        sm.reference_step_(views.hi, views.lo, views.exp_avg, views.exp_avg_sq, grad, lo_i=lo,
                           hi_i=hi, out=out, **hp)
        return
    p = views.master[lo:hi]
    g = grad[lo:hi].float()
    if not fmt.quantized:
        m, v = views.exp_avg[lo:hi].float(), views.exp_avg_sq[lo:hi].float()
        _math_(p, g, m, v, **hp)
        views.exp_avg[lo:hi].copy_(m)
        views.exp_avg_sq[lo:hi].copy_(v)
    else:
        b0, b1 = lo // BLOCK, -(-hi // BLOCK)
        s, dev = b0 * BLOCK, p.device
        mp, vp = torch.empty((b1 - b0) * BLOCK, device=dev), torch.empty((b1 - b0) * BLOCK, device=dev)
        _decode_blocks(views, n, b0, b1, mp, vp)
        _math_(p, g, mp[lo - s: hi - s], vp[lo - s: hi - s], **hp)
        _encode_blocks(views, n, b0, b1, mp, vp)
    if out is not None and out.data_ptr() != views.master.data_ptr():
        out[lo:hi].copy_(p)


def device_step_(fmt, views: StateViews, grad: torch.Tensor, out: Optional[torch.Tensor], *,
                 lo: int, hi: int, step_t: torch.Tensor, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, scale_t: Optional[torch.Tensor],
                 scratch: torch.Tensor) -> None:
    """Accelerator-lane update of [lo, hi) with torch ops only (CUDA or CPU), never syncing the host.

    Decodes the moments [lo, hi) (int8: the whole blocks it touches) into fp32 `scratch` (at
    least `scratch_numel(fmt, n)` elements), runs `torch._fused_adamw_` on them, encodes back.
    `step_t` (and `scale_t`, optional) are 0-d tensors on the device; `out` as in
    `reference_step_` (skipped when it is the master itself). Like dos.adam.device_adamw_, an
    fp32 `grad` may be left divided by `scale_t` (torch's fused kernel unscales in place).
    """
    fmt, n = _range(fmt, views, lo, hi)
    if lo == hi:
        return
    L = hi - lo
    if fmt.split:
        _device_split_step_(views, grad, out, lo=lo, hi=hi, step_t=step_t, lr=lr, beta1=beta1,
                            beta2=beta2, eps=eps, weight_decay=weight_decay, scale_t=scale_t,
                            scratch=scratch)
        return
    p = views.master[lo:hi]
    if fmt.name == "fp32":
        m, v, rest = views.exp_avg[lo:hi], views.exp_avg_sq[lo:hi], scratch
    elif fmt.name == "bf16":
        m = scratch[:L].copy_(views.exp_avg[lo:hi])
        v = scratch[L: 2 * L].copy_(views.exp_avg_sq[lo:hi])
        rest = scratch[2 * L:]
    else:
        b0, b1 = lo // BLOCK, -(-hi // BLOCK)
        s, P = b0 * BLOCK, (b1 - b0) * BLOCK
        mp, vp, rest = scratch[:P], scratch[P: 2 * P], scratch[2 * P:]
        _decode_blocks(views, n, b0, b1, mp, vp)
        m, v = mp[lo - s: hi - s], vp[lo - s: hi - s]
    g = grad[lo:hi]
    if g.dtype != torch.float32:
        g = rest[:L].copy_(g)
    torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
                        grad_scale=scale_t, found_inf=None)
    if fmt.name == "bf16":
        views.exp_avg[lo:hi].copy_(m)
        views.exp_avg_sq[lo:hi].copy_(v)
    elif fmt.name == "int8":
        _encode_blocks(views, n, b0, b1, mp, vp)
    if out is not None and out.data_ptr() != views.master.data_ptr():
        out[lo:hi].copy_(p)


def _device_split_step_(views: StateViews, grad, out, *, lo, hi, step_t, lr, beta1, beta2, eps,
                        weight_decay, scale_t, scratch) -> None:
    """bf16-split with torch ops: join into scratch, torch's fused AdamW, split back (4 L of
    scratch: master, moments, gradient)."""
    from dos import split_master as sm

    L = hi - lo
    p = scratch[:L].copy_(sm.join(views.hi[lo:hi], views.lo[lo:hi]))
    m = scratch[L: 2 * L].copy_(views.exp_avg[lo:hi])
    v = scratch[2 * L: 3 * L].copy_(views.exp_avg_sq[lo:hi])
    g = grad[lo:hi]
    if g.dtype != torch.float32:
        g = scratch[3 * L: 4 * L].copy_(g)
    torch._fused_adamw_([p], [g], [m], [v], [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
                        weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
                        grad_scale=scale_t, found_inf=None)
    views.exp_avg[lo:hi].copy_(m)
    views.exp_avg_sq[lo:hi].copy_(v)
    h, l = sm.split(p)
    views.hi[lo:hi].copy_(h)
    views.lo[lo:hi].copy_(l)
    if out is not None:
        out[lo:hi].copy_(views.hi[lo:hi])
