"""`state_dtype="bf16-split"` end to end (dos/split_master.py, docs/DESIGN.md §3.7): bf16 moments
with the fp32 master stored as its bf16 weight `hi` and an int16 remainder, so the CPU lane writes
no separate weights and uploads `hi`. Against the plain-torch reference of the same algorithm over
the same subgroups, every placement (CPU and GPU lanes, resident, staged); the weights are the
state's `hi`; resume is bitwise; bf16 and bf16-split state_dicts load into each other exactly.
Weights loaded in place re-seed it as the fp32 master's (tests/test_clients.py, parametrized over
both)."""
import copy
import warnings

import pytest
import torch

import dos
from dos import split_master as sm
from dos import state_format as sf
from helpers import CLIENT_IDS, CLIENT_PLACEMENTS, DEVICES
from test_state_dtype import HP, SG, Reference, batches, max_diff, model, train

FMT = "bf16-split"


class SplitReference(Reference):
    """Plain torch: split_master.reference_step_ over dos's subgroups of one flat bf16 bucket (the
    layout of test_state_dtype's Reference)."""

    def __init__(self, params, opt):
        self.params = list(params)
        assert len(opt.layout.buckets) == 1
        self.places = [(slot.offset, slot.numel) for slot in sorted(opt.param_slots(), key=lambda s: s.index)]
        self.size = opt.layout.buckets[0].numel
        self.bounds = [(sg.start, sg.stop) for sg in opt.layout.subgroups]
        self.hi, self.lo = sm.split(self._flat([p.detach().float() for p in self.params]))
        self.m = torch.zeros(self.size, dtype=torch.bfloat16)
        self.v = torch.zeros(self.size, dtype=torch.bfloat16)
        self.step_n = 0

    def masters(self):
        return sm.join(self.hi, self.lo)

    @torch.no_grad()
    def step(self):
        self.step_n += 1
        g = self._flat([p.grad.float() for p in self.params])
        for a, b in self.bounds:  # elementwise: one call per subgroup is the same as one call
            sm.reference_step_(self.hi[a:b], self.lo[a:b], self.m[a:b], self.v[a:b], g[a:b],
                               lo_i=0, hi_i=b - a, step=self.step_n, lr=HP["lr"], beta1=HP["betas"][0],
                               beta2=HP["betas"][1], eps=HP["eps"], weight_decay=HP["weight_decay"])
        for (off, n), p in zip(self.places, self.params):
            p.copy_(self.hi[off: off + n].view(p.shape))


def dos_masters(opt):
    return torch.cat([sf.master_fp32(opt.state_format, opt.state_views(s)).cpu()
                      for s in range(len(opt.layout.subgroups))])


MORE = [dict(placement="cpu", grad_ring=2), dict(placement="interleaved", stride=2, overlap_backward=True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", CLIENT_PLACEMENTS + MORE,
                         ids=CLIENT_IDS + [",".join(f"{k}={v}" for k, v in p.items()) for p in MORE])
def test_matches_the_plain_torch_reference(placement, device):
    """30 steps: the masters within 2e-4 of the reference's (as test_state_dtype's bf16: the
    vector kernels' FMAs may flip a moment's rounding), and every weight is its state's hi."""
    a = model(torch.bfloat16, device=device)
    ref_m = copy.deepcopy(a)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=SG, state_dtype=FMT, **HP, **placement)
    assert opt.describe()["state_dtype"] == FMT and opt.plan.state_dtype == FMT
    data = batches(device)
    train(a, opt, data)
    ref = SplitReference(ref_m.parameters(), opt)
    train(ref_m, ref, data)
    err = (dos_masters(opt) - ref.masters()).abs().max().item()
    assert err <= 2e-4, err
    opt.wait_host_state()
    for s in range(len(opt.layout.subgroups)):  # the weights on the device are hi, bit for bit
        hi = opt.state_views(s).hi
        assert torch.equal(opt._dev.param(opt.layout, s).view(torch.int16).cpu(), hi.view(torch.int16).cpu())


def test_cpu_lane_writes_no_weights_over_the_gradient():
    """All-CPU: the host gradient block keeps the gradient (the weights go up from hi)."""
    a = model(torch.bfloat16)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=SG, state_dtype=FMT, placement="cpu", **HP)
    (x, y), = batches(n=1)
    from test_state_dtype import loss_of
    loss_of(a, x, y).backward()
    grads = {slot: opt._params[slot].grad.reshape(-1).clone() for slot in opt.param_slots()}
    opt.step()
    host = torch.cat([opt._host.grad[s][: opt.layout.subgroups[s].numel] for s in range(len(opt.layout.subgroups))])
    for slot, g in grads.items():  # the bucket's flat order: subgroups are consecutive ranges of it
        assert torch.equal(host[slot.offset: slot.offset + slot.numel].view(torch.int16), g.view(torch.int16))


def test_needs_bf16_parameters():
    with pytest.raises(ValueError, match="every trainable parameter must be bfloat16"):
        dos.DeepOptimizerStates(model().parameters(), state_dtype=FMT, **HP)


@pytest.mark.parametrize("placement", CLIENT_PLACEMENTS, ids=CLIENT_IDS)
def test_resume_is_bitwise(placement, tmp_path):
    data = batches()
    a = model(torch.bfloat16)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=SG, state_dtype=FMT, **HP, **placement)
    train(a, opt, data[:12])
    torch.save({"model": a.state_dict(), "opt": opt.state_dict()}, tmp_path / "ck.pt")
    train(a, opt, data[12:])
    ck = torch.load(tmp_path / "ck.pt", weights_only=False)
    assert ck["opt"]["dos"]["state_dtype"] == FMT
    assert all(e["master"].dtype == torch.float32 for e in ck["opt"]["state"].values())
    b = model(torch.bfloat16, seed=5)
    b.load_state_dict(ck["model"])
    opt2 = dos.DeepOptimizerStates(b.parameters(), subgroup_numel=SG, state_dtype=FMT, **HP, **placement)
    opt2.load_state_dict(ck["opt"])
    train(b, opt2, data[12:])
    assert max_diff(a, b) == 0.0
    assert torch.equal(dos_masters(opt).view(torch.int32), dos_masters(opt2).view(torch.int32))


@pytest.mark.parametrize("src,dst", [("bf16", FMT), (FMT, "bf16")])
def test_bf16_and_split_state_dicts_load_exactly_without_a_warning(src, dst):
    data = batches()
    a = model(torch.bfloat16)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=SG, state_dtype=src, **HP)
    train(a, opt, data[:5])
    sd = opt.state_dict()
    b = copy.deepcopy(a)
    opt2 = dos.DeepOptimizerStates(b.parameters(), subgroup_numel=SG, state_dtype=dst, **HP)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt2.load_state_dict(sd)
    sd2 = opt2.state_dict()
    for k in sd["state"]:
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            x, y = sd["state"][k][kind], sd2["state"][k][kind]
            assert x.dtype == y.dtype and torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x, 
                                                      y.view(torch.int16) if y.dtype == torch.bfloat16 else y), kind
    train(b, opt2, data[5:])
