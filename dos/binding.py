"""How the optimizer holds the model's parameters: one binding object, chosen at construction
(`make_binding`), so that the engine never branches on the kind of parameter.

`DirectBinding` — plain tensors (one process, or DDP): the parameters become aliases of dos's flat
buffers and their `.grad` views of the flat gradient buffers, which the GradRouter's
post-accumulate hooks watch during backward. Its `dos.params.ParamTracker` honours at `step()` what
clients did in between (gradients clipped, assigned or None; weights loaded in place or replaced).

`ShardBinding` — the DTensor parameters of an FSDP2 (`fully_shard`) model. Each rank offloads and
updates its *local shards* with the same Plan machinery (the layout is made of the local shards'
elements). FSDP owns its parameters' storage — a sharded parameter's local tensor is a view into
FSDP's padded flat buffer, re-viewed around all-gathers — so dos never repoints it. Instead, copy
in and copy out:
- `before_update`: each local gradient shard (`p.grad.to_local()`: the reduce-scatter output, in
  the parameter's dtype whatever the MixedPrecisionPolicy's reduce dtype) is copied into dos's
  flat gradient buffer, as it is when `step()` runs (so gradients changed after backward count);
  a parameter without a gradient is skipped (no decay, no moment update, no step: as torch and
  the direct path; `dos.params.StepCounts`);
- `after_update`: the updated weights are copied from dos's flat parameter buffer into each
  `p.to_local()` in place, on the main stream after every lane's writes (the next all-gather reads
  them from there).
Clipping takes the global norm: the squared local norm is all-reduced over the mesh dimensions the
parameters are sharded on. The host-memory preflight counts the arenas of every rank on this host.
"""
from __future__ import annotations

import os
import socket
from typing import Dict, List, Optional

import torch

from .buffers import available_host_bytes, preflight
from .params import ParamTracker, StepCounts


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return False
    return isinstance(t, DTensor)


def local_ranks() -> int:
    """Processes of this job on this host (torchrun's LOCAL_WORLD_SIZE; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _distributed():
    """torch.distributed, when a process group of more than one rank is initialized; else None."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


class DirectBinding:
    """The parameters are aliases of the flat buffers (one process, or each rank of DDP).

    Under torch.distributed (DDP: every rank holds the whole optimizer state) the ranks on this
    host share its memory and cores: the preflight counts every local rank's arena, and the CPU
    lane's threads default to this host's cores divided by its ranks. Finding the ranks on this
    host is a collective (an all-gather of host names, and one of the arena sizes in `preflight`):
    every rank of the default process group constructs its optimizer, as every rank constructs
    its DistributedDataParallel."""

    sharded = False

    def __init__(self):
        self._dist = _distributed()
        self._host = socket.gethostname()
        self._peers = [self._host]
        if self._dist is not None:
            self._peers = [None] * self._dist.get_world_size()
            self._dist.all_gather_object(self._peers, self._host)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The elements of `t` this process holds (all of them)."""
        return t

    def like(self, p: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Elements `flat` of parameter p's state, shaped as the parameter."""
        return flat.view(p.shape)

    def local_of(self, p: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The elements of a loaded state tensor of parameter p that this process holds."""
        return state

    def local_ranks(self) -> int:
        return max(local_ranks(), self._peers.count(self._host))

    def preflight(self, nbytes: int, n_params: int, limit_gib: Optional[float]) -> None:
        """Every rank on this host needs its arena: the sum must fit. Each rank measures what is
        available before any allocates (the all-gather is the barrier)."""
        if limit_gib is not None:
            avail = (int(limit_gib * 2**30), "host_memory_limit_gib, for the host")
        else:
            avail = available_host_bytes()
        mine = (self._host, nbytes, n_params, avail)
        peers = [mine]
        if self._dist is not None:
            peers = [None] * self._dist.get_world_size()
            self._dist.all_gather_object(peers, mine)
        here = [x for x in peers if x[0] == self._host]
        preflight(sum(x[1] for x in here), sum(x[2] for x in here), ranks=len(here),
                  avail=min((x[3] for x in here), key=lambda a: a[0]))

    def adopt(self, opt, params, dev) -> None:
        """Move the parameters into the flat buffers (each p.data an alias of its range) and seed
        the fp32 master weights."""
        self.track = ParamTracker(opt.layout, params, dev, opt._host)
        for slot, p in params.items():
            self.track.adopt(slot, p, dev.params[slot.bucket][slot.offset: slot.offset + slot.numel])
        opt._seed_master()

    def hooked(self, params: Dict) -> Dict:
        """The parameters whose gradients the GradRouter routes during backward."""
        return params

    def attach(self, grads, lanes) -> None:
        self.track.attach(grads, lanes)

    def before_update(self, groups, cpu_lane) -> None:
        """Adopt what clients changed since backward (dos.params)."""
        self.track.before_step(groups, cpu_lane)

    def after_update(self) -> None:
        self.track.after_step()

    def total_norm(self, norms: torch.Tensor) -> torch.Tensor:
        """The global L2 norm from the per-bucket norms of this process."""
        return torch.linalg.vector_norm(norms)

    def zero_grad(self, groups, set_to_none: bool) -> None:
        """torch's semantics: None (the next backward's hook adopts the new gradient) or zeroed."""
        self.track.zero_grad(groups, set_to_none)


class ShardBinding(DirectBinding):
    """DTensor parameters (FSDP2): copy the local gradient shards in, the weights out."""

    sharded = True

    def __init__(self, params: List[torch.Tensor]):
        super().__init__()
        mesh, dims = None, None
        for p in params:
            d = tuple(i for i, pl in enumerate(p.placements) if pl.is_shard())
            if any(pl.is_partial() for pl in p.placements):
                raise ValueError("dos.DeepOptimizerStates: a DTensor parameter with a Partial "
                                 "placement has no local state to own")
            if mesh is None:
                mesh, dims = p.device_mesh, d
            elif p.device_mesh != mesh or d != dims:
                raise NotImplementedError(
                    "dos.DeepOptimizerStates needs every DTensor parameter on one device mesh, "
                    f"sharded on the same mesh dimensions (got {dims} and {d}, or two meshes)")
        self.mesh = mesh
        # Clipping sums the squared norms over the ranks that hold different shards.
        # (none where every rank holds the whole parameter: replicated)
        self._groups = [mesh.get_group(i) for i in dims]
        self._params: Dict = {}
        self._dev = None

    def local(self, t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if _is_dtensor(t) else t

    def like(self, p: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """A DTensor sharded as p over `flat` (no copy, wherever `flat` lives: a host-memory
        state stays in host memory)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        spec = DTensorSpec(p.device_mesh, p.placements,
                           tensor_meta=TensorMeta(p.shape, p.stride(), flat.dtype))
        return DTensor(flat.view(p.to_local().shape), spec, requires_grad=False)

    def local_of(self, p: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """A DTensor is resharded as p if needed (a collective); a whole tensor is sliced."""
        if _is_dtensor(state):
            if state.device_mesh != p.device_mesh or state.placements != p.placements:
                state = state.redistribute(p.device_mesh, p.placements)
            return state.to_local()
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return state.reshape(p.shape)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]

    def adopt(self, opt, params, dev) -> None:
        self._params, self._dev = params, dev
        with torch.no_grad():
            for slot, p in params.items():
                dev.params[slot.bucket][slot.offset: slot.offset + slot.numel].copy_(
                    self.local(p).reshape(-1))
        opt._seed_master()
        self.track = StepCounts(opt.layout, params)

    def attach(self, grads, lanes) -> None:
        lanes.segments = self.track.segments

    def hooked(self, params: Dict) -> Dict:
        return {}  # gradients are copied in at step(), not routed during backward

    def _flat(self, bufs, slot) -> torch.Tensor:
        return bufs[slot.bucket][slot.offset: slot.offset + slot.numel]

    def before_update(self, groups, cpu_lane) -> None:
        active = set()
        for slot, p in self._params.items():
            dst = self._flat(self._dev.grads, slot)
            if p.grad is None:
                dst.zero_()  # skipped; zero for the clipping norm
            else:
                dst.copy_(self.local(p.grad).reshape(-1))
                active.add(slot)
        self.track.begin(active)

    def after_update(self) -> None:
        for slot, p in self._params.items():
            self.local(p).view(-1).copy_(self._flat(self._dev.params, slot))
        self.track.after_step()

    def total_norm(self, norms: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        sq = norms.square().sum()
        for group in self._groups:
            dist.all_reduce(sq, group=group)
        return sq.sqrt()

    def zero_grad(self, groups, set_to_none: bool) -> None:
        # FSDP assigns (or accumulates into) the sharded gradients; dos's buffers are copies.
        for p in self._params.values():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


def make_binding(params: List[torch.Tensor], overlap_backward: bool = False) -> DirectBinding:
    """The binding for these trainable parameters: all plain tensors, or all DTensors."""
    kinds = {_is_dtensor(p) for p in params}
    if kinds != {True}:
        if True in kinds:
            raise ValueError("dos.DeepOptimizerStates got DTensor and plain parameters together; "
                             "shard the whole model with fully_shard (or none of it)")
        return DirectBinding()
    if overlap_backward:
        raise NotImplementedError("overlap_backward=True is not supported with DTensor (FSDP2) "
                                  "parameters: their gradients are copied in at step()")
    return ShardBinding(params)
