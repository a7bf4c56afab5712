"""Store the recorded trace files (`samples.csv`, `lanes.json`) of every run under
experiments/results gzip-compressed, as runs record them since 2026-12-02 (dos.lab.bench.records).

They were 56 of the 67 MiB of tracked files, over the 64 MiB a device call may carry with the
DeepSpeed wheels (docs/DESIGN.md decision log, 2026-12-02). Rows are not touched: a row naming
`<name>` is read from `<name>.gz` (`records.stored`). Each file is written with mtime 0 and no name
in its header, read back, and removed only when `gunzip` gives its bytes exactly. Idempotent.

    python tools/compress_traces.py [ROOT]    # default: experiments/results
"""
from __future__ import annotations

import gzip
import sys
from pathlib import Path

from dos.lab.bench import records

NAMES = ("samples.csv", "lanes.json")


def compress(path: Path) -> int:
    """`path` -> `path`.gz (reproducible bytes), verified, then `path` removed; bytes saved."""
    data = path.read_bytes()
    gz = path.with_name(path.name + ".gz")
    with open(gz, "wb") as raw, gzip.GzipFile(mode="wb", fileobj=raw, **records.GZIP_KW) as z:
        z.write(data)
    if gzip.decompress(gz.read_bytes()) != data:
        gz.unlink()
        raise RuntimeError(f"{gz}: does not decompress to {path}'s bytes; {path} kept")
    path.unlink()
    return len(data) - gz.stat().st_size


def main(argv=None) -> int:
    root = Path((argv or sys.argv[1:] or ["experiments/results"])[0])
    files = sorted(p for name in NAMES for p in root.glob(f"**/{name}"))
    saved = sum(compress(p) for p in files)
    print(f"{len(files)} trace files compressed under {root}, {saved / 2**20:.1f} MiB saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
