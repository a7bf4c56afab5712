"""py-cpuinfo's answer, asked once per machine boot for all of a sweep's DeepSpeed runs.

Why: DeepSpeed 0.19.8 calls `cpuinfo.get_cpu_info()` three times in each run's init
(DeepSpeedCPUAdam, and its op builder's `cpu_arch` and `simd_width` when it loads cpu_adam); each
call probes the CPU in a subprocess: 1.2 s here, ~4.5 s of a DeepSpeed run's ~20 s init on the
H200 host (session 17, `init_profile`), 18 DeepSpeed runs in a headline batch. The CPU does not
change while the host runs: the first answer is kept in memory and in a file named by the boot id,
so that later runs of the sweep (separate processes) read it. Only init time changes (not recorded
as iteration time); what DeepSpeed is told about the CPU is the same.
The one cache for every way a run starts: the sweep's fork server fills it before its first fork
(`dos.lab.zygote._cache_cpuinfo`; its own in-memory copy since session 18, so forked runs had
stopped probing before this module), runs by exec and torchrun's ranks read the boot's file.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

from .records import boot_id


def cache_path() -> Path:
    return Path(tempfile.gettempdir()) / f"dos-cpuinfo-{boot_id() or 'noboot'}.json"


def install(path: Optional[Path] = None) -> bool:
    """Make `cpuinfo.get_cpu_info` answer from the cache (filled by its first call). Returns whether
    py-cpuinfo is there to patch. Idempotent."""
    try:
        import cpuinfo
    except ImportError:
        return False
    if getattr(cpuinfo.get_cpu_info, "_dos_cached", False):
        return True
    probe, where, kept = cpuinfo.get_cpu_info, Path(path or cache_path()), {}

    def get_cpu_info():
        if "info" not in kept:
            try:
                kept["info"] = json.loads(where.read_text())
            except (OSError, ValueError):
                kept["info"] = probe()
                tmp = where.with_suffix(f".{os.getpid()}.tmp")
                try:  # atomic: a concurrent reader sees the whole file or none
                    tmp.write_text(json.dumps(kept["info"]))
                    os.replace(tmp, where)
                except OSError:
                    pass
        return dict(kept["info"])  # a copy: callers may edit theirs

    get_cpu_info._dos_cached = True
    cpuinfo.get_cpu_info = get_cpu_info
    return True
