"""What clients do to parameters and gradients between backward and step(), against
torch.optim.AdamW on an identical copy (fp32: <= 1e-5 over >= 30 steps, every placement).

Each test runs the same client code on a dos-optimized model and on a torch.optim.AdamW-optimized
copy: gradient clipping by the user, GradScaler (with an inf step), unused parameters (MoE-like),
gradients assigned or replaced without backward, weights loaded in place, parameters replaced,
cast or unfrozen after construction, safetensors saving.
"""
import copy

import pytest
import torch
import torch.nn as nn

import dos
from dos.params import PROBE_EVERY
from helpers import CLIENT_IDS, CLIENT_PLACEMENTS, batch, loss_fn, make_model, max_diff

STEPS = 30
PLACEMENTS, IDS = CLIENT_PLACEMENTS, CLIENT_IDS
HP = dict(lr=3e-3, weight_decay=0.05)


def twins(placement, model=None, subgroup_numel=97, **kw):
    a = model if model is not None else make_model("odd")
    b = copy.deepcopy(a)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=subgroup_numel, **HP, **placement, **kw)
    ref = torch.optim.AdamW(b.parameters(), **HP)
    return (a, opt), (b, ref)


def backward(model, step):
    x, y = batch("odd", step)
    loss = loss_fn("odd", model, x.to(next(model.parameters()).dtype), y)
    loss.backward()
    return loss


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_user_clip_grad_norm_is_honoured(placement):
    pairs = twins(placement)
    for step in range(STEPS):
        for model, opt in pairs:
            opt.zero_grad()
            backward(model, step)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # clips every step
            opt.step()
    assert max_diff(pairs[0][0], pairs[1][0]) <= 1e-5
    if pairs[0][1].plan.cpu_order:
        clients = pairs[0][1].describe()["clients"]
        assert clients["resent_subgroups"] > 0
        # Every early send was redone after the first step: backward stops sending early (step()
        # sends each gradient once), probing again every PROBE_EVERY steps; still AdamW's result.
        probes = (STEPS - 1) // PROBE_EVERY
        assert clients["deferred_steps"] == STEPS - 1 - probes
        assert clients["resent_subgroups"] <= len(pairs[0][1].plan.cpu_order) * (1 + probes)


def test_early_sends_resume_when_the_client_stops_changing_gradients():
    """A probe finds the early sends worth keeping again once nothing changes them after backward."""
    (model, opt), (ref_model, ref) = twins(dict(placement="cpu"))
    for step in range(2 * PROBE_EVERY + 4):
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            backward(m, step)
            if step < PROBE_EVERY // 2:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            o.step()
    assert max_diff(model, ref_model) <= 1e-5
    assert opt._grads.send_early  # the probe after clipping stopped found nothing stale
    assert opt.describe()["clients"]["deferred_steps"] < PROBE_EVERY


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_grad_scaler_unscale_and_inf_step(placement):
    pairs = twins(placement)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 12) for _ in pairs]
    skipped = []
    for step in range(STEPS):
        for (model, opt), scaler in zip(pairs, scalers):
            opt.zero_grad()
            x, y = batch("odd", step)
            scaler.scale(loss_fn("odd", model, x, y)).backward()
            if step == 7:  # an overflow: GradScaler skips the step, and so must both optimizers
                model.a.weight.grad[0, 0] = float("inf")
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scale:
                skipped.append(step)
    assert skipped == [7, 7]
    assert max_diff(pairs[0][0], pairs[1][0]) <= 1e-5
    sd_a, sd_b = pairs[0][1].state_dict()["state"], pairs[1][1].state_dict()["state"]
    for k in sd_b:
        assert float(sd_a[k]["step"]) == float(sd_b[k]["step"]) == STEPS - 1
        torch.testing.assert_close(sd_a[k]["exp_avg_sq"], sd_b[k]["exp_avg_sq"], atol=1e-6, rtol=1e-4)


class MoE(nn.Module):
    """A router picks one of four experts per step; the unused experts get no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(13, 24)
        self.experts = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))
        self.out = nn.Linear(24, 7)

    def forward(self, x, step):
        h = torch.relu(self.inp(x))
        used = [step % 4] if step % 3 else [0, 2]
        for e in used:
            h = h + torch.tanh(self.experts[e](h))
        return self.out(h)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_unused_parameters_are_skipped_like_adamw(placement, zero):
    """No decay, no moment update, no step for a parameter without a gradient (per-parameter
    steps; subgroups with mixed steps update per segment); dos's clipping ignores them too."""
    pairs = twins(placement, MoE(), subgroup_numel=300, max_grad_norm=None)
    for step in range(STEPS):
        for model, opt in pairs:
            (opt if zero == "optimizer" else model).zero_grad(set_to_none=True)
            x, y = batch("odd", step)
            ((model(x, step) - y) ** 2).mean().backward()
            opt.step()
    assert max_diff(pairs[0][0], pairs[1][0]) <= 1e-5
    sd_a, sd_b = pairs[0][1].state_dict()["state"], pairs[1][1].state_dict()["state"]
    assert sorted(sd_a) == sorted(sd_b)
    assert {float(v["step"]) for v in sd_b.values()} == {float(v["step"]) for v in sd_a.values()}
    assert len({float(v["step"]) for v in sd_b.values()}) > 1  # steps differ per parameter
    for k in sd_b:
        assert float(sd_a[k]["step"]) == float(sd_b[k]["step"])
    assert pairs[0][1].describe()["clients"]["skipped_params"] > 0


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_unused_parameters_with_dos_clipping(placement):
    """dos's own max_grad_norm over a step where some parameters have no gradient: their stale
    gradient (an earlier step's) must not count in the norm."""
    a = MoE()
    b = copy.deepcopy(a)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=300, max_grad_norm=0.1, **HP, **placement)
    ref = torch.optim.AdamW(b.parameters(), **HP)
    for step in range(STEPS):
        for model, o in ((a, opt), (b, ref)):
            o.zero_grad()
            x, y = batch("odd", step)
            ((model(x, step) - y) ** 2).mean().backward()
            if o is ref:
                torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
            o.step()
    assert max_diff(a, b) <= 1e-5


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_gradients_assigned_or_replaced_without_backward(placement):
    pairs = twins(placement)
    for step in range(STEPS):
        for model, opt in pairs:
            opt.zero_grad(set_to_none=step % 2 == 0)
            if step % 3 == 0:  # assigned, no backward at all
                for p in model.parameters():
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step + p.numel()))
            else:  # backward, then replaced by a new tensor / changed in place
                backward(model, step)
                model.a.weight.grad = model.a.weight.grad * 0.5
                model.b.bias.grad.mul_(-1.0)
            opt.step()
    assert max_diff(pairs[0][0], pairs[1][0]) <= 1e-5


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_weights_loaded_in_place_between_steps(placement):
    """model.load_state_dict (a Trainer resume with save_only_model) and in-place edits re-seed
    dos's fp32 master: exact for fp32 parameters."""
    pairs = twins(placement)
    other = make_model("odd", seed=5).state_dict()
    for step in range(STEPS):
        for model, opt in pairs:
            if step == 10:
                model.load_state_dict(other)
            if step == 20:
                with torch.no_grad():
                    model.b.weight.mul_(0.5)
            opt.zero_grad()
            backward(model, step)
            opt.step()
    assert max_diff(pairs[0][0], pairs[1][0]) <= 1e-5
    assert pairs[0][1].describe()["clients"]["resynced_params"] == 6


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16-split"])
def test_bf16_weights_loaded_in_place_take_the_bf16_value(state_dtype):
    """For bf16 parameters the re-seeded master is the bf16 value (its fp32 bits are lost); with
    the split master (dos/split_master.py) that is hi = the weight, lo = 0, in every subgroup a
    parameter spans."""
    m = make_model("odd", dtype=torch.bfloat16)
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=97, placement="interleaved", stride=2,
                                  state_dtype=state_dtype)
    for step in range(3):
        opt.zero_grad()
        backward(m, step)
        opt.step()
    new = make_model("odd", dtype=torch.bfloat16, seed=3)
    m.load_state_dict(new.state_dict())
    opt.zero_grad()
    opt.step()  # no gradients: nothing moves, but the master is re-seeded
    assert opt.describe()["clients"]["resynced_params"] > 0
    for i, p in enumerate(m.parameters()):
        torch.testing.assert_close(opt.state_dict()["state"][i]["master"], p.detach().float(), atol=0, rtol=0)
        assert torch.equal(p.detach(), list(new.parameters())[i].detach())


@pytest.mark.parametrize("placement", PLACEMENTS, ids=IDS)
def test_parameter_data_replaced_is_followed(placement):
    """p.data = a new tensor of the same dtype, device and shape: adopted (as an in-place load)."""
    pairs = twins(placement)
    for step in range(STEPS):
        for model, opt in pairs:
            if step == 5:
                model.c.weight.data = model.c.weight.data.clone() * 0.9
            opt.zero_grad()
            backward(model, step)
            opt.step()
    assert max_diff(pairs[0][0], pairs[1][0]) <= 1e-5
    assert pairs[0][1].describe()["clients"]["followed_params"] == 1


@pytest.mark.parametrize("cast", [dict(dtype=torch.bfloat16), dict(dtype=torch.float64)])
def test_model_cast_after_construction_raises_clearly(cast):
    m = make_model("odd")
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=97, placement="interleaved", stride=2)
    backward(m, 0)
    opt.step()
    m.to(**cast)
    opt.zero_grad()
    x, y = batch("odd", 1)
    loss_fn("odd", m, x.to(cast["dtype"]), y).backward()
    with pytest.raises(RuntimeError, match="moved, cast or reshaped after the optimizer was built"):
        opt.step()


def test_unfrozen_parameter_raises_clearly():
    """torch.optim.AdamW would train it; dos has no state for it: an error, never a silent no-train."""
    m = make_model("odd")
    m.c.weight.requires_grad_(False)
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=97, placement="cpu")
    backward(m, 0)
    opt.step()
    m.c.weight.requires_grad_(True)
    opt.zero_grad()
    backward(m, 1)
    with pytest.raises(RuntimeError, match="requires_grad=False when the optimizer was built"):
        opt.step()


def test_parameters_do_not_share_storage_but_alias_the_flat_buffer():
    from safetensors.torch import _find_shared_tensors, load_model, save_model

    m = make_model("transformer")
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=1000, placement="interleaved", stride=2)
    ptrs = {p.untyped_storage().data_ptr() for p in m.parameters()}
    assert len(ptrs) == len(list(m.parameters()))
    assert all(len(names) == 1 for names in _find_shared_tensors(m.state_dict()))
    p = m.head.weight
    with torch.no_grad():
        p.fill_(0.25)  # writes through to the flat buffer the subgroup upload reads
    slot = next(s for s, q in opt._params.items() if q is p)
    assert torch.all(opt._dev.params[slot.bucket][slot.offset: slot.offset + slot.numel] == 0.25)
    import tempfile, os
    with tempfile.TemporaryDirectory() as d:
        save_model(m, os.path.join(d, "m.safetensors"))
        m2 = make_model("transformer", seed=9)
        load_model(m2, os.path.join(d, "m.safetensors"))
    assert max_diff(m, m2) == 0


def test_overlap_backward_refuses_gradients_changed_after_the_cpu_lane_consumed_them():
    """With overlap_backward the CPU lane may update a subgroup during backward: a gradient changed
    afterwards (a framework's clipping) cannot be honoured, so step() raises instead of ignoring it."""
    m = make_model("odd")
    opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=97, placement="cpu", overlap_backward=True)
    backward(m, 0)
    opt.step()
    opt.zero_grad()
    backward(m, 1)
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="clip with dos's max_grad_norm"):
        opt.step()
