"""dos as the optimizer of an FSDP2 (`fully_shard`) model, for torchrun users.

    torchrun --nproc_per_node 2 examples/fsdp2_train.py --steps 20            # CPU: gloo
    torchrun --nproc_per_node 8 examples/fsdp2_train.py --dim 1024 --bf16     # GPUs: nccl

A tiny Llama-like model (RMSNorm, rotary attention, SwiGLU), each block and the root sharded with
`fully_shard`; every rank offloads and updates its own shards with dos (placement, stride and
resident share as on one GPU; CPU threads split among the ranks of a host). `--ckpt DIR` saves
model and optimizer with torch.distributed.checkpoint at the end, and resumes from DIR when it
holds a checkpoint (on any number of ranks).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dos


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype)


def rotary(x, base: float = 10000.0):
    """Rotary position embedding of (batch, heads, seq, head_dim)."""
    t, d = x.shape[-2], x.shape[-1]
    freqs = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32),
                        base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)  # gate and up projections
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.wqkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, d))
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, 4 * dim * 2 // 3) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def batch(step: int, rank: int, args, device):
    """Learnable synthetic sequences (arithmetic progressions mod vocab), a different batch per
    rank and step."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=g)
    inc = torch.randint(1, 5, (args.batch, 1), generator=g)
    idx = (start + inc * torch.arange(args.seq + 1)) % args.vocab
    return idx[:, :-1].to(device), idx[:, 1:].to(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--placement", default="interleaved", choices=["interleaved", "cpu", "static", "gpu"])
    ap.add_argument("--stride", default="auto")
    ap.add_argument("--gpu-fraction", default="0", help="resident share of the state, or 'auto'")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 gradient reduction")
    ap.add_argument("--ckpt", default=None, help="DCP checkpoint directory (resume from it if present)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)
    with torch.device(device):
        model = TinyLlama(args.vocab, args.dim, args.layers, args.heads)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    kw = dict(mesh=mesh, **({"mp_policy": mp} if mp else {}))
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)

    # No weight decay on norms; the rest as AdamW. dos offloads and updates this rank's shards.
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    stride = args.stride if args.stride == "auto" else int(args.stride)
    fraction = args.gpu_fraction if args.gpu_fraction == "auto" else float(args.gpu_fraction)
    opt = dos.DeepOptimizerStates(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, weight_decay=0.1,
        placement=args.placement, stride=stride, gpu_fraction=fraction, max_grad_norm=args.max_grad_norm)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))

    start = 0
    if args.ckpt and os.path.exists(os.path.join(args.ckpt, ".metadata")):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                 "extra": {"step": 0, "sched": sched.state_dict()}}
        dcp.load(state, checkpoint_id=args.ckpt)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        sched.load_state_dict(state["extra"]["sched"])
        start = state["extra"]["step"]
        if rank == 0:
            print(f"resumed from {args.ckpt} at step {start}")

    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"{world} ranks on {device.type}, {n:,} parameters; dos plan on rank 0: "
              f"{opt.plan.to_record()}")
    for step in range(start, start + args.steps):
        t0 = time.perf_counter()
        x, y = batch(step, rank, args, device)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0 and (step % 5 == 0 or step == start + args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {opt.last_grad_norm:.3f}  "
                  f"{time.perf_counter() - t0:.3f} s")

    if args.ckpt:
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt),
                  "extra": {"step": start + args.steps, "sched": sched.state_dict()}},
                 checkpoint_id=args.ckpt)
        if rank == 0:
            print(f"saved {args.ckpt}")
    opt.close()
    # every rank past its last collective before any tears gloo down: a rank that destroyed its
    # process group while another still read from it aborted once ("terminate called without an
    # active exception" at exit, 1 of many CI runs)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
