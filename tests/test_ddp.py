"""dos as the optimizer of a DistributedDataParallel model: CPU, gloo, 2 processes.

Every rank updates the whole model from DDP's averaged gradients, so the replicas stay bitwise
identical, and equal (to rounding) DDP + torch.optim.AdamW: every placement (the CPU stands in for
the GPU), with and without `no_sync()` accumulation, `gradient_as_bucket_view` on and off, static
graph or not, and a bf16-compression communication hook. All cases run in one pair of processes.
With dos's comm hook (`dos.register_ddp`, test_ddp_early_d2h_hook) the CPU-lane gradients leave from
DDP's bucket callbacks, reduced, and are not sent again at step().
"""
from __future__ import annotations

import itertools
import os
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dos
import dist_helpers

if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

STEPS = 30
# lr 1e-3, not test_fsdp's 3e-3: with the bf16 hook a 1-ulp difference between dos's AdamW
# arithmetic and torch's can flip a gradient's bf16 rounding; at 3e-3 such flips grew to 1.1e-5 by
# step 30 (no_sync + bf16 hook, the same on every placement, gpu included), at 1e-3 there are none.
LR = dict(lr=1e-3, weight_decay=0.05)
SUBGROUP = 97  # ~20 subgroups of the 1,919 parameters, most spanning parameters
BUCKET_MB = 0.002  # ~4 DDP buckets: all-reduces start during backward, as on a real model
PLACEMENTS = {
    "cpu": dict(placement="cpu"),
    "interleaved-k2": dict(placement="interleaved", stride=2),
    "interleaved-auto": dict(placement="interleaved", stride="auto"),
    "static-0.5": dict(placement="static", gpu_fraction=0.5),
    "gpu": dict(placement="gpu"),
}
# (no_sync accumulation of 2 micro-batches, gradient_as_bucket_view, static_graph, bf16 hook);
# not no_sync with static_graph: DDP itself fails there (an internal assert in its reducer, with
# torch.optim.AdamW too, torch 2.13)
VARIANTS = [v for v in itertools.product([False, True], repeat=4) if not (v[0] and v[2])]


def variant_name(v) -> str:
    flags = [n for n, on in zip(("no_sync", "bucket_view", "static", "bf16_hook"), v) if on]
    return "+".join(flags) or "plain"


class MLP(nn.Module):
    """Odd sizes: parameters span subgroups and DDP buckets."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(13, 37), nn.Linear(37, 29), nn.Linear(29, 7, bias=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


# -- in the worker processes -------------------------------------------------------------------
def bf16_hook(state, bucket):
    """torch's `bf16_compress_hook` (all-reduce in bf16, decompressed into the bucket). DDP
    refuses that function by name without NCCL; gloo all-reduces bf16 as well."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    return bf16_compress_hook(state, bucket)


def _ddp(variant):
    from torch.nn.parallel import DistributedDataParallel as DDP

    _, bucket_view, static, hook = variant
    torch.manual_seed(0)
    m = DDP(MLP(), bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=bucket_view, static_graph=static)
    if hook:
        m.register_comm_hook(None, bf16_hook)
    return m


def _train(m, opt, accum: int, steps: int = STEPS):
    rank = dist.get_rank()
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accum):
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)  # each rank its batch
            x, y = torch.randn(8, 13, generator=g), torch.randn(8, 7, generator=g)
            with m.no_sync() if micro < accum - 1 else nullcontext():
                ((m(x) - y).square().mean() / accum).backward()
        opt.step()


def _flat(m) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _matrix(tmp, placements, variants):
    out = {}
    for v in variants:
        accum = 2 if v[0] else 1
        ref = _ddp(v)
        _train(ref, torch.optim.AdamW(ref.parameters(), **LR), accum)
        want = _flat(ref)
        for name in placements:
            m = _ddp(v)
            opt = dos.DeepOptimizerStates(m.parameters(), subgroup_numel=SUBGROUP, **LR, **PLACEMENTS[name])
            assert len(opt.layout.subgroups) >= 16
            _train(m, opt, accum)
            got = _flat(m)
            ranks = [torch.empty_like(got) for _ in range(dist.get_world_size())]
            dist.all_gather(ranks, got)
            out[f"{name} {variant_name(v)}"] = {
                "ranks_bitwise": all(torch.equal(ranks[0], r) for r in ranks[1:]),
                "ranks_diff": max((ranks[0] - r).abs().max().item() for r in ranks[1:]),
                "ref_diff": dist_helpers.all_max((got - want).abs().max().item()),
                "resent": opt.describe()["clients"]["resent_subgroups"],
                "early": opt.describe()["clients"]["ddp_early_buckets"],
            }
            opt.close()
    return out


def _preflight(tmp):
    """Each DDP rank holds a full copy of the state: a host-memory limit that holds one arena but
    not two fails on every rank, before anything is allocated; the CPU lane's threads are the
    host's cores divided by its 2 ranks; overlap_backward raises. The ranks on this host are found by their host names
    (not torchrun's LOCAL_WORLD_SIZE, removed here)."""
    os.environ.pop("LOCAL_WORLD_SIZE")
    m = _ddp(VARIANTS[0])
    opt = dos.DeepOptimizerStates(m.parameters(), placement="cpu", subgroup_numel=SUBGROUP)
    threads, one = opt.plan.cpu_threads, opt.host_bytes
    limit = 1.5 * one / 2**30
    try:
        dos.DeepOptimizerStates(m.parameters(), placement="cpu", subgroup_numel=SUBGROUP,
                                host_memory_limit_gib=limit)
        raised = ""
    except dos.HostMemoryError as e:
        raised = str(e)
    fits = dos.DeepOptimizerStates(m.parameters(), placement="cpu", subgroup_numel=SUBGROUP,
                                   host_memory_limit_gib=3 * limit)
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (raised, threads, fits.host_bytes == one))
    # overlap_backward would update from the local gradient: step() raises, naming DDP
    opt = dos.DeepOptimizerStates(m.parameters(), placement="cpu", subgroup_numel=SUBGROUP,
                                  overlap_backward=True)
    with pytest.raises(RuntimeError, match="DistributedDataParallel"):
        _train(m, opt, 1, steps=1)
    return {"ranks": flags, "cores": dos.planner.usable_cores()}


class UnusedMLP(MLP):
    """find_unused_parameters: `d` is used on a rank only on some steps (locally unused but
    globally used, or unused on every rank), `e` never."""

    def __init__(self):
        super().__init__()
        self.d, self.e = nn.Linear(29, 29), nn.Linear(29, 29)

    def forward(self, x, use_d=True):
        h = torch.tanh(self.b(torch.relu(self.a(x))))
        return self.c(self.d(h) if use_d else h)


# The hook's cases: (name, no_sync, bucket_view, static, bf16 hook, find_unused, set_to_none,
# the user's clip_grad_norm_ after backward)
EARLY = [("plain", False, False, False, False, False, True, False),
         ("no_sync+bf16_hook", True, False, False, True, False, True, False),
         ("bucket_view+static", False, True, True, False, False, True, False),
         ("no_sync+bucket_view+bf16_hook", True, True, False, True, False, True, False),
         ("unused", False, False, False, False, True, True, False),
         ("unused+zero_grad(none=False)", False, False, False, False, True, False, False),
         ("unused+bucket_view", False, True, False, False, True, True, False),
         ("clip", False, False, False, False, False, True, True)]


def _early(tmp, placements, cases):
    """dos.register_ddp against DDP + torch.optim.AdamW (with the same inner hook)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, out = dist.get_rank(), {}

    def model(case, with_dos=None):
        _, _, view, static, bf16, unused, _, _ = case
        torch.manual_seed(0)
        m = DDP(UnusedMLP() if unused else MLP(), bucket_cap_mb=BUCKET_MB,
                gradient_as_bucket_view=view, static_graph=static, find_unused_parameters=unused)
        if with_dos is not None:
            dos.register_ddp(m, with_dos(m), hook=bf16_hook if bf16 else None)
        elif bf16:
            m.register_comm_hook(None, bf16_hook)
        return m

    def train(m, opt, case):
        accum, none = 2 if case[1] else 1, case[6]
        for step in range(STEPS):
            opt.zero_grad(set_to_none=none)
            for micro in range(accum):
                g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
                x, y = torch.randn(8, 13, generator=g), torch.randn(8, 7, generator=g)
                kw = dict(use_d=(step + rank) % 3 == 0) if case[5] else {}
                with m.no_sync() if micro < accum - 1 else nullcontext():
                    ((m(x, **kw) - y).square().mean() / accum).backward()
            if case[7]:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            opt.step()

    for case in cases:
        ref = model(case)
        train(ref, torch.optim.AdamW(ref.parameters(), **LR), case)
        want = _flat(ref)
        for name in placements:
            opts = []
            m = model(case, lambda m: opts.append(dos.DeepOptimizerStates(
                m.parameters(), subgroup_numel=SUBGROUP, **LR, **PLACEMENTS[name])) or opts[0])
            opt = opts[0]
            train(m, opt, case)
            got = _flat(m)
            ranks = [torch.empty_like(got) for _ in range(dist.get_world_size())]
            dist.all_gather(ranks, got)
            clients = opt.describe()["clients"]
            out[f"{name} {case[0]}"] = {
                "ranks_bitwise": all(torch.equal(ranks[0], r) for r in ranks[1:]),
                "ref_diff": dist_helpers.all_max((got - want).abs().max().item()),
                # CPU subgroups holding parameters (not only a bucket's padding: sent by step())
                "cpu_subgroups": sum(1 for s in opt.plan.cpu_order if opt._grads.need[s]),
                **clients}
            opt.close()
    # refused: overlap_backward; a second hook on the same optimizer
    m = model(EARLY[0])
    opt = dos.DeepOptimizerStates(m.parameters(), placement="cpu", overlap_backward=True)
    with pytest.raises(NotImplementedError, match="overlap_backward"):
        dos.ddp_comm_hook(opt)
    opt = dos.DeepOptimizerStates(m.parameters(), placement="cpu")
    dos.ddp_comm_hook(opt)
    with pytest.raises(RuntimeError, match="already has a DDP hook"):
        dos.ddp_comm_hook(opt)
    return out


# -- in pytest ---------------------------------------------------------------------------------
def test_ddp_replicas_identical_and_equal_to_ddp_adamw(tmp_path):
    res = dist_helpers.spawn(_matrix, 2, tmp_path, list(PLACEMENTS), VARIANTS)
    for case, r in res.items():
        print(f"{case:45s} ranks {'bitwise' if r['ranks_bitwise'] else r['ranks_diff']:>10}  "
              f"|dos - AdamW| {r['ref_diff']:.2e}  re-sent {r['resent']}")
    assert len(res) == len(PLACEMENTS) * len(VARIANTS)
    bad = {c: r for c, r in res.items() if not r["ranks_bitwise"] or r["ref_diff"] > 1e-5}
    assert not bad, bad
    # without dos's comm hook nothing is sent from DDP's callbacks (test_ddp_early_d2h_hook)
    assert all(r["early"] == 0 for r in res.values())


def test_ddp_host_memory_preflight_and_threads_count_every_local_rank(tmp_path):
    res = dist_helpers.spawn(_preflight, 2, tmp_path)
    for raised, threads, fits in res["ranks"]:
        assert "on 2 ranks of this host" in raised and "host_memory_limit_gib" in raised, raised
        assert threads == max(1, res["cores"] // 2) and fits


def test_ddp_early_d2h_hook(tmp_path):
    """dos.register_ddp: the CPU-lane gradients leave the GPU from DDP's bucket callbacks, reduced,
    and are not sent again at step(); the replicas stay bitwise equal and equal DDP + AdamW."""
    res = dist_helpers.spawn(_early, 2, tmp_path, list(PLACEMENTS), EARLY)
    for case, r in res.items():
        print(f"{case:55s} ranks {'bitwise' if r['ranks_bitwise'] else 'DIFFER'}  |dos - AdamW| "
              f"{r['ref_diff']:.2e}  early buckets {r['ddp_early_buckets']} subgroups "
              f"{r['ddp_early_subgroups']} refused {r['ddp_refused_params']} re-sent "
              f"{r['resent_subgroups']} deferred {r['deferred_steps']}")
    assert len(res) == len(PLACEMENTS) * len(EARLY)
    bad = {c: r for c, r in res.items() if not r["ranks_bitwise"] or r["ref_diff"] > 1e-5}
    assert not bad, bad
    for case, r in res.items():
        cpu = r["cpu_subgroups"]
        if "clip" in case:  # every early send redone at step(): deferred, as without the hook
            assert (r["resent_subgroups"] > 0 and r["deferred_steps"] > 0) == (cpu > 0), case
            continue
        assert r["deferred_steps"] == 0, case
        if not cpu:  # placement gpu: nothing to send
            assert r["ddp_early_subgroups"] == 0 and r["resent_subgroups"] == 0, case
            continue
        # every CPU subgroup of every step's synchronized backward went from a callback
        assert r["ddp_early_buckets"] >= STEPS and r["ddp_early_subgroups"] == STEPS * cpu, case
        assert r["resent_subgroups"] == 0, case
        if "unused" in case and "bucket_view" not in case:
            # `d` unused on a rank: DDP creates its .grad (set_to_none) or, unused on every rank,
            # leaves the local one: not what was sent, so step() sends those subgroups
            assert r["ddp_refused_params"] > 0, case
        else:  # with gradient_as_bucket_view DDP points such a .grad at the reduced bucket
            assert r["ddp_refused_params"] == 0, case
