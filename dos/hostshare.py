"""The ranks of one host share it: its DRAM, its PCIe root ports, its cores (FSDP2 or DDP under
torchrun, one process per GPU; docs/DESIGN.md §3.4).

- `Peers`: this process's view of the job's ranks on its host (found by an all-gather of host
  names), a barrier that starts every measured point of a calibration on all of them together,
  and an all-gather of each rank's result. `Peers.solo()` is one process alone: no collective.
- `combine`: the per-rank profiles measured concurrently -> the host's profile for that many
  local ranks (each rate the slowest rank's: the job's collectives wait for it; every rank's own
  rates kept in `per_rank`).
- `derate`: a 1-rank profile scaled to N local ranks when no N-rank one was measured — N ranks
  with t threads each as one process with N t threads, its rate split N ways; copy and
  host-memory bandwidths divided by N (their host side is shared); the GPU's own rate kept.
"""
from __future__ import annotations

import dataclasses
import socket
from typing import Callable, List, Optional, Sequence

from .perfmodel import Calibration

RATES = ("cpu_rate", "cpu_rate_dma", "h2d_bw_cpu", "d2h_bw_cpu")  # one value per thread count
SCALARS = ("gpu_rate", "h2d_bw", "d2h_bw", "h2d_duplex_bw", "d2h_duplex_bw", "host_mem_bw")


class Peers:
    """The ranks of this job on this host. Constructing it is a collective over the default
    process group when one of several ranks is initialized (every rank must construct it)."""

    def __init__(self, dist=None):
        self._dist = dist
        self.rank, self.world, self.local = 0, 1, [0]
        if dist is not None:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            hosts: List[Optional[str]] = [None] * self.world
            dist.all_gather_object(hosts, socket.gethostname())
            self.local = [r for r, h in enumerate(hosts) if h == hosts[self.rank]]
        self.barriers = 0  # measured points started together (tests read it)

    @classmethod
    def solo(cls) -> "Peers":
        return cls(None)

    @classmethod
    def current(cls) -> "Peers":
        """The job's ranks when torch.distributed is initialized with more than one; else solo."""
        try:
            import torch.distributed as dist
        except ImportError:
            return cls.solo()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(dist)
        return cls.solo()

    @property
    def n(self) -> int:
        """Ranks on this host (1: alone)."""
        return len(self.local)

    @property
    def leader(self) -> bool:
        """The first rank on this host (it writes the host's profile)."""
        return self.rank == self.local[0]

    def barrier(self) -> None:
        """Before each measured point: every rank starts it together (no-op alone)."""
        if self._dist is not None:
            self._dist.barrier()
            self.barriers += 1

    def gather_local(self, obj) -> list:
        """`obj` of every rank on this host, in rank order (a collective over all ranks)."""
        if self._dist is None:
            return [obj]
        out: list = [None] * self.world
        self._dist.all_gather_object(out, obj)
        return [out[r] for r in self.local]


def _slowest(values: Sequence, pick: Callable = min):
    """Elementwise `pick` over the ranks' values (None if any rank lacks it)."""
    if any(v is None for v in values):
        return None
    if isinstance(values[0], (tuple, list)):
        return tuple(pick(xs) for xs in zip(*values))
    return pick(values)


def combine(profiles: Sequence[Calibration], ranks: Optional[Sequence[int]] = None) -> Calibration:
    """The host's profile from its local ranks' profiles, measured concurrently: every rate the
    slowest rank's (the step of a data-parallel job waits for it), the spread the widest, each
    rank's warnings prefixed with its rank, each rank's rates in `per_rank`."""
    if not profiles:
        raise ValueError("combine: no profiles")
    ranks = list(ranks) if ranks is not None else list(range(len(profiles)))
    first = profiles[0]
    if any(p.cpu_threads != first.cpu_threads for p in profiles):
        raise ValueError("combine: the ranks measured different thread counts "
                         f"{[p.cpu_threads for p in profiles]} (their CPU affinities differ)")
    kw = {name: _slowest([getattr(p, name) for p in profiles]) for name in RATES + SCALARS}
    kw["cpu_rate_spread"] = _slowest([p.cpu_rate_spread for p in profiles], max)
    kw["warnings"] = tuple(f"rank {r}: {w}" for r, p in zip(ranks, profiles) for w in p.warnings)
    kw["per_rank"] = tuple(
        {"rank": r, **{name: (list(v) if isinstance(v, tuple) else v)
                       for name in RATES + SCALARS for v in [getattr(p, name)]}}
        for r, p in zip(ranks, profiles))
    return dataclasses.replace(first, local_ranks=len(profiles), **kw)


def derate(calib: Calibration, local_ranks: int, cores: Optional[int] = None) -> Calibration:
    """A 1-rank profile as `local_ranks` ranks would each see it (source 'derated', with a
    warning saying so): at t threads per rank, the CPU rates of local_ranks x t threads divided
    by local_ranks (the cores and DRAM are shared); pinned-copy and host-memory bandwidths divided
    by local_ranks (the host side of PCIe and DRAM are shared); the GPU AdamW rate kept (a rank's
    own GPU). Thread counts: 1, 2, 4, ... up to the cores per rank (`cores`: the host's; default
    the profile's `host_cores`)."""
    n = local_ranks
    if n <= 1 or calib.local_ranks == n:
        return calib
    if calib.local_ranks != 1:
        raise ValueError(f"derate: only a 1-rank profile can be derated (got {calib.local_ranks} ranks)")
    from .calibrate import default_threads

    host = cores or calib.host_cores or calib.cpu_threads[-1]
    threads = tuple(default_threads(max(1, host // n)))
    kw = dict(cpu_rate=tuple(calib.cpu(n * t) / n for t in threads))
    if calib.cpu_rate_dma is not None:
        kw["cpu_rate_dma"] = tuple(calib.cpu(n * t, dma=True) / n for t in threads)
    if calib.h2d_bw_cpu is not None:
        kw["h2d_bw_cpu"] = tuple(calib.h2d_cpu(n * t) / n for t in threads)
    if calib.d2h_bw_cpu is not None:
        kw["d2h_bw_cpu"] = tuple(calib.d2h_cpu(n * t) / n for t in threads)
    for name in SCALARS[1:]:
        v = getattr(calib, name)
        kw[name] = v / n if v is not None else None
    note = (f"a 1-rank profile derated for {n} local ranks (CPU rates of {n}x the threads split {n} "
            f"ways, copy and host-memory bandwidths / {n}): measure them running together with "
            f"`torchrun --nproc-per-node {n} -m dos calibrate`")
    return dataclasses.replace(calib, cpu_threads=threads, cpu_rate_spread=None, local_ranks=n,
                               per_rank=None, source="derated", warnings=calib.warnings + (note,), **kw)
