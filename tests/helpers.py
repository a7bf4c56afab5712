"""Shared test models, the AdamW oracle on fp32 master weights, and a training loop."""
from __future__ import annotations

import contextlib
import copy
import math
import time
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn

import dos

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU")])]


class Block(nn.Module):
    """Pre-norm attention + MLP. No key bias: its gradient is pure rounding noise, which Adam
    amplifies to lr-sized steps and would make any two implementations disagree."""

    def __init__(self, dim, heads, ffn):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.linear1, self.linear2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.linear2(nn.functional.gelu(self.linear1(self.ln2(x))))


class TinyTransformer(nn.Module):
    """A small causal transformer LM: embeddings, attention blocks, untied head."""

    def __init__(self, vocab=61, dim=32, layers=2, heads=4, ffn=72, seq=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


class OddMLP(nn.Module):
    """Parameters of awkward sizes (primes), so no size is a multiple of anything."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(13, 37)
        self.b = nn.Linear(37, 29)
        self.c = nn.Linear(29, 7, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def make_model(kind: str, device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = TinyTransformer() if kind == "transformer" else OddMLP()
    return m.to(device=device, dtype=dtype)


def batch(kind: str, step: int, device="cpu", micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    if kind == "transformer":
        # Learnable sequences (arithmetic progressions mod vocab), so the loss can fall well below
        # ln(vocab) — a broken update shows up as a loss stuck there.
        start = torch.randint(0, 61, (4, 1), generator=g)
        inc = torch.randint(1, 4, (4, 1), generator=g)
        idx = (start + inc * torch.arange(17)) % 61
        return idx[:, :-1].to(device), idx[:, 1:].to(device)
    x = torch.randn(8, 13, generator=g)
    return x.to(device), torch.randn(8, 7, generator=g).to(device)


def loss_fn(kind, model, x, y):
    out = model(x)
    if kind == "transformer":
        return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
    return (out.float() - y.float()).square().mean()


class MasterAdamW:
    """The oracle: torch.optim.AdamW on fp32 master copies; weights cast to the param dtype."""

    def __init__(self, groups, max_grad_norm=None, **kw):
        if not isinstance(groups[0], dict):
            groups = [{"params": list(groups)}]
        self.params = [[p for p in g["params"] if p.requires_grad] for g in groups]
        self.masters = [[p.detach().float().clone().requires_grad_() for p in ps] for ps in self.params]
        mgroups = [{**{k: v for k, v in g.items() if k != "params"}, "params": ms}
                   for g, ms in zip(groups, self.masters)]
        self.opt = torch.optim.AdamW(mgroups, **kw)
        self.max_grad_norm = max_grad_norm

    def zero_grad(self):
        for ps in self.params:
            for p in ps:
                p.grad = None

    @torch.no_grad()
    def step(self):
        for ps, ms in zip(self.params, self.masters):
            for p, m in zip(ps, ms):
                m.grad = torch.zeros_like(m) if p.grad is None else p.grad.float()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([m for ms in self.masters for m in ms], self.max_grad_norm)
        self.opt.step()
        for ps, ms in zip(self.params, self.masters):
            for p, m in zip(ps, ms):
                p.copy_(m)


def train(kind, model, opt, steps, device="cpu", accum=1, sched=None, start=0):
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(accum):
            x, y = batch(kind, step, device, micro)
            loss = loss_fn(kind, model, x, y) / accum
            # dos with overlap_backward: the non-final micro-batches must not start the update
            with opt.accumulate() if micro < accum - 1 and hasattr(opt, "accumulate") else nullcontext():
                loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item() * accum)
    return losses


def pair(kind, device="cpu", dtype=torch.float32, groups=None, max_grad_norm=None, adamw=None, **dos_kw):
    """A dos-optimized model and an identical oracle-optimized copy."""
    adamw = adamw or dict(lr=3e-3, weight_decay=0.05)
    a = make_model(kind, device, dtype)
    b = copy.deepcopy(a)
    ga = groups(a) if groups else a.parameters()
    gb = groups(b) if groups else list(b.parameters())
    opt = dos.DeepOptimizerStates(ga, max_grad_norm=max_grad_norm, **adamw, **dos_kw)
    ref = MasterAdamW(gb, max_grad_norm=max_grad_norm, **adamw)
    return a, opt, b, ref


def max_diff(m1, m2) -> float:
    return max((p.float() - q.float()).abs().max().item() for p, q in zip(m1.parameters(), m2.parameters()))


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def ln(x):
    return math.log(x)


# Every placement, as the client tests (test_clients.py, test_frameworks.py) run them.
CLIENT_PLACEMENTS = [
    dict(placement="cpu"),
    dict(placement="interleaved", stride=1),
    dict(placement="interleaved", stride=2),
    dict(placement="static", gpu_fraction=0.5),
    dict(placement="gpu"),
]
CLIENT_IDS = [",".join(f"{k}={v}" for k, v in p.items()) for p in CLIENT_PLACEMENTS]


class FakeEvent:
    """A CUDA event stand-in on the host clock (CPU copies are synchronous)."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.t - self.t) * 1e3


class FakeStream:
    def wait_event(self, event):
        pass


def fake_cuda_attrs() -> dict:
    """torch.cuda attributes for running the calibration's GPU half on the CPU (set them with
    monkeypatch, or directly in a subprocess)."""
    return dict(Event=FakeEvent, Stream=FakeStream, stream=lambda s: contextlib.nullcontext(),
                synchronize=lambda *a: None, _sleep=lambda cycles: None,
                mem_get_info=lambda *a: (2**33, 2**34), get_device_name=lambda *a: "FakeGPU",
                is_available=lambda: True)


# -- the C++ kernel's tests (test_kernel.py, test_state_format.py) ---------------------------------
# Fixtures: a test module imports them by name (`from helpers import csrc_ops as ops, ...`).

@pytest.fixture(scope="module")
def one_torch_thread():
    """torch's own ops (oracle, baseline) on one thread: parallel regions on a loaded 2-core CI
    machine are slower, not faster. The kernel's thread counts are passed explicitly."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def csrc_ops():
    """`torch.ops.dos`, built; skips under DOS_NO_CSRC."""
    import os

    from dos import _csrc

    if os.environ.get("DOS_NO_CSRC", "0") not in ("", "0"):
        pytest.skip("DOS_NO_CSRC is set")
    o = _csrc.ops()
    assert o is not None, f"csrc did not build: {_csrc.info()}"
    return o


def need_isa(ops, isa):
    """Skips unless this CPU has `isa`; "best": the best it has."""
    if isa == "best":
        return ops.cpu_isas()[0]
    if isa not in ops.cpu_isas():
        pytest.skip(f"this CPU has no {isa}")
