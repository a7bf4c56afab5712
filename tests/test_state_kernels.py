"""The fused accelerator-lane kernels (dos/state_kernels.py) against `state_format.reference_step_`.

Claim: bitwise equal to the reference (same fp32 operation order, no FMA contraction, correctly
rounded division and sqrt), checked one launch at a time and over several steps, for bf16 and int8
state, bf16/fp32 gradients, sub-ranges that cut int8 blocks, odd sizes, weight decay, a gradient
divisor and NaN poisoning. Runs on CUDA (`-m gpu`) and on the CPU under Triton's interpreter
(TRITON_INTERPRET=1: numpy, IEEE fp32 without contraction), so CI checks the kernels' logic where
Triton is installed; the engine path (lanes -> adam.device_state_step_ -> the kernel) is checked
against the plain-torch reference under the interpreter too.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from dos import state_format as sf

triton = pytest.importorskip("triton")

FMTS = ["bf16", "int8"]
SIZES = (1, 7, 2047, 2048, 2049, 5003, 9001)  # 9001: a range with a partial, a whole and a partial block
STEPS = [(1, 1e-2, 0.0, 1.0), (2, 3e-2, 0.1, 1.0), (3, 1e-3, 0.0, 4.0), (4, 2e-2, 0.01, 0.5)]


INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(params=["interpret", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or INTERPRETING, reason="needs CUDA")])])
def device(request, monkeypatch):
    """The kernels' device: CUDA, or the CPU under Triton's interpreter. The interpreter must be
    on before Triton is first imported (its library's own jit functions are decorated then): the
    "interpret" cases run in a child pytest with TRITON_INTERPRET=1 (test_under_the_interpreter)."""
    if request.param == "interpret" and not INTERPRETING:
        pytest.skip("runs in test_under_the_interpreter's child process")
    monkeypatch.delenv("DOS_NO_TRITON", raising=False)
    return "cpu" if request.param == "interpret" else "cuda"


@pytest.mark.skipif(INTERPRETING, reason="this is the child")
def test_under_the_interpreter():
    """Every "interpret" case below, in a child process with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpret and not test_under_the_interpreter",
                        "-m", "not gpu", __file__], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.splitlines()[-1], r.stdout[-500:]


def new_state(fmt, n, device, seed=0):
    """A state after one reference step on random gradients (computed on the CPU: on CUDA torch
    divides by a scalar as a multiplication by its reciprocal, which is not the documented
    order), then moved to `device`."""
    f = sf.state_format(fmt)
    buf = torch.zeros(f.nbytes(n), dtype=torch.uint8)
    v = f.views(buf, n)
    gen = torch.Generator().manual_seed(seed)
    v.master.copy_(torch.randn(n, generator=gen))
    sf.reference_step_(f, v, torch.randn(n, generator=gen), None, lo=0, hi=n, step=1,
                       lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    buf = buf.to(device)
    return buf, f.views(buf, n)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (the NaN's bits may differ)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def assert_same_state(fmt, k, r):
    for name, a, b in zip(("master", "exp_avg", "exp_avg_sq", "scales"), k, r):
        if a is not None:
            assert same(a, b), (fmt, name, (a.float() - b.float()).abs().max().item())


def fused(fmt, views, g, out, *, lo, hi, step, lr, wd, scale, device):
    from dos import state_kernels
    assert state_kernels.available(views.master)
    state_kernels.fused_step_(fmt, views, g, out, lo=lo, hi=hi, step=step, lr=lr, beta1=0.9,
                              beta2=0.999, eps=1e-8, weight_decay=wd,
                              scale_t=None if scale == 1.0 else torch.tensor(scale, device=device))


def reference(fmt, views, g, out, *, lo, hi, step, lr, wd, scale):
    """The oracle on the CPU (see new_state), written back into `views` / `out` / `g`."""
    cpu = sf.StateViews(*(t.cpu() if t is not None else None for t in views))
    gc = g.cpu()
    oc = None if out is None else gc if out.data_ptr() == g.data_ptr() else (
        cpu.master if out.data_ptr() == views.master.data_ptr() else out.cpu())
    sf.reference_step_(fmt, cpu, gc, oc, lo=lo, hi=hi, step=step, lr=lr, beta1=0.9,
                       beta2=0.999, eps=1e-8, weight_decay=wd, grad_scale=scale)
    for t, c in zip(views, cpu):
        if t is not None:
            t.copy_(c)
    g.copy_(gc)
    if out is not None:
        out.copy_(oc)


@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", FMTS)
def test_fused_step_is_the_reference_bitwise(device, fmt, n, gdt):
    """Several steps from the same start, whole and partial ranges (int8: ranges that cut a block
    re-encode the elements outside them too), weights out in bf16: every byte as the reference's."""
    kb, kv = new_state(fmt, n, device)
    rb, rv = new_state(fmt, n, device)
    gen = torch.Generator().manual_seed(n)
    ranges = [(0, n), (0, n), (n // 3, n - n // 5), (min(2048, n), min(4096, n)), (0, n)]
    for i, (lo, hi) in enumerate(ranges):
        step, lr, wd, scale = STEPS[i % len(STEPS)]
        g = torch.randn(n, generator=gen).to(device, gdt)
        ko = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=device)
        ro = ko.clone()
        fused(fmt, kv, g, ko, lo=lo, hi=hi, step=step, lr=lr, wd=wd, scale=scale, device=device)
        reference(fmt, rv, g.clone(), ro, lo=lo, hi=hi, step=step, lr=lr, wd=wd, scale=scale)
        assert_same_state(fmt, kv, rv)
        assert same(ko, ro)  # weights written in [lo, hi) only (NaN elsewhere in both)
        if fmt == "bf16":
            assert torch.equal(kb.cpu(), rb.cpu())  # the buffers' bytes too


@pytest.mark.parametrize("fmt", FMTS)
def test_out_aliasing_the_gradient_and_fp32_master_out(device, fmt):
    """`out` may be the gradient itself (the weights overwrite it) or the master (skipped)."""
    n = 4099
    kb, kv = new_state(fmt, n, device)
    rb, rv = new_state(fmt, n, device)
    g = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    kg, rg = g.clone(), g.clone()
    fused(fmt, kv, kg, kg, lo=0, hi=n, step=5, lr=1e-2, wd=0.1, scale=1.0, device=device)
    reference(fmt, rv, rg, rg, lo=0, hi=n, step=5, lr=1e-2, wd=0.1, scale=1.0)
    assert_same_state(fmt, kv, rv)
    assert torch.equal(kg.cpu(), rg.cpu())
    fused(fmt, kv, g, kv.master, lo=0, hi=n, step=6, lr=1e-2, wd=0.0, scale=2.0, device=device)
    reference(fmt, rv, g.clone(), rv.master, lo=0, hi=n, step=6, lr=1e-2, wd=0.0, scale=2.0)
    assert_same_state(fmt, kv, rv)


def test_int8_nan_poisons_its_block_only(device):
    n = 3 * 2048 + 5
    kb, kv = new_state("int8", n, device)
    rb, rv = new_state("int8", n, device)
    g = torch.randn(n, generator=torch.Generator().manual_seed(4)).to(device)
    g[2048 + 17] = float("nan")
    g[2 * 2048 + 3] = float("inf")
    fused("int8", kv, g, None, lo=0, hi=n, step=2, lr=1e-2, wd=0.0, scale=1.0, device=device)
    reference("int8", rv, g.clone(), None, lo=0, hi=n, step=2, lr=1e-2, wd=0.0, scale=1.0)
    assert_same_state("int8", kv, rv)
    s = kv.scales.cpu()
    nb = sf.nblocks(n)
    assert s[1].isnan() and s[nb + 1].isnan() and s[2].isnan() and not s[0].isnan() and not s[3].isnan()


def test_refuses_fp32(device):
    from dos import state_kernels
    _, v = new_state("fp32", 8, device)
    with pytest.raises(ValueError, match="fp32"):
        state_kernels.fused_step_("fp32", v, torch.zeros(8, device=device), None, lo=0, hi=8,
                                  step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                                  weight_decay=0.0, scale_t=None)


def test_dos_no_triton_switches_it_off(device, monkeypatch):
    from dos import state_kernels
    t = torch.zeros(1, device=device)
    assert state_kernels.available(t) and state_kernels.impl_name(t) == "triton-fused"
    monkeypatch.setenv("DOS_NO_TRITON", "1")
    assert not state_kernels.available(t) and state_kernels.impl_name(t) == "torch-ops"


@pytest.mark.parametrize("placement", [dict(placement="gpu"), dict(placement="interleaved", stride=1)],
                         ids=["gpu", "interleaved"])
@pytest.mark.parametrize("fmt", FMTS)
def test_engine_gpu_lanes_run_the_fused_kernel(device, fmt, placement, monkeypatch):
    """dos's accelerator lanes (resident and staged subgroups) through the fused kernel: all on
    the device lane, the plain-torch reference's weights to the bit (no FMA anywhere on that
    path); interleaved (the CPU lane's vector kernels have FMAs) within test_state_dtype's bound."""
    import dos
    from dos import state_kernels
    from test_state_dtype import HP, Reference, batches, max_diff, model, train
    calls = []
    real = state_kernels.fused_step_
    monkeypatch.setattr(state_kernels, "fused_step_", lambda *a, **k: (calls.append(1), real(*a, **k)))
    a = model(device=device)
    ref_m = copy.deepcopy(a)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=2500, state_dtype=fmt, **HP, **placement)
    data = batches(device, n=6)
    train(a, opt, data)
    ref = Reference(ref_m.parameters(), opt, fmt)
    train(ref_m, ref, data)
    assert calls, "the fused kernel never ran"
    if placement["placement"] == "gpu":
        assert max_diff(a, ref_m) == 0.0
    else:
        assert max_diff(a, ref_m) <= 2e-4


@pytest.mark.parametrize("fmt", FMTS)
def test_no_scratch_with_the_fused_kernels_and_the_fallback_brings_its_own(device, fmt, monkeypatch):
    """With the fused kernels the GPU side holds no fp32 scratch for bf16/int8 state (GPU memory
    for resident subgroups instead); switching them off mid-run (DOS_NO_TRITON=1) falls back to the
    torch-op path, which allocates its own, and the run stays on the reference."""
    import dos
    from test_state_dtype import HP, Reference, batches, max_diff, model, train
    a = model(device=device)
    ref_m = copy.deepcopy(a)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=2500, state_dtype=fmt,
                                  placement="gpu", **HP)
    assert opt._dev.scratch.numel() == 0
    assert opt.describe()["device_state_impl"] == "triton-fused"
    data = batches(device, n=6)
    train(a, opt, data[:3])
    monkeypatch.setenv("DOS_NO_TRITON", "1")
    assert opt.describe()["device_state_impl"] == "torch-ops"
    train(a, opt, data[3:])
    ref = Reference(ref_m.parameters(), opt, fmt)
    train(ref_m, ref, data)
    assert max_diff(a, ref_m) <= 2e-4


@pytest.mark.parametrize("block", [4, 2048])
def test_launches_cover_the_range_once_and_mask_only_partial_blocks(block):
    """The launch plans of fused_step_: every element of [lo, hi) (bf16) / every scale block [lo,
    hi) touches (int8) in exactly one launch; the unmasked (even / full) launches hold whole blocks
    only, inside [lo, hi); at most one masked bf16 launch and two masked int8 blocks. (Session 18:
    a mask over the unspecialized size made Triton issue scalar accesses: the bulk must be
    unmasked.)"""
    from dos.state_kernels import launches_bf16, launches_int8

    n = 7 * block + 3
    cuts = sorted({0, 1, block - 1, block, block + 1, 3 * block, 5 * block - 2, n - 1, n})
    for lo in cuts:
        for hi in cuts:
            if hi <= lo:
                continue
            seen = []
            plan = launches_bf16(lo, hi, block)
            for a, b, even in plan:
                seen += range(a, b)
                assert not even or (b - a) % block == 0
            assert seen == list(range(lo, hi))
            assert sum(not e for *_, e in plan) <= 1
            assert any(e for *_, e in plan) == (hi - lo >= block)

            blocks = []
            plan = launches_int8(lo, hi, block)
            for b, count, full in plan:
                blocks += range(b, b + count)
                if full:
                    assert b * block >= lo and (b + count) * block <= hi
                else:
                    assert count == 1
            assert blocks == list(range(lo // block, -(-hi // block)))
            assert sum(not f for *_, f in plan) <= 2


# ---- the split master (dos/split_master.py) ----------------------------------------------------

@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", (1, 2049, 5003))
def test_fused_split_step_is_the_reference_bitwise(device, n, gdt):
    """The split-master kernel against `split_master.reference_step_` (on the CPU): hi, lo, the
    moments and the weights out, every bit (a NaN as a NaN), over whole and partial ranges."""
    from dos import split_master as sm
    from dos import state_kernels
    gen = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=gen)
    if n > 4:
        master[:3] = torch.tensor([1.0 + 2.0 ** -8, -(1.0 + 3 * 2.0 ** -8), -0.0])  # ties, -0
    ref = [*sm.split(master), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    ker = [t.clone().to(device) for t in ref]
    for i, (lo, hi) in enumerate([(0, n), (n // 3, n - n // 5), (0, n)]):
        step, lr, wd, scale = STEPS[i]
        g = torch.randn(n, generator=gen)
        if n > 8:
            g[7] = float("inf")
        g = g.to(gdt)
        ko = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=device)
        ro = ko.cpu().clone()
        state_kernels.fused_split_step_(*ker, g.to(device), ko, lo_i=lo, hi_i=hi, step=step, lr=lr,
                                        beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd,
                                        scale_t=None if scale == 1.0 else torch.tensor(scale, device=device))
        sm.reference_step_(*ref, g.clone(), lo_i=lo, hi_i=hi, step=step, lr=lr, beta1=0.9, beta2=0.999,
                           eps=1e-8, weight_decay=wd, grad_scale=scale, out=ro)
        assert same(sm.join(ker[0].cpu(), ker[1].cpu()), sm.join(ref[0], ref[1]))
        for a, b in zip(ker[2:] + [ko], ref[2:] + [ro]):
            assert same(a, b)
        ok = ~sm.join(ref[0], ref[1]).isnan()
        assert torch.equal(ker[0].cpu().view(torch.int16)[ok], ref[0].view(torch.int16)[ok])
