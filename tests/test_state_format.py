"""Optimizer-state formats (dos/state_format.py) and their C++ kernel (torch.ops.dos.adamw_lowp_).

Bounds (plain-torch `reference_step_` is the oracle):
- scalar ISA: bitwise, over several steps from the same start (the kernel's scalar path uses the
  reference's unfused fp32 order and correctly rounded sqrt/div).
- AVX2/AVX-512 and `device_step_` (torch fused AdamW): the same step from the same state, checked
  one step at a time (an FMA's 1-ulp change of a moment can flip its bf16 or int8 rounding, and
  later steps then diverge by an lr-sized amount, so multi-step runs are not comparable).
  master: |dp| <= 8 ulp of (|p| + |p - p_before|) (FMAs in lerp, v and the step; torch's Sleef
  sqrt); fp32 moments: 4 ulp of the operands (|m_old| + |g|, |v_old| + g^2: m can cancel to ~0);
  bf16 moments: that, plus one bf16 ulp (2^-7 relative); int8: every code within 1, under 1% of
  the codes differing, scales within 8 ulp relative.
"""
from __future__ import annotations

import os

import pytest
import torch

from dos import _csrc
from helpers import csrc_ops, need_isa, one_torch_thread  # noqa: F401  (fixtures)
from dos import state_format as sf
from dos.adam import cpu_adamw_, cpu_state_step_

NO_CSRC = os.environ.get("DOS_NO_CSRC", "0") not in ("", "0")
ISAS = ["scalar", "avx2", "avx512"]
FMTS = ["fp32", "bf16", "int8"]
SIZES = (1, 7, 2047, 2048, 2049, 5003)
EPS32 = torch.finfo(torch.float32).eps
STEPS = [  # (step, lr, weight_decay, grad_scale)
    (1, 1e-2, 0.0, 1.0), (2, 3e-2, 0.1, 1.0), (3, 1e-3, 0.0, 4.0), (4, 2e-2, 0.01, 0.5)]


pytestmark = pytest.mark.usefixtures("one_torch_thread")
ops = csrc_ops  # the fixture, under the name these tests take it by
need = need_isa


def new_state(fmt, n, seed=0):
    f = sf.state_format(fmt)
    buf = torch.zeros(f.nbytes(n), dtype=torch.uint8)
    views = f.views(buf, n)
    views.master.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return buf, views


def make_out(kind, g, n):
    return g if kind == "alias" else None if kind is None else torch.empty(n, dtype=kind)


def kernel(ops, views, g, out, isa, *, lo, hi, step, lr, wd, scale, threads=1, beta1=0.9):
    ops.adamw_lowp_(views.master, views.exp_avg, views.exp_avg_sq, views.scales, g, out, lo, hi,
                    step, lr, beta1, 0.999, 1e-8, wd, scale, threads, isa)


def reference(fmt, views, g, out, *, lo, hi, step, lr, wd, scale, beta1=0.9):
    sf.reference_step_(fmt, views, g, out, lo=lo, hi=hi, step=step, lr=lr, beta1=beta1,
                       beta2=0.999, eps=1e-8, weight_decay=wd, grad_scale=scale)


def assert_close(fmt, k: sf.StateViews, r: sf.StateViews, before: tuple, n: int):
    """The vector-path bound of the module docstring (k: kernel, r: reference; `before`: the
    reference's master and decoded moments before the step, and g / grad_scale)."""
    p0, m0, v0, g = before
    dp = (k.master - r.master).abs()
    tol = 8 * EPS32 * (r.master.abs() + (r.master - p0).abs())
    assert bool((dp <= tol).all()), ("master", (dp - tol).max().item())
    # fp32 moments before storage differ by a few ulp of the lerp's / sum's operands (m can
    # cancel to ~0, so relative to those, not to m)
    slack_m = 4 * EPS32 * (m0.abs() + g.abs() + r.exp_avg.float().abs())
    slack_v = 4 * EPS32 * (v0.abs() + g * g + r.exp_avg_sq.float().abs())
    if fmt in ("fp32", "bf16"):
        ulp = 0.0 if fmt == "fp32" else 2.0 ** -7  # one bf16 ulp, relative
        for a, b, sl in ((k.exp_avg, r.exp_avg, slack_m), (k.exp_avg_sq, r.exp_avg_sq, slack_v)):
            a, b = a.float(), b.float()
            tol = ulp * torch.maximum(a.abs(), b.abs()) + (1 + ulp) * sl
            assert bool(((a - b).abs() <= tol).all()), (fmt, ((a - b).abs() - tol).max().item())
    else:
        for a, b in ((k.exp_avg, r.exp_avg), (k.exp_avg_sq, r.exp_avg_sq)):
            d = (a.int() - b.int()).abs()
            assert int(d.max()) <= 1, ("int8 code off by", int(d.max()))
            assert int((d > 0).sum()) <= max(1, n // 100), ("int8 codes differing", int((d > 0).sum()))
        s = r.scales
        assert bool(((k.scales - s).abs() <= 8 * EPS32 * s.abs()).all()), "int8 scales"


def snapshot(fmt, views, g, scale, n):
    m, v = sf.decode(fmt, views, n)
    return views.master.clone(), m, v, g.float() / scale


def assert_out(out, master, lo, hi):
    assert torch.equal(out[lo:hi], master[lo:hi].to(out.dtype))


# ---- layout --------------------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES + (0, 2 * 2048 + 1))
def test_layout_sizes_offsets_alignment(n):
    nb = -(-n // sf.BLOCK)
    want = {"fp32": 12 * n, "bf16": 8 * n, "int8": (6 * n + 3) // 4 * 4 + 8 * nb, "bf16-split": 8 * n}
    for name in sf.STATE_DTYPES:
        f = sf.state_format(name)
        assert f.nbytes(n) == want[name]
        buf = torch.arange(f.nbytes(n) + 5, dtype=torch.int64).to(torch.uint8)
        v = f.views(buf, n)
        if f.split:  # hi bf16 | lo int16 | exp_avg | exp_avg_sq
            assert v.master is None and v.scales is None and v.numel == n
            assert (v.hi.dtype, v.lo.dtype, v.exp_avg.dtype, v.exp_avg_sq.dtype) == (
                torch.bfloat16, torch.int16, torch.bfloat16, torch.bfloat16)
            if n:
                base = buf.data_ptr()
                assert [t.data_ptr() - base for t in (v.hi, v.lo, v.exp_avg, v.exp_avg_sq)] == [0, 2 * n, 4 * n, 6 * n]
            continue
        assert (v.master.dtype, v.exp_avg.dtype, v.exp_avg_sq.dtype) == (torch.float32,) + f.moment_dtypes
        assert [t.numel() for t in v[:3]] == [n, n, n]
        if n == 0:
            continue
        base = buf.data_ptr()
        offs = [t.data_ptr() - base for t in v[:3]]
        es = f.moment_dtypes[0].itemsize
        assert offs == [0, 4 * n, 4 * n + es * n]
        if name == "fp32":  # today's thirds of a 12n buffer
            thirds = buf[: 12 * n].view(torch.float32).view(3, n) if n else None
            if n:
                assert all(a.data_ptr() == b.data_ptr() and torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(v[:3], thirds))
            assert v.scales is None
        elif name == "bf16":
            assert v.scales is None
        else:
            so = v.scales.data_ptr() - base
            assert so % 4 == 0 and so >= 6 * n and so + 8 * nb == f.nbytes(n)
            assert v.scales.numel() == 2 * nb and v.scales.dtype == torch.float32
        for t in v[:3]:
            assert t.data_ptr() + t.nbytes <= base + f.nbytes(n)


def test_format_api():
    assert sf.STATE_DTYPES == ("fp32", "bf16", "int8", "bf16-split") and sf.BLOCK == 2048
    assert [sf.state_format(x).bytes_per_element for x in sf.STATE_DTYPES] == [12, 8, 6 + 8 / 2048, 8]
    assert sf.state_format("int8").moment_dtypes == (torch.int8, torch.uint8)
    assert sf.state_format(sf.state_format("bf16")) == sf.StateFormat("bf16")
    with pytest.raises(ValueError, match="fp32, bf16, int8, bf16-split"):
        sf.state_format("fp8")
    with pytest.raises(ValueError):
        sf.state_format("bf16").views(torch.zeros(10, dtype=torch.uint8), 2)
    assert sf.scratch_numel("int8", 2049) >= 3 * 2 * 2048 and sf.scratch_numel("bf16", 5) == 15
    assert sf.scratch_numel("bf16-split", 5) == 20 and sf.state_format("bf16-split").split


def test_codec_roundtrip_and_zero_state():
    n = 5003
    f = sf.state_format("int8")
    buf = torch.zeros(f.nbytes(n), dtype=torch.uint8)
    v = f.views(buf, n)
    m0, v0 = sf.decode(f, v, n)  # a zero buffer is the zero state
    assert not m0.any() and not v0.any()
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(n, generator=gen) * torch.logspace(-3, 0, n)
    s = torch.rand(n, generator=gen) * torch.logspace(-4, 0, n)
    sf.encode_(f, v, m, s)
    md, sd = sf.decode(f, v, n)
    for b in range(-(-n // 2048)):  # error <= half a code step (square / fourth-power law)
        sl = slice(b * 2048, min(n, (b + 1) * 2048))
        s_m, s_v = m[sl].abs().max(), s[sl].max()
        step_m = s_m * ((m[sl].abs() / s_m).sqrt() * 127 + 0.51).square() / 127 ** 2 - m[sl].abs()
        assert bool(((md[sl] - m[sl]).abs() <= step_m + 1e-6 * s_m).all())
        hi = s_v * (((s[sl] / s_v) ** 0.25 * 256 + 0.51) / 256) ** 4
        lo = s_v * ((((s[sl] / s_v) ** 0.25 * 256 - 0.51).clamp(min=1)) / 256) ** 4
        assert bool(((sd[sl] <= hi * (1 + 1e-5)) & (sd[sl] >= lo * (1 - 1e-5))).all())
        assert bool((sd[sl] > 0).all())  # a decoded v is never 0
    sf.encode_(f, v, md, sd)  # idempotent once on the grid
    assert torch.equal(torch.stack(sf.decode(f, v, n)), torch.stack([md, sd]))


# ---- kernel vs reference -------------------------------------------------------------------

OUTS = [None, "alias", torch.bfloat16, torch.float32]


@pytest.mark.parametrize("out_kind", OUTS, ids=str)
@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_matches_reference(ops, isa, fmt, gdt, out_kind):
    need(ops, isa)
    exact = isa == "scalar"
    for n in SIZES:
        kb, kv = new_state(fmt, n, seed=n)
        rb, rv = new_state(fmt, n, seed=n)
        gen = torch.Generator().manual_seed(n + 1)
        for step, lr, wd, scale in STEPS:
            g = torch.randn(n, generator=gen).to(gdt)
            gk, gr = g.clone(), g.clone()
            ok, orf = make_out(out_kind, gk, n), make_out(out_kind, gr, n)
            if not exact:  # one step from the reference's state
                kb.copy_(rb)
            before = snapshot(fmt, rv, g, scale, n)
            kernel(ops, kv, gk, ok, isa, lo=0, hi=n, step=step, lr=lr, wd=wd, scale=scale)
            reference(fmt, rv, gr, orf, lo=0, hi=n, step=step, lr=lr, wd=wd, scale=scale)
            if exact:
                assert torch.equal(kb, rb), (n, step)
            else:
                assert_close(fmt, kv, rv, before, n)
            if ok is not None:
                assert_out(ok, kv.master, 0, n)
            if out_kind != "alias":
                assert torch.equal(gk, g)


def test_bitwise_checks_catch_one_wrong_code(ops):
    """The harness can fail: one code off by one breaks bitwise equality; by two, the bound."""
    n = 5003
    kb, kv = new_state("int8", n)
    rb, rv = new_state("int8", n)
    g = torch.randn(n)
    kernel(ops, kv, g, None, "scalar", lo=0, hi=n, step=1, lr=1e-2, wd=0.0, scale=1.0)
    reference("int8", rv, g, None, lo=0, hi=n, step=1, lr=1e-2, wd=0.0, scale=1.0)
    assert torch.equal(kb, rb)
    kv.exp_avg[100] += 1 if kv.exp_avg[100] < 127 else -1
    assert not torch.equal(kb, rb)
    kv.exp_avg[100] += 1 if kv.exp_avg[100] < 127 else -3
    with pytest.raises(AssertionError):
        assert_close("int8", kv, rv, snapshot("int8", rv, g, 1.0, n), n)


SEGMENTS = [(0, 1), (5, 2047), (2047, 2049), (100, 4500), (2048, 4096), (4096, 5003), (3, 3)]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("isa", ["scalar", "best"])
def test_segments_match_reference_and_leave_the_rest(ops, isa, fmt):
    isa = ops.cpu_isas()[0] if isa == "best" else isa
    n = 5003
    kb, kv = new_state(fmt, n)
    rb, rv = new_state(fmt, n)
    gen = torch.Generator().manual_seed(7)
    for i, (lo, hi) in enumerate(SEGMENTS * 2):
        step, lr, wd, scale = STEPS[i % len(STEPS)]
        g = torch.randn(n, generator=gen).bfloat16()
        gk = g.clone()
        if isa != "scalar":
            kb.copy_(rb)
        kb0 = kb.clone()
        before = snapshot(fmt, rv, g, scale, n)
        kernel(ops, kv, gk, gk, isa, lo=lo, hi=hi, step=step, lr=lr, wd=wd, scale=scale, threads=2)
        reference(fmt, rv, g.clone(), None, lo=lo, hi=hi, step=step, lr=lr, wd=wd, scale=scale)
        if isa == "scalar":
            assert torch.equal(kb, rb), (lo, hi)
        else:
            assert_close(fmt, kv, rv, before, n)
        old = sf.state_format(fmt).views(kb0, n)
        assert_out(gk, kv.master, lo, hi)
        outside = torch.ones(n, dtype=torch.bool)
        outside[lo:hi] = False
        assert torch.equal(gk[outside], g[outside])
        assert torch.equal(kv.master[outside], old.master[outside])
        if fmt != "int8":
            assert torch.equal(kv.exp_avg[outside], old.exp_avg[outside])
            assert torch.equal(kv.exp_avg_sq[outside], old.exp_avg_sq[outside])
        else:  # blocks [lo, hi) does not touch keep codes and scales
            touched = torch.zeros(n, dtype=torch.bool)
            if hi > lo:
                touched[lo // 2048 * 2048: -(-hi // 2048) * 2048] = True
            assert torch.equal(kv.exp_avg[~touched], old.exp_avg[~touched])
            assert torch.equal(kv.exp_avg_sq[~touched], old.exp_avg_sq[~touched])


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_split_update_equals_whole(ops, fmt):
    n, isa = 5003, ops.cpu_isas()[0]
    ab, av = new_state(fmt, n)
    bb, bv = new_state(fmt, n)
    for step in (1, 2):
        g = torch.randn(n, generator=torch.Generator().manual_seed(step))
        kernel(ops, av, g, None, isa, lo=0, hi=n, step=step, lr=1e-2, wd=0.1, scale=2.0)
        for lo, hi in ((0, 1000), (1000, 1001), (1001, n)):
            kernel(ops, bv, g, None, isa, lo=lo, hi=hi, step=step, lr=1e-2, wd=0.1, scale=2.0)
    assert torch.equal(ab, bb)


@pytest.mark.parametrize("fmt", FMTS)
def test_result_independent_of_threads(ops, fmt):
    n, isa = 3 * 32768 + 2048 * 3 + 5, ops.cpu_isas()[0]
    results = []
    for threads in (1, 2, 3):
        b, v = new_state(fmt, n)
        g = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
        for step, lo in ((1, 0), (2, 777), (3, 4096)):
            kernel(ops, v, g, g, isa, lo=lo, hi=n - lo // 2, step=step, lr=1e-2, wd=0.1,
                   scale=2.0, threads=threads)
        results.append(torch.cat([b, g.view(torch.uint8)]))
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_poisoned_block_is_nan_and_contained(ops):
    n = 5003
    for isa in ops.cpu_isas():
        kb, kv = new_state("int8", n)
        rb, rv = new_state("int8", n)
        g = torch.randn(n)
        g[2100] = float("nan")
        kernel(ops, kv, g, None, isa, lo=0, hi=n, step=1, lr=1e-2, wd=0.0, scale=1.0)
        reference("int8", rv, g, None, lo=0, hi=n, step=1, lr=1e-2, wd=0.0, scale=1.0)
        m, v = sf.decode("int8", kv, n)
        assert m[2048:4096].isnan().all() and v[2048:4096].isnan().all()
        assert m[:2048].isfinite().all() and m[4096:].isfinite().all()
        assert torch.equal(kv.exp_avg, rv.exp_avg) and torch.equal(kv.exp_avg_sq, rv.exp_avg_sq)
        assert torch.equal(kv.scales.isnan(), rv.scales.isnan())


def test_boundary_checks(ops):
    n = 3000
    b, v = new_state("int8", n)
    g = torch.zeros(n, dtype=torch.bfloat16)
    call = lambda *s, lo=0, hi=n, grad=g, out=None: ops.adamw_lowp_(  # noqa: E731
        *s, grad, out, lo, hi, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1, "scalar")
    S = (v.master, v.exp_avg, v.exp_avg_sq, v.scales)
    bad = [
        lambda: call(*S, lo=-1), lambda: call(*S, hi=n + 1), lambda: call(*S, lo=5, hi=4),
        lambda: call(*S[:3], None),  # int8 without scales
        lambda: call(*S[:3], torch.zeros(3)),  # wrong scale count
        lambda: call(v.master, v.exp_avg, v.exp_avg_sq.view(torch.int8), v.scales),
        lambda: call(v.master, v.exp_avg.view(torch.uint8), v.exp_avg_sq, v.scales),
        lambda: call(*S, grad=torch.zeros(n + 1)),
        lambda: call(*S, out=b[: 2 * n].view(torch.bfloat16)),  # out overlaps the state
        lambda: call(v.master, v.exp_avg, v.exp_avg, v.scales),  # moments overlap (and dtype)
        lambda: call(*S, grad=b[:2 * n].view(torch.bfloat16)),  # grad overlaps the state
    ]
    fb, fv = new_state("bf16", n)
    bad.append(lambda: call(*fv[:3], torch.zeros(4)))  # bf16 with scales
    bad.append(lambda: call(fv.master, fv.exp_avg, fv.exp_avg, None))  # overlapping moments
    for x in bad:
        with pytest.raises(RuntimeError):
            x()
    call(*S, out=g, grad=g)  # out is grad: fine
    call(*S, out=v.master)  # out is master: nothing to write


# ---- entry points --------------------------------------------------------------------------

def test_cpu_state_step_fp32_is_torch_adamw(ops):
    """fp32 through the new entry point: today's kernel on the slices, and torch.optim.AdamW's
    result within test_kernel.py's criterion (2x torch's own error against float64, + 1 ulp)."""
    n = 4099
    b, v = new_state("fp32", n)
    p = torch.nn.Parameter(v.master.clone())
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    ref = [v.master.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)]
    t = [v.master.clone(), torch.zeros(n), torch.zeros(n)]
    from dos.adam import adamw_reference
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 11):
        g = torch.randn(n, generator=gen)
        cpu_state_step_("fp32", v, g.clone(), None, lo=0, hi=n, step=step, lr=1e-2, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.1, threads=1)
        cpu_adamw_(*t, g.clone(), None, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.1, threads=1)
        p.grad = g.clone()
        opt.step()
        ref = list(adamw_reference(ref[0], g.double(), ref[1], ref[2], step=step, lr=1e-2,
                                   beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1))
    assert all(torch.equal(a, b) for a, b in zip(v[:3], t))
    st = opt.state[p]
    for k, tt, r in zip(v[:3], (p.detach(), st["exp_avg"], st["exp_avg_sq"]), ref):
        err_k, err_t = (k.double() - r).abs().max().item(), (tt.double() - r).abs().max().item()
        assert err_k <= 2 * err_t + EPS32 * r.abs().max().item(), (err_k, err_t)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_cpu_state_step_dispatch_and_fallback(ops, fmt, monkeypatch):
    n = 3001
    ab, av = new_state(fmt, n)
    bb, bv = new_state(fmt, n)
    g = torch.randn(n).bfloat16()
    ga, gb = g.clone(), g.clone()
    hp = dict(lo=10, hi=2900, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.1, grad_scale=2.0)
    try:
        _csrc.set_isa("scalar")
        cpu_state_step_(fmt, av, ga, ga, **hp, threads=2)
    finally:
        _csrc.set_isa(None)
    monkeypatch.setattr(_csrc, "ops", lambda: None)  # the DOS_NO_CSRC path: the reference
    cpu_state_step_(fmt, bv, gb, gb, **hp)
    assert torch.equal(ab, bb) and torch.equal(ga, gb)


@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", FMTS)
def test_device_step_on_cpu_matches_reference(fmt, gdt):
    """torch fused AdamW on decoded copies (the accelerator lane's path), run on CPU tensors."""
    n = 5003
    db, dv = new_state(fmt, n)
    rb, rv = new_state(fmt, n)
    scratch = torch.full((sf.scratch_numel(fmt, n),), float("nan"))
    gen = torch.Generator().manual_seed(5)
    for i, (lo, hi) in enumerate([(0, n), (0, n), (100, 4500), (2048, 4096), (0, n)]):
        step, lr, wd, scale = STEPS[i % len(STEPS)]
        g = torch.randn(n, generator=gen).to(gdt)
        out = torch.empty(n, dtype=torch.bfloat16)
        db.copy_(rb)
        before = snapshot(fmt, rv, g, scale, n)
        sf.device_step_(fmt, dv, g.clone(), out, lo=lo, hi=hi, step_t=torch.tensor(float(step)),
                        lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                        scale_t=None if scale == 1.0 else torch.tensor(scale), scratch=scratch)
        reference(fmt, rv, g.clone(), None, lo=lo, hi=hi, step=step, lr=lr, wd=wd, scale=scale)
        assert_close(fmt, dv, rv, before, n)
        assert_out(out, dv.master, lo, hi)


# ---- convergence ---------------------------------------------------------------------------

def _least_squares(fmt, steps=300, corrupt=None):
    """Loss of a 64x128 linear regression (8192 weights, 4 int8 blocks) after `steps` AdamW steps."""
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(512, 128, generator=gen)
    W_true = torch.randn(64, 128, generator=gen) * torch.logspace(-2, 0, 128)
    Y = X @ W_true.T + 0.01 * torch.randn(512, 64, generator=gen)
    n = 64 * 128
    buf, v = new_state(fmt, n)
    v.master.zero_()
    w = torch.zeros(64, 128, requires_grad=True)
    for step in range(1, steps + 1):
        w.data.copy_(v.master.view(64, 128))
        w.grad = None
        loss = ((X @ w.T - Y) ** 2).mean()
        loss.backward()
        cpu_state_step_(fmt, v, w.grad.view(-1).bfloat16(), None, lo=0, hi=n, step=step,
                        lr=1e-2 if step < 200 else 2e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.0, threads=1)
        if corrupt is not None:
            corrupt(v)
    with torch.no_grad():
        return ((X @ v.master.view(64, 128).T - Y) ** 2).mean().item()


def test_low_precision_states_converge_like_fp32(ops):
    """bf16 and int8 end within 1.5x of fp32's loss (and far below the start): guards against
    a broken quantizer; a v that decodes to 0 (its scale lost) must fail the same bound."""
    base = _least_squares("fp32")
    start = _least_squares("fp32", steps=0)
    assert base < 0.05 * start
    for fmt in ("bf16", "int8"):
        loss = _least_squares(fmt)
        assert loss <= 1.5 * base + 1e-4, (fmt, loss, base)
    nb = sf.nblocks(64 * 128)
    broken = _least_squares("int8", corrupt=lambda v: v.scales[nb:].zero_())
    assert not broken <= 1.5 * base + 1e-4, (broken, base)
