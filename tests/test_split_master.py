"""The split master codec (dos/split_master.py): exact round trip, `hi` is the weight (torch's bf16
cast except at exact ties, where it rounds half away from zero), and its reference update equals
the bf16-moment reference of dos/state_format.py on the joined master."""
import torch

from dos import split_master as sm
from dos import state_format as sf


def _bits_grid() -> torch.Tensor:
    """Every top half with low halves at and around the rounding boundaries, plus random bits."""
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF, 0x1234, 0xC000])
    u = (top[:, None] | lows[None, :]).reshape(-1)
    r = torch.randint(0, 1 << 32, (1 << 20,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    u = torch.cat([u, r])
    return ((u ^ (1 << 31)) - (1 << 31)).to(torch.int32)  # as signed int32 bits


def test_round_trip_is_exact_for_every_non_nan():
    u = _bits_grid()
    x = u.view(torch.float32)
    hi, lo = sm.split(x)
    back = sm.join(hi, lo).view(torch.int32)
    keep = ~x.isnan()
    assert torch.equal(back[keep], u[keep])
    assert sm.join(hi, lo)[~keep].isnan().all() and hi[~keep].float().isnan().all()


def test_hi_is_the_bf16_weight_half_away_at_ties():
    u = _bits_grid()
    x = u.view(torch.float32)
    hi, _ = sm.split(x)
    ok = ~x.isnan()
    tie = (u & 0xFFFF) == 0x8000
    rne = x.to(torch.bfloat16)
    assert torch.equal(hi[ok & ~tie].view(torch.int16), rne[ok & ~tie].view(torch.int16))
    # at a tie: the neighbour of larger magnitude (RNE agrees where that one is even)
    t = ok & tie
    mag = lambda b: b.view(torch.int16).to(torch.int32) & 0x7FFF  # noqa: E731
    assert torch.equal(mag(hi[t]), ((u[t] & 0x7FFFFFFF) >> 16) + 1)
    assert (hi[t].float().abs() >= x[t].abs()).all()
    same = (mag(hi[t]) & 1) == 0
    assert torch.equal(hi[t][same].view(torch.int16), rne[t][same].view(torch.int16))


def test_specials():
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.3895313892515355e38, -1e-45, 1.0])
    hi, lo = sm.split(x)
    assert torch.equal(sm.join(hi, lo).view(torch.int32), x.view(torch.int32))
    assert hi[2] == float("inf") and hi[3] == -float("inf") and lo[2] == 0
    assert hi[1].view(torch.int16) == torch.tensor(-0x8000, dtype=torch.int16)


def test_reference_step_is_the_bf16_reference_on_the_joined_master():
    n, g = 5000, torch.Generator().manual_seed(1)
    master = torch.randn(n, generator=g) * 0.02
    grad = (torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16)
    hi, lo = sm.split(master)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    fmt = sf.state_format("bf16")
    buf = torch.zeros(fmt.nbytes(n), dtype=torch.uint8)
    views = fmt.views(buf, n)
    views.master.copy_(master)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in range(1, 6):
        lo_i, hi_i = (0, n) if step != 3 else (17, 4001)  # a partial update too
        sf.reference_step_(fmt, views, grad, None, lo=lo_i, hi=hi_i, step=step, **hp)
        sm.reference_step_(hi, lo, m16, v16, grad, lo_i=lo_i, hi_i=hi_i, step=step, out=out, **hp)
        assert torch.equal(sm.join(hi, lo).view(torch.int32), views.master.view(torch.int32))
        assert torch.equal(m16.view(torch.int16), views.exp_avg.view(torch.int16))
        assert torch.equal(v16.view(torch.int16), views.exp_avg_sq.view(torch.int16))
        assert torch.equal(out[lo_i:hi_i].view(torch.int16), hi[lo_i:hi_i].view(torch.int16))
    # the weights differ from torch's cast of the master only at exact ties
    diff = hi.view(torch.int16) != views.master.to(torch.bfloat16).view(torch.int16)
    assert (((views.master.view(torch.int32) & 0xFFFF) == 0x8000) | ~diff).all()


# ---- the CPU kernel (torch.ops.dos.adamw_split_) ---------------------------------------------

import pytest  # noqa: E402

from helpers import csrc_ops, need_isa, one_torch_thread  # noqa: E402,F401  (fixtures)

ISAS = ["scalar", "avx2", "avx512"]
SIZES = (1, 7, 31, 33, 5003)
STEPS = [(1, 1e-2, 0.0, 1.0), (2, 3e-2, 0.1, 1.0), (3, 1e-3, 0.0, 4.0), (4, 2e-2, 0.01, 0.5)]


def _state(n, seed=0, specials=False):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    if specials and n >= 8:  # exact ties, a huge value, signed zeros
        master[:4] = torch.tensor([1.0 + 2.0 ** -8, -(1.0 + 3 * 2.0 ** -8), 3.0e38, -0.0])
    hi, lo = sm.split(master)
    z = lambda: torch.zeros(n, dtype=torch.bfloat16)  # noqa: E731
    return hi, lo, z(), z()


def _grads(n, gdt, seed):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if n >= 8:
        g[5], g[6] = float("inf"), float("nan")  # poison two elements: both paths alike
    return g.to(gdt)


def _same_master(a, b):
    """Bitwise, except that a NaN master is a NaN (the split keeps no NaN payload)."""
    nan = b.isnan()
    assert torch.equal(a.isnan(), nan)
    assert torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_kind", [None, "alias", "apart"])
def test_kernel_is_the_bf16_kernel_on_the_joined_master(csrc_ops, isa, n, gdt, out_kind):
    """Same ISA, same math: the split kernel's joined master and moments equal the bf16-moment
    kernel's (adamw_lowp_) bitwise, step after step; its weights are `hi`; the scalar path also
    equals the plain-torch reference bitwise."""
    need_isa(csrc_ops, isa)
    if out_kind == "alias" and gdt != torch.bfloat16:
        pytest.skip("the weights overwrite the gradient only in the weights' dtype")
    hi, lo, m, v = _state(n, specials=True)
    master = sm.join(hi, lo)
    m2, v2 = m.clone(), v.clone()
    rhi, rlo, rm, rv = hi.clone(), lo.clone(), m.clone(), v.clone()
    for step, lr, wd, scale in STEPS:
        g = _grads(n, gdt, step)
        g2, gr = g.clone(), g.clone()
        out = {None: None, "alias": g, "apart": torch.empty(n, dtype=torch.bfloat16)}[out_kind]
        csrc_ops.adamw_split_(hi, lo, m, v, g, out, 0, n, step, lr, 0.9, 0.999, 1e-8, wd, scale, 2, isa)
        csrc_ops.adamw_lowp_(master, m2, v2, None, g2, None, 0, n, step, lr, 0.9, 0.999, 1e-8, wd,
                             scale, 1, isa)
        _same_master(sm.join(hi, lo), master)
        assert torch.equal(m.view(torch.int16), m2.view(torch.int16))
        assert torch.equal(v.view(torch.int16), v2.view(torch.int16))
        if out is not None:
            assert torch.equal(out.view(torch.int16), hi.view(torch.int16))
        if isa == "scalar":
            sm.reference_step_(rhi, rlo, rm, rv, gr, lo_i=0, hi_i=n, step=step, lr=lr, beta1=0.9,
                               beta2=0.999, eps=1e-8, weight_decay=wd, grad_scale=scale)
            # NaN-aware: torch's vectorized bf16 cast keeps a NaN moment's sign and payload bits,
            # which reach the master's NaN sign; every other element is bitwise equal
            _same_master(sm.join(hi, lo), sm.join(rhi, rlo))
            for a, b in ((m, rm), (v, rv)):
                _same_master(a.float(), b.float())


@pytest.mark.parametrize("isa", ["scalar", "best"])
def test_kernel_segments_leave_the_rest(csrc_ops, isa):
    isa = need_isa(csrc_ops, isa) or isa
    n = 5003
    hi, lo, m, v = _state(n, seed=3)
    before = [t.clone() for t in (hi, lo, m, v)]
    g = _grads(n, torch.bfloat16, 9)
    csrc_ops.adamw_split_(hi, lo, m, v, g, None, 17, 4001, 1, 1e-2, 0.9, 0.999, 1e-8, 0.1, 1.0, 2, isa)
    for a, b in zip((hi, lo, m, v), before):
        assert torch.equal(a[:17].view(torch.int16), b[:17].view(torch.int16))
        assert torch.equal(a[4001:].view(torch.int16), b[4001:].view(torch.int16))
    assert not torch.equal(hi[17:4001].view(torch.int16), before[0][17:4001].view(torch.int16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("first", [0, 1])
def test_kernel_codec_round_trips_every_boundary_pattern(csrc_ops, isa, first):
    """lr = 0 leaves each master as it was, so the kernel stores split(x) again: its codec
    (pairs in even/odd lanes on the vector ISAs) is split/join bitwise on every top half with the
    rounding-boundary low halves and 2^20 random patterns, NaNs and infinities among them; `first`
    shifts each pattern into the other lane of its pair."""
    need_isa(csrc_ops, isa)
    u = _bits_grid()
    x = torch.cat([torch.zeros(first, dtype=torch.int32), u]).view(torch.float32)
    n = x.numel()
    hi, lo = sm.split(x)
    want_hi, want_lo = hi.clone(), lo.clone()
    z = lambda: torch.zeros(n, dtype=torch.bfloat16)  # noqa: E731
    csrc_ops.adamw_split_(hi, lo, z(), z(), z(), None, first, n, 1, 0.0, 0.9, 0.999, 1e-8, 0.0, 1.0,
                          2, isa)
    assert torch.equal(hi.view(torch.int16), want_hi.view(torch.int16))
    assert torch.equal(lo, want_lo)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("first", [0, 1])
def test_kernel_moments_round_every_bf16_gradient_as_the_bf16_kernel(csrc_ops, isa, first):
    """Every bf16 gradient bit pattern, in both lanes of a pair: with beta2 = 0 the new exp_avg_sq
    is bf16(g * g) (every rounding case, ties, overflow to inf, NaN), and moments and master equal
    the bf16-moment kernel's (adamw_lowp_, the widening codec) bitwise."""
    need_isa(csrc_ops, isa)
    g = torch.cat([torch.zeros(first, dtype=torch.int16),
                   torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)]).view(torch.bfloat16)
    n = g.numel()
    hi, lo, m, v = _state(n, seed=7)
    master = sm.join(hi, lo)
    m2, v2 = m.clone(), v.clone()
    for step in (1, 2):
        g2 = g.clone()
        csrc_ops.adamw_split_(hi, lo, m, v, g, None, 0, n, step, 1e-2, 0.5, 0.0, 1e-8, 0.01, 1.0, 2, isa)
        csrc_ops.adamw_lowp_(master, m2, v2, None, g2, None, 0, n, step, 1e-2, 0.5, 0.0, 1e-8, 0.01,
                             1.0, 1, isa)
        _same_master(sm.join(hi, lo), master)
        want_hi, want_lo = sm.split(master)  # and bitwise: a NaN (payloads from g) is sign | 0x7FC0, lo 0
        assert torch.equal(hi.view(torch.int16), want_hi.view(torch.int16))
        assert torch.equal(lo, want_lo)
        assert torch.equal(m.view(torch.int16), m2.view(torch.int16))
        assert torch.equal(v.view(torch.int16), v2.view(torch.int16))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kernel", ["split", "bf16"])
@pytest.mark.parametrize("n,lo_i,hi_i", [(7, 0, 7), (33, 0, 33), (100, 3, 97), (5003, 17, 4001),
                                         (70001, 0, 70001)])
@pytest.mark.parametrize("out_kind", [None, "apart"])
def test_pairs_equal_the_widening_codec(csrc_ops, isa, kernel, n, lo_i, hi_i, out_kind):
    """The pairs (a bf16 gradient) against the widening path of the same kernel (an fp32 gradient
    holding the same values: the other codec, same math): moments, master and weights bitwise, step
    after step, with ties, huge values and inf/NaN gradients, on segments starting at odd elements."""
    need_isa(csrc_ops, isa)
    hp = (0.9, 0.999, 1e-8)
    if kernel == "split":
        a = list(_state(n, seed=11, specials=True))
        b = [t.clone() for t in a]
    else:
        hi, lo, m, v = _state(n, seed=11, specials=True)
        a = [sm.join(hi, lo), m, v]
        b = [t.clone() for t in a]
    for step, lr, wd, scale in STEPS:
        g = _grads(n, torch.bfloat16, step)
        g32 = g.float()
        outs = [None, None] if out_kind is None else [torch.zeros(n, dtype=torch.bfloat16) for _ in "ab"]
        if kernel == "split":
            csrc_ops.adamw_split_(*a, g, outs[0], lo_i, hi_i, step, lr, *hp, wd, scale, 2, isa)
            csrc_ops.adamw_split_(*b, g32, outs[1], lo_i, hi_i, step, lr, *hp, wd, scale, 2, isa)
        else:
            csrc_ops.adamw_lowp_(a[0], a[1], a[2], None, g, outs[0], lo_i, hi_i, step, lr, *hp, wd,
                                 scale, 2, isa)
            csrc_ops.adamw_lowp_(b[0], b[1], b[2], None, g32, outs[1], lo_i, hi_i, step, lr, *hp, wd,
                                 scale, 2, isa)
        for x, y in zip(a + outs[:1] * (out_kind is not None), b + outs[1:] * (out_kind is not None)):
            if x.dtype == torch.float32:
                _same_master(x, y)
                assert torch.equal(x.isnan().sum(), y.isnan().sum())
            else:
                xi, yi = (t.view(torch.int16) for t in (x, y))
                assert torch.equal(xi, yi)


def test_kernel_rejects_bad_input(csrc_ops):
    n = 64
    hi, lo, m, v = _state(n)
    g = torch.zeros(n, dtype=torch.bfloat16)
    args = (0, n, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1, "scalar")
    with pytest.raises(RuntimeError, match="hi bfloat16 and lo int16"):
        csrc_ops.adamw_split_(hi, lo.view(torch.bfloat16), m, v, g, None, *args)
    with pytest.raises(RuntimeError, match="overlap"):
        csrc_ops.adamw_split_(hi, lo, m, m, g, None, *args)
    with pytest.raises(RuntimeError, match="out must be contiguous bfloat16"):
        csrc_ops.adamw_split_(hi, lo, m, v, g, torch.empty(n), *args)
    with pytest.raises(RuntimeError, match="lo <= hi"):
        csrc_ops.adamw_split_(hi, lo, m, v, g, None, 5, 2, *args[2:])


def test_python_entry_falls_back_to_the_reference(monkeypatch):
    from dos import _csrc
    from dos.adam import cpu_split_step_

    n = 300
    a, b = _state(n, seed=4), _state(n, seed=4)
    g = _grads(n, torch.bfloat16, 2)
    hp = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    monkeypatch.setattr(_csrc, "ops", lambda: None)
    cpu_split_step_(*a, g, None, lo_i=0, hi_i=n, **hp)
    sm.reference_step_(*b, g, lo_i=0, hi_i=n, **hp)
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
