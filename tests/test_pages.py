"""dos/pages.py: faulting the host arena's pages in before they are page-locked (and HostArena.pin
with a stand-in for the CUDA runtime, which this machine lacks)."""
import ctypes
import errno
import mmap
import os

import pytest
import torch

from dos import buffers, pages
from dos.buffers import Block, HostArena

LINUX = os.uname().sysname == "Linux"


def _kernel():
    try:
        return tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    except ValueError:
        return (0, 0)


# MADV_POPULATE_WRITE came with Linux 5.14; on an older kernel populate says False (tested below)
POPULATES = LINUX and _kernel() >= (5, 14)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_runs_merge_blocks_laid_end_to_end_and_keep_gaps():
    assert pages.runs([(8192, 4096), (0, 4096), (4096, 4096), (20480, 4096), (12288, 0)]) == [
        (0, 12288), (20480, 4096)]
    assert pages.runs([]) == []


def test_chunks_cover_each_span_in_order():
    assert pages.chunks([(0, 10), (100, 3)], size=4) == [(0, 4), (4, 4), (8, 2), (100, 3)]
    assert pages.chunks([(0, 8)], size=4) == [(0, 4), (4, 4)]
    assert pages.chunks([(5, 0)], size=4) == []


@pytest.mark.skipif(not POPULATES, reason="MADV_POPULATE_WRITE: Linux 5.14+")
def test_populate_faults_a_fresh_mapping_in():
    n = 256 << 20
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    before = rss_bytes()
    assert pages.populate([(base, n)], threads=2)
    assert rss_bytes() - before > 0.9 * n  # resident now, before anything wrote it
    del base
    m.close()


@pytest.mark.skipif(not POPULATES, reason="MADV_POPULATE_WRITE: Linux 5.14+")
def test_populate_keeps_what_the_pages_hold():
    n = 64 << 20
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t[: n // 2: 4096] = 7  # half the pages touched, with data
    t[12345] = 9
    want = t.clone()
    assert pages.populate([(t.data_ptr(), n)], threads=3)
    assert torch.equal(t, want)
    del t
    m.close()


def test_populate_says_false_where_the_kernel_lacks_it(monkeypatch):
    calls = []

    def einval(addr, n, advice):
        calls.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(pages, "_madvise", einval)
    m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    assert pages.populate(pages.chunks([(t.data_ptr(), 1 << 20)], size=1 << 18)) is False
    assert calls == [pages.MADV_POPULATE_WRITE]  # the first refusal ends it
    del t
    m.close()


class FakeCudart:
    """cudaHostRegister / Unregister that only record what they were given."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def cudaHostRegister(self, ptr, n, flags):
        self.registered.append((ptr, n))
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_touch_faults_pages_in_and_keeps_their_bytes():
    n = 64 << 20
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t[: n // 4] = 3
    t[4096 * 7] = 200
    before = rss_bytes()
    pages.touch(t)
    assert rss_bytes() - before > 0.6 * n  # the three quarters never written are resident now
    assert int(t[: n // 4].sum()) == 3 * (n // 4) - 3 + 200 and int(t[n // 4:].sum()) == 0
    del t
    m.close()


@pytest.mark.parametrize("prefault", ["touch", "madvise", None])
def test_pin_prefaults_then_registers_every_block(monkeypatch, prefault):
    fake = FakeCudart()
    monkeypatch.setattr(buffers, "_cudart", lambda: fake)
    seen = {"touch": [], "madvise": []}
    touch, populate = pages.touch, pages.populate
    monkeypatch.setattr(pages, "touch", lambda t: seen["touch"].append((t.data_ptr(), t.numel())) or touch(t))
    monkeypatch.setattr(pages, "populate", lambda spans, **kw: seen["madvise"].append(list(spans)) or populate(spans, **kw))
    blocks = {0: Block(offset=0, numel=1000, grad_offset=12032, nbytes=16384),
              2: Block(offset=16384, numel=1000, grad_offset=12032, nbytes=16384)}
    arena = HostArena(blocks, 32768, {0: torch.bfloat16, 2: torch.bfloat16}, pin=False)
    arena.bytes[:] = 5
    arena.pin(prefault=prefault)
    base = arena.bytes.data_ptr()
    spans = [(base, 16384), (base + 16384, 16384)]
    assert sorted(fake.registered) == spans
    assert seen == {"touch": [(base, 32768)] if prefault == "touch" else [],  # the two blocks: one run
                    "madvise": [spans] if prefault == "madvise" else []}
    rec = arena.pin_record
    assert rec["bytes"] == 32768 and rec["prefault"] == prefault
    assert rec["prefaulted"] is (prefault == "touch" or (prefault == "madvise" and POPULATES))
    assert rec["prefault_s"] >= 0 and rec["register_s"] >= 0
    assert bool((arena.bytes == 5).all())  # nothing written over the state
    arena.close()
    assert sorted(fake.unregistered) == [base, base + 16384]


def test_pin_rejects_an_unknown_prefault(monkeypatch):
    monkeypatch.setattr(buffers, "_cudart", FakeCudart)
    arena = HostArena({0: Block(offset=0, numel=10, grad_offset=64, nbytes=4096)}, 4096,
                      {0: torch.bfloat16}, pin=False)
    with pytest.raises(ValueError, match="prefault"):
        arena.pin(prefault="yes")


@pytest.mark.parametrize("env,way", [(None, "touch"), ("touch", "touch"), ("madvise", "madvise"), ("none", None)])
def test_pin_takes_its_default_from_the_environment(monkeypatch, env, way):
    monkeypatch.setattr(buffers, "_cudart", FakeCudart)
    if env is None:
        monkeypatch.delenv("DOS_PIN_PREFAULT", raising=False)
    else:
        monkeypatch.setenv("DOS_PIN_PREFAULT", env)
    arena = HostArena({0: Block(offset=0, numel=10, grad_offset=64, nbytes=4096)}, 4096,
                      {0: torch.bfloat16}, pin=True)  # the engine's way: pin() with no argument
    assert arena.pin_record["prefault"] == way
    monkeypatch.setenv("DOS_PIN_PREFAULT", "always")
    with pytest.raises(ValueError, match="DOS_PIN_PREFAULT"):
        arena.pin()


def test_pin_touches_no_released_block(monkeypatch):
    """A released block (resident-first sizing gives it back before pinning) is a gap: touching it
    would take its memory back from the OS."""
    monkeypatch.setattr(buffers, "_cudart", FakeCudart)
    seen = []
    touch = pages.touch
    monkeypatch.setattr(pages, "touch", lambda t: seen.append((t.data_ptr(), t.numel())) or touch(t))
    blocks = {s: Block(offset=s * 4096, numel=10, grad_offset=64, nbytes=4096) for s in range(3)}
    arena = HostArena(blocks, 3 * 4096, {s: torch.bfloat16 for s in blocks}, pin=False)
    arena.release(1)
    arena.pin(prefault="touch")
    base = arena.bytes.data_ptr()
    assert seen == [(base, 4096), (base + 8192, 4096)]
