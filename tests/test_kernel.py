"""The fused CPU AdamW kernel (csrc/) against a float64 oracle, with torch's fused AdamW as the bar.

Accuracy criterion (as flash-attention's tests): after 20 steps, the kernel's max abs error against
`adamw_reference` in float64 is at most 2x that of `torch_cpu_adamw_` (torch._fused_adamw_) on the
same inputs, plus one fp32 ulp of the largest reference value (so that an exact torch result on a
tiny tensor does not demand an exact kernel). Every ISA this CPU has, every dtype pairing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dos import _csrc
from helpers import csrc_ops, need_isa, one_torch_thread  # noqa: F401  (fixtures)
from dos.adam import adamw_reference, cpu_adamw_, cpu_impl, torch_cpu_adamw_

NO_CSRC = os.environ.get("DOS_NO_CSRC", "0") not in ("", "0")
ISAS = ["scalar", "avx2", "avx512"]
GRAD_DTYPES = [torch.bfloat16, torch.float32, torch.float16]
OUTS = [None, torch.bfloat16, torch.float16, torch.float32, "alias"]  # "alias": out is grad
NTHREADS = max(1, min(os.cpu_count() or 1, 8))
HP = dict(lr=1e-2, beta2=0.999, eps=1e-8)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.usefixtures("one_torch_thread")
ops = csrc_ops  # the fixture, under the name these tests take it by
need = need_isa


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_rounded(out: torch.Tensor, master: torch.Tensor):
    """`out` is exactly `master.to(out.dtype)` (NaN: any NaN)."""
    want = master.to(out.dtype)
    nan = master.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(bits(out)[~nan], bits(want)[~nan])


def run_case(ops, isa, n, gdt, out_kind, *, wd, scale, threads, beta1=0.9, steps=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    dos_s = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    tor_s = [p0.clone(), torch.zeros(n), torch.zeros(n)]
    ref = [p0.double(), torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)]
    for step in range(1, steps + 1):
        g = torch.randn(n, generator=gen).to(gdt)
        gk = g.clone()
        out = gk if out_kind == "alias" else None if out_kind is None else torch.empty(n, dtype=out_kind)
        ops.adamw_(*dos_s, gk, out, step, HP["lr"], beta1, HP["beta2"], HP["eps"], wd, scale,
                   threads, isa)
        if out is not None:
            assert_rounded(out, dos_s[0])
        if out_kind != "alias":
            assert torch.equal(gk, g), "the kernel wrote into a gradient that is not `out`"
        torch_cpu_adamw_(*tor_s, g.clone(), None, step=step, beta1=beta1, weight_decay=wd,
                         grad_scale=scale, **HP)
        r = adamw_reference(ref[0], g.double(), ref[1], ref[2], step=step, beta1=beta1,
                            weight_decay=wd, grad_scale=scale, **HP)
        ref = list(r)
    for name, k, t, r in zip(("master", "exp_avg", "exp_avg_sq"), dos_s, tor_s, ref):
        err_k = (k.double() - r).abs().max().item()
        err_t = (t.double() - r).abs().max().item()
        floor = torch.finfo(torch.float32).eps * r.abs().max().item()
        assert err_k <= 2 * err_t + floor, (name, err_k, err_t)
    return dos_s


@pytest.mark.parametrize("out_kind", OUTS, ids=str)
@pytest.mark.parametrize("gdt", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
def test_small_odd_sizes_match_reference(ops, isa, gdt, out_kind):
    need(ops, isa)
    for n in (1, 7, 15, 17, 33, 100):
        run_case(ops, isa, n, gdt, out_kind, wd=0.0, scale=1.0, threads=1, seed=n)
        run_case(ops, isa, n, gdt, out_kind, wd=0.1, scale=3.0, threads=NTHREADS, beta1=0.3,
                 seed=n + 1)


LARGE = [(isa, torch.bfloat16, "alias") for isa in ISAS] + [
    ("best", torch.float32, None), ("best", torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("isa,gdt,out_kind", LARGE, ids=str)
def test_large_odd_size_matches_reference(ops, isa, gdt, out_kind):
    isa = need(ops, isa) or isa
    run_case(ops, isa, 1_000_003, gdt, out_kind, wd=0.1, scale=3.0, threads=NTHREADS)


@pytest.mark.parametrize("isa", ISAS)
def test_result_independent_of_threads(ops, isa):
    need(ops, isa)
    n = 1_000_003
    gen = torch.Generator().manual_seed(1)
    p0, m0, v0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    g = torch.randn(n, generator=gen).bfloat16()
    results = []
    for threads in sorted({1, 2, 3, NTHREADS}):
        s = [p0.clone(), m0.clone(), v0.clone()]
        gk = g.clone()
        ops.adamw_(*s, gk, gk, 7, 1e-3, 0.9, 0.999, 1e-8, 0.01, 2.0, threads, isa)
        results.append(s + [gk])
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], r))


@pytest.mark.parametrize("isa", ISAS)
def test_low_precision_outputs_round_like_torch(ops, isa):
    """lr=0 leaves the master unchanged, so any bit pattern reaches the output conversion:
    rounding ties, NaN, inf, subnormals, overflow to inf."""
    need(ops, isa)
    gen = torch.Generator().manual_seed(2)
    rnd = torch.randint(-2**31, 2**31 - 1, (4099,), generator=gen, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(0, 2**16, (512,), generator=gen).to(torch.int32) << 16) | 0x8000
    special = torch.tensor([0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), 3.4e38,
                            -3.4e38, 65504.0, 65520.0, 1e-40, -1e-45, 6e-8, 3e-8, 1 + 2**-8])
    master = torch.cat([rnd.view(torch.float32), ties.view(torch.float32), special])
    n = master.numel()
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        p, out = master.clone(), torch.empty(n, dtype=dt)
        ops.adamw_(p, torch.zeros(n), torch.zeros(n), torch.ones(n), out, 1, 0.0, 0.9, 0.999,
                   1e-8, 0.0, 1.0, 1, isa)
        assert torch.equal(p.isnan(), master.isnan())
        assert_rounded(out, p)


@pytest.mark.parametrize("isa", ISAS)
def test_dispatch_forced_isa_and_alias(ops, isa):
    need(ops, isa)
    n = 4097
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    a, b = [p0.clone(), torch.zeros(n), torch.zeros(n)], [p0.clone(), torch.zeros(n), torch.zeros(n)]
    ga, gb = g.clone(), g.clone()
    try:
        _csrc.set_isa(isa)
        assert cpu_impl() == f"dos-csrc-{isa}"
        cpu_adamw_(*a, ga, ga, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                   weight_decay=0.01, grad_scale=1.5, threads=2)
    finally:
        _csrc.set_isa(None)
    ops.adamw_(*b, gb, gb, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.5, 1, isa)
    assert all(torch.equal(x, y) for x, y in zip(a + [ga], b + [gb]))


def test_best_isa_is_default(ops):
    supported = list(ops.cpu_isas())
    assert supported[-1] == "scalar" and _csrc.pick_isa(None, supported) == supported[0]
    assert _csrc.pick_isa("scalar", supported) == "scalar"
    with pytest.raises(ValueError):
        _csrc.pick_isa("sse9", supported)
    with pytest.raises(ValueError):
        _csrc.pick_isa("avx512", ["avx2", "scalar"])


def test_boundary_checks(ops):
    n = 64
    f = lambda: [torch.zeros(n), torch.zeros(n), torch.zeros(n)]  # noqa: E731
    g = torch.zeros(n, dtype=torch.bfloat16)
    call = lambda s, grad, out, step=1, isa="scalar": ops.adamw_(  # noqa: E731
        *s, grad, out, step, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 0, isa)
    bad = [
        lambda: call([torch.zeros(n, dtype=torch.float64)] + f()[1:], g, None),
        lambda: call(f(), torch.zeros(n + 1, dtype=torch.bfloat16), None),
        lambda: call(f(), torch.zeros(2 * n, dtype=torch.bfloat16)[::2], None),
        lambda: call(f(), torch.zeros(n, dtype=torch.int32), None),
        lambda: call(f(), g, None, step=0),
        lambda: call(f(), g, None, isa="sse9"),
        lambda: call(f(), g, torch.zeros(n, dtype=torch.float64)),
    ]
    buf = torch.zeros(2 * n, dtype=torch.bfloat16)
    bad.append(lambda: call(f(), buf[:n], buf[1:n + 1]))  # out overlaps grad without being it
    s = f()
    bad.append(lambda: call(s, g, s[1]))  # out is the optimizer state
    for b in bad:
        with pytest.raises(RuntimeError):
            b()
    call(f(), g, g)  # out is grad: fine
    s = f()
    call(s, g, s[0])  # out is master: nothing to write


def _python(code: str, **env) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_fallback_warns_once_and_matches_torch():
    out = _python("""
        import warnings, torch
        from dos import _csrc, adam
        n = 1000
        s = [torch.randn(n), torch.zeros(n), torch.zeros(n)]
        t = [x.clone() for x in s]
        g = torch.randn(n).bfloat16()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for step in (1, 2):
                gk = g.clone()
                adam.cpu_adamw_(*s, gk, gk, step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                weight_decay=0.1, grad_scale=2.0, threads=1)
                adam.torch_cpu_adamw_(*t, g.clone(), None, step=step, lr=1e-3, beta1=0.9,
                                      beta2=0.999, eps=1e-8, weight_decay=0.1, grad_scale=2.0)
        assert sum(issubclass(x.category, _csrc.CsrcFallbackWarning) for x in w) == 1, w
        assert all(torch.equal(a, b) for a, b in zip(s, t))
        assert torch.equal(gk, s[0].bfloat16())
        print(adam.cpu_impl())
    """, DOS_NO_CSRC="1")
    assert out.split() == ["torch-fused"]


@pytest.mark.parametrize("isa", ISAS)
def test_static_and_dynamic_schedules_agree_bitwise(ops, isa):
    """DOS_CSRC_SCHEDULE: fixed per-thread ranges ("static", the kernel before 2026-12-02) and
    dynamically handed-out chunks (default) give the same bits, fp32 and low-precision state alike."""
    from dos import state_format as sf

    need(ops, isa)
    n = 300_017
    gen = torch.Generator().manual_seed(3)
    p0, m0, v0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen)
    g = torch.randn(n, generator=gen).bfloat16()
    out = {}
    try:
        for sched in ("static", "dynamic"):
            _csrc.set_schedule(sched)
            s = [p0.clone(), m0.clone(), v0.clone()]
            ops.adamw_(*s, g, None, 7, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 3, isa)
            low = {}
            for fmt in ("bf16", "int8"):
                f = sf.state_format(fmt)
                buf = torch.zeros(f.nbytes(n), dtype=torch.uint8)
                f.views(buf, n).master.copy_(p0)
                vw = f.views(buf, n)
                for step in (1, 2):
                    ops.adamw_lowp_(vw.master, vw.exp_avg, vw.exp_avg_sq, vw.scales, g, None, 5, n, step,
                                    1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 3, isa)
                low[fmt] = buf
            out[sched] = (s, low)
    finally:
        _csrc.set_schedule("dynamic")
    assert all(torch.equal(a, b) for a, b in zip(out["static"][0], out["dynamic"][0]))
    assert all(torch.equal(out["static"][1][f], out["dynamic"][1][f]) for f in ("bf16", "int8"))
    with pytest.raises(ValueError, match="DOS_CSRC_SCHEDULE"):
        _csrc.set_schedule("guided")


def test_env_sets_the_schedule_and_the_record_names_it(ops):
    out = _python("from dos.adam import cpu_impl; print(cpu_impl())", DOS_CSRC_SCHEDULE="static")
    assert out.split()[-1].endswith("-static")
    assert not _python("from dos.adam import cpu_impl; print(cpu_impl())").split()[-1].endswith("-static")


def test_env_forces_isa(ops):
    out = _python("from dos.adam import cpu_impl; print(cpu_impl())", DOS_CSRC_ISA="scalar")
    assert out.split() == ["dos-csrc-scalar"]
