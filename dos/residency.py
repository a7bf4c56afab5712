"""Resident-first memory (DESIGN.md §3.7): with gpu_fraction="auto" the resident share is known
only after the first iteration (its peak GPU memory). Until then the host arena is reserved —
one anonymous mapping: virtual memory, no physical page — but neither written nor pinned, and the
first backward sends no gradient to it. `materialize` then gives the resident subgroups a fresh
state on the GPU (master from their weights, moments zero) and returns their host blocks unwritten,
checks the host memory the rest needs (the preflight, with both memories' numbers), pins it and
seeds its masters. So the host never holds the resident share, and a model whose whole state does
not fit the host trains when the GPU holds enough of it.
"""
from __future__ import annotations

import torch

from .buffers import HostMemoryError, preflight
from .state_format import set_master_, state_format


class Residency:
    def __init__(self, config, layout, device: torch.device, local_ranks: int, deferred: bool):
        self.config, self.layout, self.device, self.local_ranks = config, layout, device, local_ranks
        self.deferred = deferred
        self._pin = config.pin_memory and device.type == "cuda"

    def host_need_bound(self, blocks: dict) -> int:
        """At construction: the host bytes needed if the GPU memory free now (less the sizing's
        margin) held the first subgroups' state — a lower bound (the iteration's activations will
        take some of it); the whole arena where nothing is deferred or known."""
        if not self.deferred or self.device.type != "cuda":
            return sum(b.nbytes for b in blocks.values())
        free, total = torch.cuda.mem_get_info(self.device)
        room = free - max(2**30, 0.03 * total)  # the margin of dos.planner.free_device_bytes
        fmt = state_format(self.config.state_dtype)
        r, used = 0, 0
        for sg in self.layout.subgroups:
            if used + fmt.nbytes(sg.numel) > room:
                break
            used += fmt.nbytes(sg.numel)
            r += 1
        return sum(b.nbytes for s, b in blocks.items() if s >= r)

    def materialize(self, dev, host, grads, resident=()) -> None:
        """Make the state real: the `resident` subgroups on the GPU, the rest in the host arena
        (checked, pinned, masters seeded); backward sends gradients early from then on. Nothing
        once done, or when the arena was materialized at construction."""
        if not self.deferred:
            return
        self.deferred = False
        layout = self.layout
        for s in resident:
            dev.add_fresh_resident(layout, s)
            host.release(s)
        n_host = sum(layout.subgroups[s].numel for s in host.blocks)
        gpu = sum(t.numel() for t in dev.resident.values())
        ranks = self.local_ranks  # each rank of this host holds its own arena (DDP, FSDP2)
        try:
            preflight(host.nbytes * ranks, n_host * ranks, self.config.host_memory_limit_gib, ranks=ranks)
        except HostMemoryError as e:
            raise HostMemoryError(
                f"{e} (resident-first sizing, gpu_fraction='auto': {len(resident)} of "
                f"{len(layout.subgroups)} subgroups, {gpu / 2**30:.2f} GiB of state, fit the GPU "
                f"memory the first iteration left free; the other {host.nbytes / 2**30:.2f} GiB per "
                "rank need host memory)") from None
        if self._pin and host.blocks:
            host.pin()
        for s in host.blocks:
            set_master_(dev.fmt, dev.fmt.views(host.state[s], layout.subgroups[s].numel), dev.param(layout, s))
        grads.send_early = True
