"""Memory: the exact-size pinned host arena, its preflight, and the device-side buffers.

Host arena: one anonymous mapping, cut into one page-aligned *block* per host-backed subgroup:
    [ state: master fp32 | exp_avg | exp_avg_sq (| int8 scales) | gradient/weights in the param dtype ]
The state's bytes (dos/state_format.py: 12 B/element in fp32, 8 with bf16 moments, ~6 with int8)
move to and from a GPU staging slot in one copy each way; the last part
receives the gradient during backward and, once the CPU has consumed it, the updated weights that
go back to the GPU. Each block is page-locked on its own (cudaHostRegister, in parallel threads):
no power-of-two rounding as in PyTorch's pinned allocator, no per-tensor pinning.
"""
from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import pages, state_kernels
from .partition import Layout
from .plan import RESIDENT
from .state_format import StateFormat, scratch_numel, set_master_

PAGE = 4096


class HostMemoryError(RuntimeError):
    """The projected host memory does not fit this machine (raised before anything is allocated)."""


@dataclass(frozen=True)
class Block:
    """Where one subgroup's host state lives in the arena (bytes)."""

    offset: int
    numel: int
    grad_offset: int  # from `offset`
    nbytes: int  # page multiple


def _page(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def ring_slot_bytes(layout: Layout, itemsize: Sequence[int]) -> int:
    """PURE: bytes of one gradient-ring slot: the largest subgroup's gradient, page-rounded."""
    return _page(max((itemsize[s.bucket] * s.numel for s in layout.subgroups), default=0))


def arena_blocks(layout: Layout, lanes: Sequence[str], itemsize: Sequence[int],
                 fmt: StateFormat = StateFormat("fp32"), grad_ring: Optional[int] = None
                 ) -> Tuple[Dict[int, Block], int]:
    """PURE: blocks of the host-backed subgroups and the arena's size in bytes.

    `itemsize[b]` is the byte size of bucket b's param dtype (the host gradient's dtype); `fmt`
    the state's format (its bytes per subgroup). `grad_ring` K: the blocks hold the state only
    (grad_offset = its end, nothing there) and the arena ends in K ring slots (`ring_slot_bytes`).
    """
    blocks, off = {}, 0
    for s in layout.subgroups:
        if lanes[s.index] == RESIDENT:
            continue
        if grad_ring:
            g_off = fmt.nbytes(s.numel)
            nbytes = _page(g_off)
        else:
            g_off = (fmt.nbytes(s.numel) + 63) // 64 * 64
            nbytes = _page(g_off + itemsize[s.bucket] * s.numel)
        blocks[s.index] = Block(offset=off, numel=s.numel, grad_offset=g_off, nbytes=nbytes)
        off += nbytes
    if grad_ring:
        off += grad_ring * ring_slot_bytes(layout, itemsize)
    return blocks, off


class GradRing:
    """The host gradients of the CPU-lane subgroups in K shared slots (`EngineConfig.grad_ring`).

    `host.grad[s]` is subgroup s's view into the slot this step assigned it (`assign`: the CPU
    lane's order, slot j % K for its j-th subgroup). Invariant (dos.lanes, dos.grads): the j-th
    subgroup's gradient D2H is issued only after the (j-K)-th's weight upload out of the same
    slot was queued, and the copy stream waits for that upload (`free[k]`, its event)."""

    def __init__(self, slots: List[torch.Tensor], dtypes: Dict[int, torch.dtype], numels: Dict[int, int]):
        self.slots, self.dtypes, self.numels = slots, dict(dtypes), dict(numels)
        self.slot_of: Dict[int, int] = {}
        self.free: List = [None] * len(slots)  # event: the slot's last weight upload (None: none)

    @property
    def k(self) -> int:
        return len(self.slots)

    def assign(self, order: Sequence[int]) -> None:
        self.slot_of = {s: j % self.k for j, s in enumerate(order)}

    def __getitem__(self, s: int) -> torch.Tensor:
        if s not in self.slot_of:
            raise KeyError(f"subgroup {s} has no gradient-ring slot this step")
        d = self.dtypes[s]
        return self.slots[self.slot_of[s]][: d.itemsize * self.numels[s]].view(d)

    def __delitem__(self, s: int) -> None:
        self.dtypes.pop(s, None)
        self.numels.pop(s, None)

    def clear(self) -> None:
        self.dtypes.clear()
        self.numels.clear()
        self.slot_of = {}


def available_host_bytes() -> Tuple[int, str]:
    """Host memory this process may still take, and where the number comes from.

    DOS_HOST_MEMORY_GIB overrides (on machines whose MemTotal grows as memory is used)."""
    env = os.environ.get("DOS_HOST_MEMORY_GIB")
    if env:
        return int(float(env) * 2**30), "DOS_HOST_MEMORY_GIB"
    avail, src = None, "MemAvailable"
    try:
        with open("/proc/meminfo") as f:
            info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
        avail = info.get("MemAvailable", info.get("MemFree"))
    except OSError:
        pass
    try:  # cgroup v2 limit
        with open("/sys/fs/cgroup/memory.max") as f:
            lim = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            cur = int(f.read().strip())
        if lim != "max" and (avail is None or int(lim) - cur < avail):
            avail, src = int(lim) - cur, "cgroup memory.max"
    except (OSError, ValueError):
        pass
    if avail is None:
        import psutil

        avail, src = psutil.virtual_memory().available, "psutil"
    return avail, src


def preflight(required: int, n_params: int, limit_gib: Optional[float] = None, *, ranks: int = 1,
              avail: Optional[Tuple[int, str]] = None) -> None:
    """Raise HostMemoryError, with the numbers, if `required` bytes will not fit. `ranks`: the
    processes on this host that `required` and `n_params` add up (each needs its arena);
    `avail`: (bytes, where the number comes from) measured by the caller."""
    if avail is not None:
        avail, src = avail
    elif limit_gib is not None:
        avail, src = int(limit_gib * 2**30), "host_memory_limit_gib"
    else:
        avail, src = available_host_bytes()
    if required > avail:
        who = f" on {ranks} ranks of this host" if ranks > 1 else ""
        raise HostMemoryError(
            f"dos needs {required / 2**30:.2f} GiB of host memory for the optimizer state of "
            f"{n_params:,} parameters{who} ({required / max(1, n_params):.2f} B/param), but only "
            f"{avail / 2**30:.2f} GiB is available ({src}). Keep more state on the GPU "
            f"(gpu_fraction / placement='gpu'), or set DOS_HOST_MEMORY_GIB if the machine "
            f"reports too little.")


def _cudart():
    return torch.cuda.cudart()


class HostArena:
    """The host side of the optimizer state: one exact-size mapping, one block per subgroup."""

    def __init__(self, blocks: Dict[int, Block], nbytes: int, dtypes: Dict[int, torch.dtype], pin: bool,
                 fmt: StateFormat = StateFormat("fp32"), ring: Optional[int] = None):
        self.nbytes = nbytes
        self.blocks = blocks
        self.fmt = fmt
        # the gradient ring's `ring` slots: the arena's bytes after the blocks (arena_blocks)
        end = sum(b.nbytes for b in blocks.values())
        ring_slot = (nbytes - end) // ring if ring else 0
        self._ring_span = (end, nbytes - end) if ring else None
        self._map = mmap.mmap(-1, max(nbytes, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults and faster pinning
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._registered: List[int] = []
        self.pin_record: Optional[dict] = None  # pin(): bytes, prefault, prefault_s, register_s
        if pin and blocks:
            self.pin()
        self.state: Dict[int, torch.Tensor] = {}  # uint8, fmt.nbytes(n): fmt.views(state, n)
        self._views: Dict[int, object] = {}  # views(s), made once: the blocks never move
        self.grad = {}  # param dtype, n: a slot per subgroup, or the GradRing
        self.ring: Optional[GradRing] = None
        for s, b in blocks.items():
            self.state[s] = self.bytes[b.offset: b.offset + fmt.nbytes(b.numel)]
            if not ring:
                g = self.bytes[b.offset + b.grad_offset:]
                self.grad[s] = g[: dtypes[s].itemsize * b.numel].view(dtypes[s])
        if ring:
            off = self._ring_span[0]
            self.ring = self.grad = GradRing(
                [self.bytes[off + k * ring_slot: off + (k + 1) * ring_slot] for k in range(ring)],
                {s: dtypes[s] for s in blocks}, {s: b.numel for s, b in blocks.items()})

    def views(self, s: int):
        """fmt.views of subgroup s's block, made on first use (the CPU lane's update takes them
        for every subgroup of every step: ~40 us of slicing each, with the workers idle)."""
        v = self._views.get(s)
        if v is None:
            v = self._views[s] = self.fmt.views(self.state[s], self.blocks[s].numel)
        return v

    def pin(self, prefault: Optional[str] = "env") -> None:
        """Page-lock every block (in parallel threads), after faulting their pages in, also in
        parallel (`prefault`: "touch", "madvise" or None, dos/pages.py; registration would
        otherwise fault them in under the driver's global lock; "env": DOS_PIN_PREFAULT, default
        "touch", "none" for None). Called before anything else reads or writes the blocks
        (construction; resident-first sizing, dos.residency, pins only the blocks left once the
        resident share is known). How long each part took: `pin_record`."""
        if prefault == "env":
            prefault = os.environ.get("DOS_PIN_PREFAULT", "touch")
            prefault = None if prefault == "none" else prefault
        if prefault not in ("touch", "madvise", None):
            raise ValueError(f"prefault (DOS_PIN_PREFAULT) must be touch, madvise or none, got {prefault!r}")
        base = self.bytes.data_ptr()
        cudart = _cudart()
        t0 = time.perf_counter()

        def register(span: Tuple[int, int]) -> int:
            offset, nbytes = span
            err = cudart.cudaHostRegister(base + offset, nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with error {err}")
            return base + offset

        spans = [(b.offset, b.nbytes) for b in self.blocks.values()]
        if self._ring_span and self._ring_span[1]:
            spans.append(self._ring_span)
        if prefault == "touch":
            for o, n in pages.runs(spans):
                pages.touch(self.bytes[o: o + n])
        prefaulted = prefault == "touch" or (prefault == "madvise" and pages.populate([(base + o, n) for o, n in spans]))
        t1 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            self._registered = list(pool.map(register, spans))
        self.pin_record = {"bytes": sum(n for _, n in spans), "prefault": prefault, "prefaulted": bool(prefaulted),
                           "prefault_s": round(t1 - t0, 3), "register_s": round(time.perf_counter() - t1, 3)}

    def release(self, s: int) -> None:
        """Give subgroup s's block back to the OS (its state now lives on the GPU). The caller
        makes sure no copy still reads or writes the block."""
        b = self.blocks.pop(s)
        del self.state[s], self.grad[s]
        self._views.pop(s, None)
        ptr = self.bytes.data_ptr() + b.offset
        if ptr in self._registered:
            _cudart().cudaHostUnregister(ptr)
            self._registered.remove(ptr)
        self._map.madvise(mmap.MADV_DONTNEED, b.offset, b.nbytes)
        self.nbytes -= b.nbytes

    def close(self) -> None:
        """Unpin every block and give all the memory back to the OS now (not when a garbage
        collection frees the mapping: until then a new optimizer's preflight would count it)."""
        if self._registered:
            cudart = _cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered = []
        if self.blocks:
            self._map.madvise(mmap.MADV_DONTNEED)
            for d in (self.blocks, self.state, self.grad):  # in place: holders of these dicts see it
                d.clear()
            self.nbytes = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class DeviceBuffers:
    """The accelerator side: flat params and grads per bucket, resident state, staging slots."""

    def __init__(self, layout: Layout, lanes: Sequence[str], dtypes: Sequence[torch.dtype],
                 device: torch.device, n_slots: int, fmt: StateFormat = StateFormat("fp32")):
        self.fmt = fmt
        self.params = [torch.zeros(b.numel, dtype=dtypes[b.index], device=device) for b in layout.buckets]
        self._grad_shapes = [(b.numel, dtypes[b.index]) for b in layout.buckets]
        self.grads: List[torch.Tensor] = []  # alloc_grads
        # state bytes (fmt.views), zero: moments 0 (int8: scales 0 decode to 0)
        self.resident: Dict[int, torch.Tensor] = {
            s.index: torch.zeros(fmt.nbytes(s.numel), dtype=torch.uint8, device=device)
            for s in layout.subgroups if lanes[s.index] == RESIDENT}
        n = layout.subgroup_numel
        self.slots = [torch.empty(fmt.nbytes(n), dtype=torch.uint8, device=device) for _ in range(n_slots)]
        # Widening a low-precision gradient, and decoding compressed moments, for any GPU update.
        self._low = any(d != torch.float32 for d in dtypes) or fmt.name != "fp32"
        self.scratch = torch.empty(0, dtype=torch.float32, device=device)
        if n_slots > 0 or self.resident:
            self._need_scratch(n)

    def alloc_grads(self) -> None:
        """The flat gradient buffers (zero). The engine allocates them only once the parameters
        live in the flat parameter buffers and the originals' memory went back to the device: the
        constructor's peak is then twice the weights, not three times (originals, flat weights,
        flat gradients). At 20B that transient was 114 GiB, the CUDA allocator's peak, which the
        first step's resident sizing (dos.planner.free_device_bytes) took for the iteration's
        (docs/DESIGN.md §10)."""
        if self.grads:
            return
        device = self.scratch.device
        if device.type == "cuda":  # the originals' blocks (cached by the allocator) back to the device
            torch.cuda.empty_cache()
        self.grads = [torch.zeros(n, dtype=d, device=device) for n, d in self._grad_shapes]

    def _need_scratch(self, n: int) -> None:
        # bf16/int8 state on a device that runs dos.state_kernels' fused kernels needs none (they
        # read the gradient in its dtype); the torch-op path allocates its own if it runs later
        # (DOS_NO_TRITON set after construction: adam.device_state_step_)
        fused = self.fmt.name != "fp32" and state_kernels.available(self.scratch)
        need = 0 if fused else scratch_numel(self.fmt, n)
        if self._low and self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=torch.float32, device=self.scratch.device)

    def add_resident(self, s: int, state: torch.Tensor, n: int) -> None:
        """Make subgroup s (n elements) resident: its state bytes (on the host) are copied to the
        device."""
        self.resident[s] = state.to(self.scratch.device, copy=True)
        self._need_scratch(n)

    def add_fresh_resident(self, layout: Layout, s: int) -> None:
        """Make subgroup s resident with a fresh state (before any update): zero moments, the
        master seeded from its weights on the device (resident-first: no host copy ever made)."""
        n = layout.subgroups[s].numel
        state = torch.zeros(self.fmt.nbytes(n), dtype=torch.uint8, device=self.scratch.device)
        set_master_(self.fmt, self.fmt.views(state, n), self.param(layout, s))
        self.resident[s] = state
        self._need_scratch(n)

    def keep_slots(self, n: int) -> None:
        """Keep the first n staging slots; the others' memory goes back to the allocator (which
        hands it to resident state of the same size)."""
        del self.slots[n:]

    @property
    def transient_bytes(self) -> int:
        """Bytes of the staging slots and the scratch: GPU memory a new plan may spend otherwise."""
        return sum(t.numel() * t.element_size() for t in self.slots + [self.scratch])

    def param(self, layout: Layout, s: int) -> torch.Tensor:
        sg = layout.subgroups[s]
        return self.params[sg.bucket][sg.start: sg.stop]

    def grad(self, layout: Layout, s: int) -> torch.Tensor:
        sg = layout.subgroups[s]
        return self.grads[sg.bucket][sg.start: sg.stop]
