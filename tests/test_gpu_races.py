"""Race hunting on a real GPU: every stream hand-off is needed, and none is missing.

The model has layers of tiny arithmetic density (elementwise scales over long vectors), so copies
dominate and any misordering changes numbers. Random GPU spins are inserted before side-stream
work and in backward (`dos.streams.DEBUG`). With every hand-off the result equals the oracle; with
any one of them dropped, some seed gives a wrong result.
"""
from contextlib import nullcontext
from fractions import Fraction

import pytest
import torch

import dos
from dos.perfmodel import build_plan
from dos.streams import DEBUG
from helpers import HAS_CUDA, MasterAdamW

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

WIDTH, LAYERS = 1 << 16, 12
CASES = {
    # hand-off name -> engine settings under which dropping it must show
    "backward->grad_d2h": dict(placement="cpu"),
    "grad_d2h->cpu_update": dict(placement="cpu"),
    "upload->forward": dict(placement="cpu"),
    "backward->gpu_update": dict(placement="interleaved", stride=1),
    "h2d->gpu_update": dict(placement="interleaved", stride=1),
    "gpu_update->d2h": dict(placement="interleaved", stride=1),
    "d2h->h2d(slot)": dict(placement="interleaved", stride=1, staging_slots=2),
    # Implied by the slot events while the plan stays fixed; it guards plan changes (re-planning),
    # simulated here by reversing the staged order after every step.
    "d2h->h2d(state)": dict(placement="interleaved", stride=1, staging_slots=2, reverse=True),
    # A re-plan hands a staged subgroup to the CPU: simulated by alternating all-staged / all-CPU,
    # the CPU starting with the last staged subgroup, and only the write-backs delayed.
    "d2h->cpu_update": dict(placement="interleaved", stride=1, staging_slots=2, alternate=True,
                            delay_streams={"d2h"}),
    "gpu_update->forward": dict(placement="static", gpu_fraction=1.0),
    "d2h->host_read": dict(placement="interleaved", stride=1, staging_slots=8),
    # grad_ring: a subgroup's gradient D2H into a shared host slot waits for the weight upload of
    # the slot's last occupant (2 slots, ~12 CPU subgroups: every slot is reused within a step)
    "upload->grad_d2h(ring)": dict(placement="cpu", grad_ring=2),
}
# Parameters: absolute error; moments: error relative to their largest value. GPU fused AdamW and
# torch's default (foreach) AdamW differ by ~1.3e-5 relative in the moments (measured on the H200).
PASS, DETECT = 1e-4, 1e-3
ALL_LANES = dict(placement="interleaved", stride=2, gpu_fraction=0.25, staging_slots=2)
# overlap_backward=True: the CPU lane runs on a worker thread during backward; the hand-offs it
# relies on are the same two (its gradient's D2H, and the next forward after its uploads).
OVERLAP_CASES = {
    "grad_d2h->cpu_update": dict(placement="cpu", overlap_backward=True),
    "upload->forward": dict(placement="cpu", overlap_backward=True),
}


class Thin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(1 + 0.1 * torch.randn(WIDTH)) for _ in range(LAYERS))
        self.b = torch.nn.ParameterList(torch.nn.Parameter(0.1 * torch.randn(WIDTH)) for _ in range(LAYERS))

    def forward(self, x):
        for w, b in zip(self.w, self.b):
            x = torch.tanh(x * w + b)
        return x


def run(settings, skip=(), delay=0, seed=0, steps=5):
    settings = dict(settings)
    reverse = settings.pop("reverse", False)
    alternate = settings.pop("alternate", False)
    delay_streams = settings.pop("delay_streams", None)
    torch.manual_seed(0)
    a = Thin().cuda()
    b = Thin().cuda()
    b.load_state_dict(a.state_dict())
    kw = dict(lr=1e-2, weight_decay=0.01)
    opt = dos.DeepOptimizerStates(a.parameters(), subgroup_numel=WIDTH * 2 + 1000, **kw, **settings)
    ref = MasterAdamW(list(b.parameters()), **kw)
    DEBUG.skip, DEBUG.delay_cycles, DEBUG.streams = set(skip), delay, delay_streams
    DEBUG.rng.seed(seed)
    try:
        g = torch.Generator(device="cuda").manual_seed(seed)
        for step in range(steps):
            x = torch.randn(4, WIDTH, device="cuda", generator=g)
            y = torch.randn(4, WIDTH, device="cuda", generator=g)
            for model, o in ((a, opt), (b, ref)):
                o.zero_grad()
                for micro in range(2):
                    with o.accumulate() if micro == 0 and o is opt else nullcontext():
                        ((model(x[2 * micro: 2 * micro + 2]) - y[2 * micro: 2 * micro + 2]) ** 2).mean().backward()
                o.step()
            if reverse:
                lanes = opt._lanes
                lanes.plan = lanes.plan.replace(staged_order=lanes.plan.staged_order[::-1])
            if alternate:
                share = Fraction(step % 2)  # all-CPU after even steps, all-staged after odd ones
                new = build_plan(opt.plan.numels, resident=0, staged_share=share,
                                 cpu_threads=opt.plan.cpu_threads, staging_slots=len(opt._dev.slots))
                opt.planner.set_plan(new.replace(cpu_order=new.cpu_order[::-1]), max(opt.group_steps))
        # Read the state right away, as a checkpoint would.
        state = {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()}
    finally:
        DEBUG.skip, DEBUG.delay_cycles, DEBUG.streams = set(), 0, None
    torch.cuda.synchronize()
    err = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    for i, m in enumerate(ref.masters[0]):  # state relative to its scale (moments are small)
        for k in ("exp_avg", "exp_avg_sq"):
            want = ref.opt.state[m][k]
            err = max(err, ((state[i][k].cuda() - want).abs().max() / want.abs().max()).item())
    opt.close()
    return err


@pytest.mark.parametrize("settings", [ALL_LANES, dict(ALL_LANES, overlap_backward=True), dict(ALL_LANES, grad_ring=2)]
                         + list(CASES.values()), ids=["all-lanes", "all-lanes-overlap", "all-lanes-ring"] + list(CASES))
def test_no_race_with_random_delays(settings):
    for seed in range(3):
        assert run(settings, delay=4_000_000, seed=seed) <= PASS


@pytest.mark.parametrize("name", list(CASES))
def test_dropping_any_handoff_breaks_the_result(name):
    errs = [run(CASES[name], skip={name}, delay=20_000_000, seed=seed) for seed in range(3)]
    assert any(not e <= DETECT for e in errs), f"dropping {name} went unnoticed: errors {errs}"  # NaN counts


@pytest.mark.parametrize("name", list(OVERLAP_CASES))
def test_dropping_a_handoff_breaks_overlapped_updates(name):
    errs = [run(OVERLAP_CASES[name], skip={name}, delay=20_000_000, seed=seed) for seed in range(3)]
    assert any(not e <= DETECT for e in errs), f"dropping {name} went unnoticed: errors {errs}"


def test_host_arena_is_pinned_and_exact():
    m = torch.nn.Linear(1000, 1000).cuda().to(torch.bfloat16)
    opt = dos.DeepOptimizerStates(m.parameters(), placement="cpu", subgroup_numel=300_000)
    for s, t in opt._host.state.items():
        assert t.is_pinned() and opt._host.grad[s].is_pinned()
    assert opt.host_bytes_per_param < 14.1
    opt.close()


# DOS_UPLOAD_THREAD=1 (dos/uploads.py): the CPU lane's uploads are issued from a helper thread;
# the hand-offs around them are the same (its gradient's D2H before the update; the next forward
# after the uploads, which `Lanes._cpu` joins before the main stream waits for them).
THREAD_CASES = {
    "grad_d2h->cpu_update": dict(placement="cpu"),
    "upload->forward": dict(placement="cpu"),
}


@pytest.mark.parametrize("settings", [ALL_LANES, dict(placement="cpu")], ids=["all-lanes", "cpu"])
def test_no_race_with_the_upload_thread(monkeypatch, settings):
    from dos import uploads

    monkeypatch.setenv("DOS_UPLOAD_THREAD", "1")
    assert uploads.enabled(torch.device("cuda"))
    for seed in range(3):
        assert run(settings, delay=4_000_000, seed=seed) <= PASS


@pytest.mark.parametrize("name", list(THREAD_CASES))
def test_dropping_a_handoff_breaks_threaded_uploads(monkeypatch, name):
    monkeypatch.setenv("DOS_UPLOAD_THREAD", "1")
    errs = [run(THREAD_CASES[name], skip={name}, delay=20_000_000, seed=seed) for seed in range(3)]
    assert any(not e <= DETECT for e in errs), f"dropping {name} went unnoticed: errors {errs}"
