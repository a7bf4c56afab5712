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
