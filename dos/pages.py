"""Prefaulting: a mapping's pages faulted in, in parallel, before they are page-locked.

`cudaHostRegister` takes the CUDA driver's global lock, and on memory not yet touched it also
faults every page in (the kernel zeroes each one) while holding it: the host arena's pinning ran
at ~5.8 GB/s however many threads called it (planner-wide-4b, 4.4 B parameters: 9.6-10.9 s of its
~17 s constructor, `buffers.py:pin` in the rows' init_profile, session 35). PyTorch's pinned
allocator does the same as here for the same reason (CachingHostAllocator: pre-fault the pages,
then register, "to minimize the cost for the cuda global lock"). Two ways:
- `touch(t)`: one byte of every page read and written back unchanged (`add_(0)` on a strided
  view, torch's intra-op threads); contents kept as long as nothing else writes the memory
  meanwhile (the arena's callers pin before anything else touches it). What PyTorch does too, so
  the default. 10-19 GB/s on this 2-core machine with transparent huge pages (fresh 0.5-4 GiB
  mappings; the first mapping of a process much slower).
- `populate(spans)`: `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+), contents kept whatever else
  runs, in parallel threads (ctypes releases the GIL); 0.6-17 GB/s on the same machine, by size and
  run. Where the kernel lacks it, it returns False and registration faults the pages itself.
Which is faster on the device is measured there (experiments/scripts/pin_cost.py, pin_gate.sh).
"""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Optional, Tuple

MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+): populate (prefault) page tables writable
CHUNK = 256 << 20  # bytes one thread faults in per call: a 61 GB arena is ~240 calls over 16 threads

PAGE = 4096
_madvise = None


def touch(t) -> None:
    """Fault in every page of the uint8 tensor `t` (page-aligned start): each page's first byte
    read and written back, in parallel. The caller makes sure nothing else writes `t` meanwhile."""
    t[::PAGE].add_(0)


def runs(spans: Iterable[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """PURE: (offset, nbytes) spans sorted and merged where one ends where the next starts: the
    arena's blocks are laid end to end, so one strided `touch` covers many (each call's threads
    split its elements; a block alone, ~170 K pages, kept ~5 of 16 busy). Gaps (released blocks)
    stay gaps."""
    out: List[Tuple[int, int]] = []
    for o, n in sorted(spans):
        if out and out[-1][0] + out[-1][1] == o:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((o, n))
    return out


def _libc_madvise():
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.madvise
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        f.restype = ctypes.c_int
        _madvise = f
    return _madvise


def chunks(spans: Iterable[Tuple[int, int]], size: int = CHUNK) -> List[Tuple[int, int]]:
    """PURE: (address, nbytes) spans cut into pieces of at most `size` bytes, in order."""
    out = []
    for addr, n in spans:
        for off in range(0, n, size):
            out.append((addr + off, min(size, n - off)))
    return out


def populate(spans: Iterable[Tuple[int, int]], threads: Optional[int] = None) -> bool:
    """Fault in every page of the (page-aligned address, nbytes) spans, writable, contents kept, in
    `threads` parallel threads (default: the CPUs this process may use, at most 16). True when
    every span was populated; False (nothing raised) where the kernel does not support it, so the
    caller's registration faults the pages in itself."""
    if not hasattr(os, "sched_getaffinity") or os.uname().sysname != "Linux":
        return False
    pieces = chunks(spans)
    if not pieces:
        return True
    madvise = _libc_madvise()

    def one(piece: Tuple[int, int]) -> int:
        addr, n = piece
        return 0 if madvise(addr, n, MADV_POPULATE_WRITE) == 0 else ctypes.get_errno()

    n = threads or min(16, len(os.sched_getaffinity(0)))
    first = one(pieces[0])  # EINVAL: no MADV_POPULATE_WRITE in this kernel; try no further
    if first:
        return False
    with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
        return not any(pool.map(one, pieces[1:]))
