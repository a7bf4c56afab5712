"""How long the host arena's page-locking takes with and without faulting its pages in first
(dos/pages.py): fresh `HostArena`s of one size, `pin(prefault=...)` with "touch", "madvise" and
None in turn (rotating: none always first), each in a new mapping.

    python experiments/scripts/pin_cost.py OUT.csv [--gib G] [--reps R] [--block-mib B]

Rows (one per arena) append to OUT.csv with $BATCH_ID, the GPU UUID and the boot id: the bytes,
the prefault way, whether it prefaulted, prefault_s / register_s (HostArena.pin_record).
"""
import argparse, os, sys, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from dos.buffers import Block, HostArena  # noqa: E402
from dos.lab.bench.records import append_script_rows, batch_columns  # noqa: E402


def arena(gib: float, block_mib: int) -> HostArena:
    bsz = block_mib << 20
    n = int(gib * 2**30) // bsz
    blocks = {s: Block(offset=s * bsz, numel=bsz // 16, grad_offset=bsz - bsz // 8, nbytes=bsz) for s in range(n)}
    return HostArena(blocks, n * bsz, {s: torch.bfloat16 for s in blocks}, pin=False)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-mib", type=int, default=700)  # a 50 M-element fp32 subgroup's block: ~700 MB
    a = ap.parse_args(argv)
    torch.cuda.init()
    base, rows = batch_columns(), []
    for r in range(a.reps):
        ways = ["touch", "madvise", None]
        for way in ways[r % 3:] + ways[: r % 3]:  # none always first
            h = arena(a.gib, a.block_mib)
            t = time.perf_counter()
            h.pin(prefault=way)
            wall = time.perf_counter() - t
            rows.append({**base, "rep": r, **h.pin_record, "pin_s": round(wall, 3),
                         "gb_per_s": round(h.pin_record["bytes"] / wall / 1e9, 2)})
            print(rows[-1], flush=True)
            h.close()
            del h
    append_script_rows(a.out, rows)


if __name__ == "__main__":
    main()
