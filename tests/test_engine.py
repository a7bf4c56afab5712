"""The engine equals torch.optim.AdamW on fp32 master weights, on every path.

Runs on the CPU (the CPU stands in for the accelerator: same partition, plan, state movement and
update code) and, with the `gpu` marker, on CUDA with real streams and pinned memory.
"""
import copy
import io
import itertools
import time
from typing import Optional

import pytest
import torch

import dos
from helpers import DEVICES, batch, loss_fn, make_model, max_diff, n_params, pair, train

STEPS = 50
PLACEMENTS = [
    dict(placement="cpu"),
    dict(placement="gpu"),
    dict(placement="static", gpu_fraction=0.5),
    dict(placement="interleaved", stride=1),
    dict(placement="interleaved", stride=2),
    dict(placement="interleaved", stride=3),
    dict(placement="interleaved", stride=5),
    dict(placement="interleaved", stride="auto"),
    dict(placement="interleaved", stride=2, gpu_fraction=0.3),
]
IDS = [",".join(f"{k}={v}" for k, v in p.items()) for p in PLACEMENTS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,subgroup", [("transformer", 1000), ("odd", 97)])
@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_matches_adamw_fp32(device, kind, subgroup, placement):
    a, opt, b, ref = pair(kind, device, subgroup_numel=subgroup, **placement)
    assert n_params(a) % subgroup != 0
    assert len(opt.layout.subgroups) >= 3
    la = train(kind, a, opt, STEPS, device)
    lb = train(kind, b, ref, STEPS, device)
    assert max_diff(a, b) <= 1e-5
    assert abs(la[-1] - lb[-1]) <= 1e-4
    assert la[-1] < la[0]  # it trains


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", PLACEMENTS[:5], ids=IDS[:5])
def test_bf16_params_follow_fp32_master(device, placement):
    """bf16 weights are the rounded fp32 master (the prototype cast to fp16 into bf16 storage and
    the loss stuck at ln(vocab)); the master follows the oracle fed with the same gradients."""
    a = make_model("transformer", device, torch.bfloat16)
    opt = dos.DeepOptimizerStates(a.parameters(), lr=3e-3, weight_decay=0.05, subgroup_numel=1000,
                                  **placement)
    masters = [p.detach().float().clone() for p in a.parameters()]
    oracle = torch.optim.AdamW([torch.nn.Parameter(m) for m in masters], lr=3e-3, weight_decay=0.05)
    losses = []
    for step in range(30):
        opt.zero_grad()
        x, y = batch("transformer", step, device)
        loss = loss_fn("transformer", a, x, y)
        loss.backward()
        for m, p in zip(oracle.param_groups[0]["params"], a.parameters()):
            m.grad = p.grad.float()  # the same bf16 gradients dos sees
        opt.step()
        oracle.step()
        losses.append(loss.item())
    state = opt.state_dict()["state"]
    for i, (p, m) in enumerate(zip(a.parameters(), oracle.param_groups[0]["params"])):
        master = state[i]["master"]
        assert master.dtype == torch.float32
        torch.testing.assert_close(master.to(m.device), m.detach(), atol=1e-5, rtol=0)
        assert torch.equal(p.detach(), master.to(p.device).to(torch.bfloat16))
    assert losses[-1] < losses[0] - 0.3  # not stuck at ln(vocab)


def three_groups_one_frozen(m):
    """Per-group lr and weight decay, and one frozen parameter."""
    m.blocks[0].linear1.weight.requires_grad_(False)
    return [{"params": list(m.blocks.parameters()), "lr": 2e-3, "weight_decay": 0.1},
            {"params": list(m.tok.parameters()) + [m.pos], "weight_decay": 0.0},
            {"params": list(m.norm.parameters()) + list(m.head.parameters()), "lr": 5e-3}]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", [PLACEMENTS[0], PLACEMENTS[4], PLACEMENTS[8]], ids=["cpu", "k2", "k2res"])
def test_param_groups_frozen_scheduler_clipping_accumulation(device, placement):
    """Per-group lr and weight decay, a frozen parameter, a scheduler, clipping, 3 micro-batches."""
    a, opt, b, ref = pair("transformer", device, groups=three_groups_one_frozen, max_grad_norm=0.5,
                          subgroup_numel=700, **placement)
    frozen = a.blocks[0].linear1.weight.detach().clone()
    lam = lambda s: 1.0 / (1 + 0.1 * s)  # noqa: E731
    sa = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    sb = torch.optim.lr_scheduler.LambdaLR(ref.opt, lam)
    train("transformer", a, opt, 30, device, accum=3, sched=sa)
    train("transformer", b, ref, 30, device, accum=3, sched=sb)
    assert max_diff(a, b) <= 1e-5
    assert torch.equal(a.blocks[0].linear1.weight.detach(), frozen)
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.5  # clipping was active
    st = opt.state_dict()
    frozen_index = [i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
                    if not p.requires_grad]
    assert frozen_index and all(i not in st["state"] for i in frozen_index)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", [PLACEMENTS[0], PLACEMENTS[2], PLACEMENTS[5], PLACEMENTS[8],
                                       dict(PLACEMENTS[4], overlap_backward=True)],
                         ids=["cpu", "static", "k2", "k2res", "k2-overlap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resume_is_bitwise(device, placement, dtype):
    clip = None if placement.get("overlap_backward") else 1.0  # overlap_backward refuses clipping
    kw = dict(lr=3e-3, weight_decay=0.05, subgroup_numel=900, max_grad_norm=clip, **placement)
    a = make_model("transformer", device, dtype)
    b = copy.deepcopy(a)
    opt = dos.DeepOptimizerStates(a.parameters(), **kw)
    train("transformer", a, opt, 20, device)

    opt_b = dos.DeepOptimizerStates(b.parameters(), **kw)
    train("transformer", b, opt_b, 10, device)
    buf = io.BytesIO()
    torch.save({"model": b.state_dict(), "opt": opt_b.state_dict()}, buf)
    opt_b.close()
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    c = make_model("transformer", device, dtype, seed=123)  # different init, overwritten
    c.load_state_dict(ck["model"])
    opt_c = dos.DeepOptimizerStates(c.parameters(), **kw)
    opt_c.load_state_dict(ck["opt"])
    train("transformer", c, opt_c, 10, device, start=10)
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)
    for (i, x), (j, y) in zip(opt.state_dict()["state"].items(), opt_c.state_dict()["state"].items()):
        assert i == j and set(x) == set(y)
        for k in x:
            assert torch.equal(x[k].cpu(), y[k].cpu()), k


def test_state_dict_loads_across_placements_and_subgroup_sizes():
    a = make_model("odd")
    b = copy.deepcopy(a)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=50, placement="interleaved", stride=3)
    train("odd", a, opt, 5)
    b.load_state_dict(a.state_dict())
    opt2 = dos.DeepOptimizerStates(b.parameters(), subgroup_numel=333, placement="static", gpu_fraction=0.4)
    opt2.load_state_dict(opt.state_dict())
    train("odd", a, opt, 5, start=5)
    train("odd", b, opt2, 5, start=5)
    assert max_diff(a, b) <= 1e-6


def test_state_dict_format_is_torch_adamw():
    """Same keys and shapes as torch.optim.AdamW, so the state loads into it too."""
    a, opt, b, ref = pair("odd", subgroup_numel=50, placement="cpu")
    train("odd", a, opt, 3)
    sd = opt.state_dict()
    torch_opt = torch.optim.AdamW(b.parameters(), lr=3e-3, weight_decay=0.05)
    torch_opt.load_state_dict(sd)
    for i, p in enumerate(b.parameters()):
        st = torch_opt.state[p]
        assert st["exp_avg"].shape == p.shape and float(st["step"]) == 3.0
    assert opt.state_dict()["state"] and not dos.DeepOptimizerStates(
        make_model("odd").parameters()).state_dict()["state"]  # no state before the first step


def test_first_step_moments_start_at_zero():
    """The prototype's GPU optimizer started from uninitialized moments."""
    for placement in PLACEMENTS:
        m = make_model("odd")
        opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=97, betas=(0.8, 0.9), **placement)
        x, y = batch("odd", 0)
        loss_fn("odd", m, x, y).backward()
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        for i, g in enumerate(grads):
            st = opt.state_dict()["state"][i]
            torch.testing.assert_close(st["exp_avg"], 0.2 * g, atol=1e-7, rtol=1e-6)
            torch.testing.assert_close(st["exp_avg_sq"], 0.1 * g * g, atol=1e-9, rtol=1e-5)


@pytest.mark.parametrize("stride", [1, 2, 3, 4, 5, 7])
def test_every_subgroup_is_updated_and_written_back(stride):
    """The prototype never wrote back its last GPU subgroup and skipped trailing CPU subgroups
    when the count was no multiple of k: after one step every element moved, and the host copy of
    every staged subgroup's state equals what the GPU computed."""
    m = make_model("odd")
    before = [p.detach().clone() for p in m.parameters()]
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=105, placement="interleaved",
                                  stride=stride, weight_decay=0.0)
    assert len(opt.layout.subgroups) % stride != 0 or stride == 1
    x, y = batch("odd", 0)
    loss_fn("odd", m, x, y).backward()
    opt.step()
    for p, q in zip(m.parameters(), before):
        nz = p.grad != 0
        assert (p[nz] != q[nz]).all()
    st = opt.state_dict()["state"]
    for i, p in enumerate(m.parameters()):
        assert (st[i]["exp_avg"][p.grad != 0] != 0).all()


def test_partition_equal_subgroups_and_any_gpu_share():
    """Subgroups are equal (the prototype's followed tensors and differed by 12x) and the GPU
    share is not capped at 1/2."""
    m = make_model("transformer")
    for stride, share in [(1, 1.0), (2, 0.5), (4, 0.25)]:
        opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=512, placement="interleaved",
                                      stride=stride)
        sizes = [s.numel for s in opt.layout.subgroups]
        assert len(set(sizes[:-1])) == 1
        assert abs(opt.plan.share("staged") - share) < 1.5 / len(sizes)
        opt.close()


def test_host_bytes_per_param_bf16():
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(torch.bfloat16)
    opt = dos.DeepOptimizerStates(model.parameters(), placement="cpu")
    assert 14.0 <= opt.host_bytes_per_param <= 14.5
    assert opt.describe()["host_bytes_per_param"] <= 14.5


def test_timeline_records_every_lane():
    m = make_model("odd")
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=97, placement="interleaved",
                                  stride=2, gpu_fraction=0.2, trace=True)
    train("odd", m, opt, 2)
    lanes = {e["lane"] for e in opt.timeline()}
    assert "cpu" in lanes  # GPU-side spans only exist with CUDA events
    assert {e["subgroup"] for e in opt.timeline()} == set(opt.plan.cpu_order)


def test_model_zero_grad_set_to_none_still_works():
    a, opt, b, ref = pair("odd", subgroup_numel=97, placement="interleaved", stride=2)
    for step in range(5):
        for model, o in ((a, opt), (b, ref)):
            model.zero_grad(set_to_none=True)
            x, y = batch("odd", step)
            loss_fn("odd", model, x, y).backward()
            o.step()
    assert max_diff(a, b) <= 1e-6


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(lr=-1.0), "Invalid learning rate"),
    (dict(eps=-1.0), "Invalid epsilon"),
    (dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0"),
    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
    (dict(weight_decay=-0.1), "Invalid weight_decay"),
    (dict(placement="disk"), "placement must be one of"),
    (dict(stride=0), "stride must be"),
    (dict(gpu_fraction=1.5), "gpu_fraction"),
    (dict(placement="cpu", gpu_fraction=0.5), "gpu_fraction must be 0"),
    (dict(subgroup_numel=0), "subgroup_numel"),
    (dict(max_grad_norm=0.0), "max_grad_norm"),
    (dict(amsgrad=True), "amsgrad"),
])
def test_invalid_hyperparameters_raise_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        dos.DeepOptimizerStates(make_model("odd").parameters(), **kw)


def test_invalid_lr_set_later_raises_at_step():
    m = make_model("odd")
    opt = dos.DeepOptimizerStates(m.parameters())
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()


def test_bad_parameters_raise_clearly():
    with pytest.raises(ValueError, match="complex"):
        dos.DeepOptimizerStates([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(ValueError, match="sparse"):
        dos.DeepOptimizerStates([torch.nn.Parameter(torch.zeros(3, 3).to_sparse())])
    with pytest.raises(ValueError, match="no trainable"):
        dos.DeepOptimizerStates([torch.nn.Parameter(torch.zeros(3), requires_grad=False)])
    with pytest.raises(ValueError, match="dtype"):
        dos.DeepOptimizerStates([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    meta = torch.nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        dos.DeepOptimizerStates([torch.nn.Parameter(torch.zeros(3)), meta])
    opt = dos.DeepOptimizerStates([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(NotImplementedError, match="add parameter groups"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_host_memory_preflight_fails_before_allocating(monkeypatch):
    import dos.buffers as buffers

    allocated = []
    monkeypatch.setattr(buffers.HostArena, "__init__", lambda *a, **k: allocated.append(1))
    monkeypatch.setenv("DOS_HOST_MEMORY_GIB", "0.000001")
    with pytest.raises(dos.HostMemoryError, match=r"GiB of host memory .* B/param.* available"):
        dos.DeepOptimizerStates(make_model("transformer").parameters(), placement="cpu")
    assert not allocated
    monkeypatch.undo()
    monkeypatch.setenv("DOS_HOST_MEMORY_GIB", "0.000001")
    # Resident state needs no host memory: the same limit passes with placement="gpu".
    dos.DeepOptimizerStates(make_model("transformer").parameters(), placement="gpu")


def test_auto_plan_from_a_calibration_is_predicted_and_exact(monkeypatch):
    """With a calibration, stride='auto' is the performance model's plan and every plan records
    its predicted update time; the result still equals the oracle."""
    import dos.planner
    from dos.perfmodel import DESIGN_H200

    monkeypatch.setattr(dos.planner, "_calibration", lambda device, *a: DESIGN_H200)
    a, opt, b, ref = pair("transformer", subgroup_numel=500, placement="interleaved", stride="auto",
                          cpu_threads=16)
    assert opt.plan.predicted_step_s is not None and 0 < opt.plan.share("staged") < 1
    train("transformer", a, opt, 10)
    train("transformer", b, ref, 10)
    assert max_diff(a, b) <= 1e-5
    fixed = dos.DeepOptimizerStates(make_model("odd").parameters(), placement="cpu")
    assert fixed.plan.predicted_step_s is not None


@pytest.mark.parametrize("device", DEVICES)
def test_changing_the_plan_between_steps_stays_exact(device):
    """Re-planning moves subgroups between the CPU and staged lanes; state written back by one lane
    is read by the other, gradients routed by the old plan are re-sent: still the oracle."""
    from dos.perfmodel import build_plan
    from fractions import Fraction

    a, opt, b, ref = pair("transformer", device, subgroup_numel=500, placement="interleaved",
                          stride=2, max_grad_norm=0.5)
    shares = [Fraction(1, 2), Fraction(1, 3), Fraction(0), Fraction(1), Fraction(2, 3), Fraction(1, 2)]
    for step, share in enumerate(shares):
        new = build_plan(opt.plan.numels, resident=0, staged_share=share, cpu_threads=2,
                         staging_slots=len(opt._dev.slots))
        opt.planner.set_plan(new, max(opt.group_steps))
        train("transformer", a, opt, 3, device, accum=2, start=3 * step)
        train("transformer", b, ref, 3, device, accum=2, start=3 * step)
    assert max_diff(a, b) <= 1e-5
    assert len(opt.replans) == len(shares)


def test_online_refinement_replans_from_measured_lane_times(monkeypatch):
    """A calibration that is wrong about the CPU (20x too fast) is corrected from the measured CPU
    lane within a few steps and the plan moves work off the CPU; the result stays exact."""
    import dataclasses

    import dos.planner
    from dos.perfmodel import DESIGN_H200

    fast = dataclasses.replace(DESIGN_H200, cpu_rate=tuple(r * 20 for r in DESIGN_H200.cpu_rate),
                               cpu_rate_dma=tuple(r * 20 for r in DESIGN_H200.cpu_rate_dma))
    monkeypatch.setattr(dos.planner, "_calibration", lambda device, *a: fast)
    a, opt, b, ref = pair("transformer", subgroup_numel=500, placement="interleaved", stride="auto",
                          cpu_threads=2)
    first = opt.plan
    assert first.share("staged") < 1
    train("transformer", a, opt, 10)
    train("transformer", b, ref, 10)
    assert opt.replans and opt.plan.share("staged") > first.share("staged")
    assert max_diff(a, b) <= 1e-5
    no = dos.DeepOptimizerStates(make_model("odd").parameters(), stride="auto", replan=False)
    assert not no.planner.refining


@pytest.mark.parametrize("placement,stride", [("interleaved", "auto"), ("interleaved", 2), ("static", None)])
@pytest.mark.parametrize("free_subgroups", [None, 0, 3.5, 1000])
def test_auto_gpu_fraction_sizes_resident_state_from_free_memory(monkeypatch, placement, stride,
                                                                 free_subgroups):
    """gpu_fraction='auto': at the first step the model fills the GPU memory left free at the
    peak with resident state (slots and scratch count against it), the stride setting is kept,
    the resident subgroups' host blocks are released, and the result stays the oracle's,
    through a checkpoint round trip."""
    import dos.planner
    from dos.perfmodel import DESIGN_H200

    sg_numel = 500
    sg_bytes = 12 * sg_numel
    monkeypatch.setattr(dos.planner, "_calibration", lambda device, *a: DESIGN_H200)
    budget = []  # the free bytes the engine was told

    def free(dev):
        # None: nothing free at all (not even what the slots hold now); else that many subgroups'
        # state beside the slots and scratch
        budget.append(0 if free_subgroups is None else free_subgroups * sg_bytes + dev.transient_bytes)
        return budget[-1]

    monkeypatch.setattr(dos.planner, "free_device_bytes", free)
    kw = dict(subgroup_numel=sg_numel, placement=placement, gpu_fraction="auto", cpu_threads=16,
              replan=False)  # one plan choice, at the first step: resume is bitwise
    if stride is not None:
        kw["stride"] = stride
    a, opt, b, ref = pair("transformer", **kw)
    n = len(opt.layout.subgroups)
    host_before = opt.host_bytes
    assert not opt.plan.resident
    train("transformer", a, opt, 1)
    train("transformer", b, ref, 1)
    plan = opt.plan
    r = len(plan.resident)
    assert plan.resident == tuple(range(r)) and sorted(opt._dev.resident) == list(plan.resident)
    gpu_bytes = 12 * sum(plan.numels[s] for s in plan.resident) + opt._dev.transient_bytes
    chosen = bool(opt.replans)  # else nothing of the asked shape fit: the plan was kept
    assert len(budget) == 1 and (gpu_bytes <= budget[0] or not chosen)  # it fits what was free
    if free_subgroups == 1000:
        assert r == n and opt.host_bytes == 0  # everything fits: all resident
    elif free_subgroups is None:  # no room even for the slots: the CPU does it all, or a fixed
        assert r == 0 and (not opt._dev.slots) == chosen  # stride keeps its plan
    else:
        assert 0 <= r <= free_subgroups + 3 and (opt.host_bytes < host_before) == (r > 0)
    if placement == "static":
        assert not plan.staged_order
    elif stride == 2 and r < n:
        assert plan.stride == 2 and plan.staged_order
    if chosen:
        assert opt.replans[0]["free_gpu_gib"] is not None and plan.source == "perfmodel"
    train("transformer", a, opt, 5, start=1)
    train("transformer", b, ref, 5, start=1)
    assert max_diff(a, b) <= 1e-5
    # The state dict (resident and host state alike) resumes bitwise in a fresh optimizer.
    c = copy.deepcopy(a)
    opt2 = dos.DeepOptimizerStates(c.parameters(), **kw)
    opt2.load_state_dict(opt.state_dict())
    train("transformer", a, opt, 3, start=6)
    train("transformer", c, opt2, 3, start=6)
    assert max_diff(a, c) == 0


def test_auto_gpu_fraction_rejects_placements_without_resident_state():
    with pytest.raises(ValueError, match="gpu_fraction='auto'"):
        dos.DeepOptimizerStates(make_model("odd").parameters(), placement="cpu", gpu_fraction="auto")
    with pytest.raises(ValueError, match="gpu_fraction"):
        dos.DeepOptimizerStates(make_model("odd").parameters(), gpu_fraction="half")
    # Without a calibration (a CPU machine) nothing becomes resident, and it still trains exactly.
    a, opt, b, ref = pair("odd", subgroup_numel=97, gpu_fraction="auto")
    train("odd", a, opt, 3)
    train("odd", b, ref, 3)
    assert not opt.plan.resident and max_diff(a, b) <= 1e-5


def test_refinement_searches_only_after_the_rates_moved(monkeypatch):
    """The plan search runs on the host in the CPU lane's path (50-100 ms at 3B-7B): once the
    refined rates stop moving, no step pays for it."""
    import dataclasses

    import dos.planner
    from dos import refine
    from dos.perfmodel import DESIGN_H200

    monkeypatch.setattr(dos.planner, "_calibration", lambda device, *a: DESIGN_H200)
    searches, drift = [], [0.0]
    monkeypatch.setattr(refine, "update", lambda calib, *a, **k: dataclasses.replace(
        calib, gpu_rate=calib.gpu_rate * (1 + drift[0])))
    real = refine.replan
    monkeypatch.setattr(refine, "replan", lambda *a, **k: searches.append(1) or real(*a, **k))
    a, opt, b, ref = pair("transformer", subgroup_numel=500, placement="interleaved", stride="auto",
                          cpu_threads=2)
    train("transformer", a, opt, 4)
    assert not searches  # the rates did not move: the first plan stands
    drift[0] = 0.05
    train("transformer", a, opt, 2, start=4)
    assert len(searches) == 2  # moved by 5% at each step: searched each time
    drift[0] = 0.001
    train("transformer", a, opt, 3, start=6)
    assert len(searches) == 2  # 0.1% a step stays under the 2% drift until it adds up
    train("transformer", b, ref, 9)
    assert max_diff(a, b) <= 1e-5


# ---------------------------------------------------------------- updates overlapped with backward

OVERLAP = [PLACEMENTS[0], PLACEMENTS[2], PLACEMENTS[4], PLACEMENTS[5], PLACEMENTS[8]]
OVERLAP_IDS = ["cpu", "static", "k2", "k3", "k2res"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", OVERLAP, ids=OVERLAP_IDS)
def test_overlap_backward_matches_adamw_with_groups_frozen_scheduler_accumulation(device, placement):
    """overlap_backward=True: CPU subgroups update during backward (on a worker thread) and the
    result is the oracle's, with param groups, a frozen parameter, a scheduler and 3 micro-batches
    (the first two inside opt.accumulate()); and bitwise what the engine gives without overlap."""
    a, opt, b, ref = pair("transformer", device, groups=three_groups_one_frozen, subgroup_numel=700,
                          overlap_backward=True, **placement)
    c = copy.deepcopy(a)
    plain = dos.DeepOptimizerStates(three_groups_one_frozen(c), lr=3e-3, weight_decay=0.05, subgroup_numel=700, **placement)
    lam = lambda s: 1.0 / (1 + 0.1 * s)  # noqa: E731
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lam) for o in (opt, ref.opt, plain)]
    for step in range(12):
        for model, o, sched in ((a, opt, scheds[0]), (b, ref, scheds[1]), (c, plain, scheds[2])):
            train("transformer", model, o, 1, device, accum=3, start=step)
            sched.step()
        if step == 0:  # CPU subgroups holding parameters (not only a bucket's tail padding)
            cpu_lane = sum(1 for s, x in enumerate(opt.plan.lanes) if x == "cpu" and opt._grads.need[s])
        assert opt.last_overlapped == cpu_lane > 0  # each one started during backward
    assert max_diff(a, b) <= 1e-5
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)
    for (i, x), (j, y) in zip(opt.state_dict()["state"].items(), plain.state_dict()["state"].items()):
        assert i == j and all(torch.equal(x[k], y[k]) for k in x)


def _backward(model, step=0, micro=0):
    x, y = batch("transformer", step, "cpu", micro)
    loss_fn("transformer", model, x, y).backward()


def test_overlap_backward_refuses_what_it_cannot_do_exactly():
    m = make_model("transformer")
    with pytest.raises(ValueError, match="max_grad_norm"):
        dos.DeepOptimizerStates(m.parameters(), overlap_backward=True, max_grad_norm=1.0)
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=700, placement="cpu", overlap_backward=True)
    # Accumulation outside opt.accumulate(): the second backward raises before it can change a
    # gradient that an update has consumed.
    _backward(m)
    with pytest.raises(RuntimeError, match="accumulate"):
        _backward(m, micro=1)
    opt.close()

    # An lr set between backward and step() is not silently ignored.
    m = make_model("transformer")
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=700, placement="cpu", overlap_backward=True)
    _backward(m)
    opt.param_groups[0]["lr"] *= 0.5
    with pytest.raises(RuntimeError, match="hyperparameters"):
        opt.step()
    # zero_grad / state_dict between an overlapped backward and its step would lose the update.
    m = make_model("transformer")
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=700, placement="cpu", overlap_backward=True)
    _backward(m)
    for call in (opt.zero_grad, opt.state_dict):
        with pytest.raises(RuntimeError, match="call step"):
            call()
    opt.step()
    opt.zero_grad()  # fine after the step
    assert opt.state_dict()["state"]
    opt.close()


def test_overlap_backward_reports_a_failed_update():
    m = make_model("transformer")
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=700, placement="cpu", overlap_backward=True)

    def boom(*a, **k):
        raise MemoryError("injected")

    opt._cpu_lane._update_ref = lambda: boom
    _backward(m)
    with pytest.raises(RuntimeError, match="overlapped with backward failed"):
        opt.step()
    opt.close()


def test_overlap_worker_does_not_keep_the_optimizer_alive():
    import gc
    import weakref

    m = make_model("transformer")
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=700, placement="cpu", overlap_backward=True)
    train("transformer", m, opt, 2)
    ref, thread = weakref.ref(opt), opt._cpu_lane._thread
    del opt
    gc.collect()
    assert ref() is None
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_overlap_backward_measures_its_head_start_and_replans_with_it(monkeypatch):
    """With a calibration and stride='auto', the engine measures the backward time the CPU lane
    overlaps and re-plans with it; the result stays the oracle's."""
    import dos.planner
    from dos.perfmodel import DESIGN_H200

    monkeypatch.setattr(dos.planner, "_calibration", lambda device, *a: DESIGN_H200)
    # Deterministic (no wall-clock dependence): the clock is a counter advancing 1 ms per read, and
    # the worker catches up before each step() (no backlog: the head start is its window, which
    # spans at least its first update's reads of the clock). With real time and a worker still on
    # its first subgroup at step(), the head start was 0 (nothing finished) 3 times in 5 on a quiet
    # 2-core machine.
    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)
    a, opt, b, ref = pair("transformer", subgroup_numel=500, placement="interleaved", stride="auto",
                          cpu_threads=2, overlap_backward=True)
    for step in range(6):  # helpers.train's loop, with the worker drained before step()
        opt.zero_grad()
        _backward(a, step)
        opt._cpu_lane.drain()
        opt.step()
    train("transformer", b, ref, 6)
    assert opt.head_start_s > 0 and opt.planner._searched_head_start > 0  # measured and searched with
    assert max_diff(a, b) <= 1e-5


def _slow_worker(opt, seconds: float, log: Optional[list] = None):
    """Make each update overlapped with backward take `seconds` longer (a slow CPU lane)."""
    update = opt._lanes.cpu_update

    def slow(s, *args, **kw):
        time.sleep(seconds)
        update(s, *args, **kw)
        if log is not None:
            log.append(("early", s))
    opt._cpu_lane._update_ref = lambda: slow


@pytest.mark.parametrize("placement", [PLACEMENTS[0], PLACEMENTS[4]], ids=["cpu", "k2"])
def test_overlap_head_start_is_the_workers_time_before_step_not_its_backlog(placement):
    """The head start the model plans with is the time the CPU lane had before step() starts: a
    backlog the worker still has then is drained inside step() and is not counted (it was, and
    made the model believe nearly all CPU work hid behind backward: all-CPU plans, predicted
    ~0.01 s, measured 1.35 s at 7B micro-batch 1 on the H200). The result stays the oracle's."""
    a, opt, b, ref = pair("transformer", subgroup_numel=700, overlap_backward=True, **placement)
    delay = 0.1
    _slow_worker(opt, delay)
    opt.zero_grad()
    _backward(a)
    time.sleep(delay / 2)  # the worker is in its first update when step() starts
    opt.step()
    train("transformer", b, ref, 1)
    n = opt.last_overlapped
    assert n >= 4 and n == sum(1 for s, x in enumerate(opt.plan.lanes) if x == "cpu" and opt._grads.need[s])
    # At step() the worker has had about delay / 2 (a backward of this model takes
    # milliseconds); the whole backlog is n * delay.
    assert delay / 4 < opt.head_start_s < 0.5 * n * delay
    assert max_diff(a, b) <= 1e-5


def test_overlap_head_start_of_a_worker_behind_is_its_finished_work(monkeypatch):
    """With a calibration, a worker that had not caught up when step() started gets the head
    start its finished work takes at the calibrated rate (it waited on gradients and shared the
    host with backward), not the whole window; the record says what online planning used."""
    import dos.planner
    from dos.perfmodel import DESIGN_H200

    monkeypatch.setattr(dos.planner, "_calibration", lambda device, *a: DESIGN_H200)
    a, opt, b, ref = pair("transformer", subgroup_numel=700, placement="cpu", cpu_threads=2,
                          overlap_backward=True)
    _slow_worker(opt, 0.1)
    opt.zero_grad()
    _backward(a)
    time.sleep(0.05)  # a 0.05 s window, in which the worker finishes at most one subgroup
    opt.step()
    train("transformer", b, ref, 1)
    assert 0 <= opt.head_start_s < 700 / DESIGN_H200.cpu(1) * 1.01
    online = opt.describe()["online"]
    assert online["head_start_s"] == pytest.approx(opt.head_start_s, abs=1e-6)
    assert online["last_overlapped"] == opt.last_overlapped > 0 and online["replans"] == []
    assert max_diff(a, b) <= 1e-5


def test_overlap_gpu_lanes_are_enqueued_before_the_worker_is_drained():
    """With updates overlapped with backward, step() enqueues the resident and staged lanes
    first and only then waits for the worker's backlog (they overlap, as the plan predicts); the
    CPU subgroups it updated are not updated again."""
    a, opt, b, ref = pair("transformer", subgroup_numel=700, overlap_backward=True, **PLACEMENTS[4])
    log: list = []
    _slow_worker(opt, 0.02, log)
    lanes, drain = opt._lanes, opt._cpu_lane.drain
    staged = lanes._staged

    def logged_staged(*args):
        log.append(("staged", None))
        staged(*args)

    def logged_drain():
        log.append(("drain", None))
        return drain()
    lanes._staged, opt._cpu_lane.drain = logged_staged, logged_drain
    updates: list = []
    cpu_update = lanes.cpu_update
    lanes.cpu_update = lambda s, *args, **kw: (updates.append(s), cpu_update(s, *args, **kw))[1]
    for step in range(3):
        log.clear(), updates.clear()
        train("transformer", a, opt, 1, start=step)
        train("transformer", b, ref, 1, start=step)
        kinds = [k for k, _ in log]  # (zero_grad() drains too, before backward)
        assert kinds.index("staged") < len(kinds) - 1 - kinds[::-1].index("drain")
        assert "early" in kinds[kinds.index("staged"):]  # the backlog ran on after the enqueue
        early = {s for k, s in log if k == "early"}
        assert early and not early & set(updates)  # step() updated only the others
        assert early | set(updates) == {s for s, x in enumerate(opt.plan.lanes)
                                        if x == "cpu" and opt._grads.need[s]}
    assert max_diff(a, b) <= 1e-5


def test_accumulate_is_a_no_op_without_overlap():
    a, opt, b, ref = pair("odd", subgroup_numel=97, placement="interleaved", stride=2)
    train("odd", a, opt, 5, accum=2)
    train("odd", b, ref, 5, accum=2)
    assert max_diff(a, b) <= 1e-5 and opt.last_overlapped == 0


def test_gpu_fraction_auto_says_when_it_keeps_nothing_resident():
    """Without a CUDA device (or a calibration) gpu_fraction='auto' cannot size a resident share:
    it says so instead of silently training all-offloaded."""
    with pytest.warns(UserWarning, match="gpu_fraction='auto' keeps nothing resident: the parameters are not on a CUDA"):
        opt = dos.DeepOptimizerStates(make_model("odd").parameters(), gpu_fraction="auto")
    assert opt.plan.resident == ()
