"""Resident-first memory (issue 17; DESIGN.md §3.7): with gpu_fraction="auto" the host arena is
reserved but neither written nor pinned until the first step has sized the resident share; the
resident subgroups then get a fresh state on the GPU and their host blocks are never touched; the
host-memory preflight checks what is left, with the numbers of both memories. On the CPU the
sizing runs with a stand-in calibration and a stand-in free-memory figure, as in test_engine.py."""
import pytest
import torch

import dos
import dos.planner
from dos.perfmodel import DESIGN_H200
from helpers import max_diff, pair, train

SG = 500
KW = dict(subgroup_numel=SG, placement="interleaved", gpu_fraction="auto", cpu_threads=16, replan=False)


@pytest.fixture
def sizing(monkeypatch):
    """A calibrated machine whose first iteration leaves `free[0]` subgroups' state free."""
    free = [4]
    monkeypatch.setattr(dos.planner, "_calibration", lambda device, *a: DESIGN_H200)
    monkeypatch.setattr(dos.planner, "free_device_bytes",
                        lambda dev: 0 if free[0] is None else free[0] * 12 * SG + dev.transient_bytes)
    return free


def host_masters_written(opt) -> list:
    return [s for s, t in opt._host.state.items()
            if opt.state_format.views(t, opt.layout.subgroups[s].numel).master.abs().sum() > 0]


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_resident_share_never_touches_the_host(sizing, fmt):
    a, opt, b, ref = pair("transformer", state_dtype=fmt, **KW)
    n = len(opt.layout.subgroups)
    assert opt.planner.deferred_host and host_masters_written(opt) == []  # nothing written yet
    assert not opt._grads.send_early  # the first backward sends nothing to unwritten blocks
    reserved = opt.host_bytes
    train("transformer", a, opt, 1)
    train("transformer", b, ref, 1)
    r = len(opt.plan.resident)
    assert 0 < r < n and not opt.planner.deferred_host and opt._grads.send_early
    assert sorted(opt._host.blocks) == list(range(r, n))  # only the non-resident blocks remain
    assert opt.host_bytes < reserved
    assert sorted(host_masters_written(opt)) == list(range(r, n))  # seeded at the first step
    train("transformer", a, opt, 5, start=1)
    train("transformer", b, ref, 5, start=1)
    tol = 1e-5 if fmt == "fp32" else 5e-3  # bf16 moments: not AdamW's exact result
    assert max_diff(a, b) <= tol


def test_nothing_fits_leaves_all_of_it_on_the_host(sizing):
    sizing[0] = None  # not even the staging slots
    a, opt, b, ref = pair("transformer", **KW)
    train("transformer", a, opt, 3)
    train("transformer", b, ref, 3)
    assert not opt.plan.resident and not opt.planner.deferred_host
    assert len(opt._host.blocks) == len(opt.layout.subgroups)
    assert max_diff(a, b) <= 1e-5


def test_the_host_preflight_after_sizing_names_both_memories(sizing, monkeypatch):
    """The construction-time check is a lower bound (on a GPU: as if the memory free then held
    the first subgroups); the exact one, after sizing, raises with both memories' numbers."""
    monkeypatch.setattr(dos.planner.Planner, "host_need_bound", lambda self, blocks: 0)
    a, opt, _, _ = pair("transformer", host_memory_limit_gib=1e-6, **KW)
    with pytest.raises(dos.HostMemoryError, match="resident-first sizing.*subgroups.*GiB of state"):
        train("transformer", a, opt, 1)


def test_load_state_dict_before_the_first_step_materializes_the_host(sizing):
    a, opt, b, ref = pair("transformer", **KW)
    train("transformer", a, opt, 2)
    sd = opt.state_dict()
    c, opt2, _, _ = pair("transformer", **KW)
    c.load_state_dict(a.state_dict())
    opt2.load_state_dict(sd)
    assert not opt2.planner.deferred_host
    train("transformer", a, opt, 3, start=2)
    train("transformer", c, opt2, 3, start=2)
    assert max_diff(a, c) == 0.0


def test_close_gives_the_host_memory_back_at_once():
    """close() returns the arena's pages to the OS there and then (madvise), not at a later garbage
    collection: a probe that built one optimizer after another on the H200 found the earlier
    arenas still resident and the next preflight refused (experiments/results/gpu-tests/
    20261201-s7-call3-probe.log)."""
    import psutil

    p = torch.nn.Parameter(torch.zeros(8_000_000, dtype=torch.bfloat16))
    opt = dos.DeepOptimizerStates([p], placement="cpu", subgroup_numel=2_000_000)
    p.grad = torch.full_like(p, 1e-3)
    opt.step()  # every page of the arena written
    rss = psutil.Process().memory_info().rss
    opt.close()
    freed = rss - psutil.Process().memory_info().rss
    assert freed >= 0.8 * 14 * p.numel(), freed  # 14 B/param: the whole arena
    assert opt.host_bytes == 0


def test_gradient_buffers_come_after_the_parameters_moved(monkeypatch):
    """The flat gradient buffers are allocated only once every parameter lives in the flat
    parameter buffers (the originals freed): the constructor's peak is 2x the weights, not 3x. At
    20B the 3x transient was the CUDA allocator's peak and the first step's resident sizing took
    it for the iteration's (experiments/results/capacity, session 8)."""
    import dos.buffers

    seen = []
    real = dos.buffers.DeviceBuffers.alloc_grads

    def alloc_grads(dev):
        def inside(p, f):
            return f.data_ptr() <= p.data_ptr() < f.data_ptr() + f.numel() * f.element_size()
        seen.append(all(any(inside(p, f) for f in dev.params) for p in params))
        real(dev)

    monkeypatch.setattr(dos.buffers.DeviceBuffers, "alloc_grads", alloc_grads)
    params = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(7, 11))]
    opt = dos.DeepOptimizerStates(params, subgroup_numel=128, placement="cpu")
    assert seen == [True]
    assert all(g.numel() for g in opt._dev.grads)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_constructor_peak_is_twice_the_weights_on_cuda():
    """Measured: constructing the optimizer over bf16 weights W peaks at <= 2 W + slack of CUDA
    memory (originals + flat weights; the flat gradients come after the originals are freed)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    params = [torch.nn.Parameter(torch.randn(64 << 20, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
    w = sum(p.numel() * p.element_size() for p in params)
    opt = dos.DeepOptimizerStates(params, placement="cpu", subgroup_numel=32 << 20)
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= 2 * w + (64 << 20), (peak / w)
    assert torch.cuda.memory_allocated() - base <= 2 * w + (64 << 20)  # weights + gradients
    opt.close()


@pytest.mark.parametrize("stride", ["auto", 3])
def test_without_a_calibration_the_resident_share_is_what_fits(monkeypatch, stride):
    """gpu_fraction="auto" on a machine never calibrated: the first step still sizes the resident
    share (as many subgroups as fit beside the staging slots; source "memory"), the rest keeps the
    stride rule, the host holds only the rest, and the result is still AdamW's."""
    free = 5
    monkeypatch.setattr(dos.planner, "_calibration", lambda device, *a: None)
    monkeypatch.setattr(dos.planner, "_sizes_by_memory", lambda device: True)
    monkeypatch.setattr(dos.planner, "free_device_bytes", lambda dev: free * 12 * SG + dev.transient_bytes)
    kw = dict(KW, stride=stride)
    with pytest.warns(UserWarning, match="without a calibration"):
        a, opt, b, ref = pair("transformer", **kw)
    assert opt.planner.deferred_host and opt.plan.resident == ()
    train("transformer", a, opt, 1)
    train("transformer", b, ref, 1)
    n, r = len(opt.layout.subgroups), len(opt.plan.resident)
    slots = len(opt._dev.slots)
    assert opt.plan.source == "memory" and slots >= 1
    # the most that fit: `free` subgroups' worth of state beside the slots the staged lane keeps
    # (free_device_bytes counts the allocated slots as free: a plan may spend them otherwise)
    sizes = [s.numel for s in opt.layout.subgroups]
    assert sum(sizes[:r]) <= free * SG < sum(sizes[:r + 1])
    assert 0 < r < n and sorted(opt._host.blocks) == list(range(r, n))
    k = 2 if stride == "auto" else stride
    rest = [i for i in reversed(range(r, n))]
    assert list(opt.plan.staged_order) == [i for pos, i in enumerate(rest) if (pos + 1) % k == 0]
    train("transformer", a, opt, 5, start=1)
    train("transformer", b, ref, 5, start=1)
    assert max_diff(a, b) <= 1e-5
