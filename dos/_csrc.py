"""dos's one C++ extension (csrc/): built at first use, cached on disk, loaded as `torch.ops.dos.*`.

The library registers its ops with `TORCH_LIBRARY(dos, ...)` (csrc/binding.cpp):
`torch.ops.dos.adamw_` (the fused CPU AdamW), `torch.ops.dos.adamw_lowp_` (the same update over
bf16 or int8 optimizer state, dos/state_format.py) and `torch.ops.dos.cpu_isas()`.

Build: `torch.utils.cpp_extension.load` (needs a C++ compiler and ninja) into
`$DOS_CACHE_DIR` (default `$XDG_CACHE_HOME/dos`, else `~/.cache/dos`), one folder per torch version,
Python and hash of the sources and flags; a cached library is loaded directly, without ninja.
`DOS_NO_CSRC=1`, or a failed build, falls back to torch's fused CPU AdamW with one warning.
`DOS_CSRC_ISA=scalar|avx2|avx512` forces an instruction set (default: the best this CPU has).
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

ISAS = ("avx512", "avx2", "scalar")
SCHEDULES = ("dynamic", "static")
_CFLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
_SOURCES = ("adamw.cpp", "binding.cpp")
_log = logging.getLogger(__name__)


class CsrcFallbackWarning(UserWarning):
    """The C++ kernels are unavailable; torch's fused CPU AdamW runs instead."""


_lock = threading.Lock()
_state: dict = {"tried": False, "ops": None, "isa": None, "reason": None, "build_s": None,
               "schedule": None}


def source_dir() -> Path:
    """The copy packaged as dos/csrc (wheel install), else csrc/ of the source checkout."""
    here = Path(__file__).resolve().parent
    for d in (here / "csrc", here.parent / "csrc"):
        if (d / "binding.cpp").is_file():
            return d
    raise FileNotFoundError("dos: csrc sources not found (neither <repo>/csrc nor dos/csrc)")


def _build_key(src: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in src.iterdir() if p.suffix in (".cpp", ".h", ".inc")):
        h.update(f.name.encode() + f.read_bytes())
    h.update(" ".join(_CFLAGS + _LDFLAGS + [os.environ.get("CXX", "")]).encode())
    return h.hexdigest()[:12]


def cache_dir() -> Path:
    root = os.environ.get("DOS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dos")
    tag = f"torch{torch.__version__.replace('+', '_')}-{sys.implementation.cache_tag}"
    return Path(root) / tag


def _build_and_load() -> str:
    """Loads the cached library, building it first if needed; returns its path."""
    src = source_dir()
    key = _build_key(src)
    name = f"dos_csrc_{key}"
    build = cache_dir() / key
    lib = build / f"{name}.so"
    if lib.is_file():
        try:
            torch.ops.load_library(str(lib))
            return str(lib)
        except OSError as e:  # a partial file from a killed build: rebuild below
            _log.warning("dos: cached %s did not load (%s); rebuilding", lib, e)
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # one line while the first step waits (~10-20 s): a warning, shown without logging configured
    _log.warning("dos: compiling the CPU AdamW kernel (once per torch version, ~10-20 s) in %s", build)
    path = cpp_extension.load(name, [str(src / s) for s in _SOURCES], extra_cflags=_CFLAGS,
                              extra_ldflags=_LDFLAGS, build_directory=str(build),
                              is_python_module=False, verbose=False)
    _state["build_s"] = time.perf_counter() - t0
    return path


def _fallback(reason: str) -> None:
    _state["reason"] = reason
    warnings.warn(f"dos: C++ kernels unavailable ({reason}); using torch's fused CPU AdamW",
                  CsrcFallbackWarning, stacklevel=3)


def _reason(e: Exception) -> str:
    """One line: the compiler's first error if any, else the exception's last line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.startswith("Error building")]
    return f"{type(e).__name__}: {(errors or lines or [''])[0 if errors else -1]}"[:300]


def _register_fake() -> None:
    """Lets torch.compile / fake tensors trace through the in-place op."""
    for op in ("dos::adamw_", "dos::adamw_lowp_", "dos::adamw_split_"):
        try:
            torch.library.register_fake(op)(lambda *args, **kwargs: None)
        except Exception as e:  # older torch, or already registered: eager use is unaffected
            _log.debug("dos: register_fake(%s) skipped: %s", op, e)


def ops():
    """`torch.ops.dos` once the library is loaded; None (after one warning) when unavailable."""
    if _state["tried"]:
        return _state["ops"]
    with _lock:
        if not _state["tried"]:
            if os.environ.get("DOS_NO_CSRC", "0") not in ("", "0"):
                _fallback("DOS_NO_CSRC is set")
            else:
                try:
                    _state["path"] = _build_and_load()
                    supported = list(torch.ops.dos.cpu_isas())
                    _state["isa"] = pick_isa(os.environ.get("DOS_CSRC_ISA"), supported)
                    _apply_schedule(os.environ.get("DOS_CSRC_SCHEDULE") or "dynamic")
                    _register_fake()
                    _state["ops"] = torch.ops.dos
                except ValueError:  # a bad DOS_CSRC_ISA: an error at every call, not a fallback
                    raise
                except Exception as e:  # no compiler, no ninja, a failed build: fall back
                    _log.info("dos: csrc build/load failed", exc_info=True)
                    _fallback(_reason(e))
            _state["tried"] = True
    return _state["ops"]


def pick_isa(requested: Optional[str], supported: list[str]) -> str:
    """The ISA to run: `requested` (DOS_CSRC_ISA) if this CPU has it, else the best supported."""
    if not requested:
        return supported[0]
    if requested not in ISAS:
        raise ValueError(f"DOS_CSRC_ISA={requested!r}: expected one of {', '.join(ISAS)}")
    if requested not in supported:
        raise ValueError(f"DOS_CSRC_ISA={requested!r}: this CPU supports only {', '.join(supported)}")
    return requested


def isa() -> Optional[str]:
    """ISA `cpu_adamw_` runs (None when the extension is unavailable)."""
    return _state["isa"] if ops() is not None else None


def set_isa(name: Optional[str]) -> None:
    """Forces an ISA for this process (None: the best); for tests and benchmarks."""
    if ops() is None:
        raise RuntimeError("dos: the C++ extension is not loaded")
    _state["isa"] = pick_isa(name, list(torch.ops.dos.cpu_isas()))


def set_schedule(name: str) -> None:
    """How the kernel's threads share a call (DOS_CSRC_SCHEDULE): "dynamic" chunks (default) or
    "static", one fixed range per thread (the kernel before 2026-12-02, for in-situ A/B runs;
    docs/DESIGN.md §10). Results are bitwise the same."""
    if ops() is None:
        raise RuntimeError("dos: the C++ extension is not loaded")
    _apply_schedule(name)


def _apply_schedule(name: str) -> None:
    """set_schedule's work, also while `ops()` loads the library (its lock held)."""
    if name not in SCHEDULES:
        raise ValueError(f"DOS_CSRC_SCHEDULE={name!r}: expected one of {', '.join(SCHEDULES)}")
    torch.ops.dos.set_schedule(name)
    _state["schedule"] = name


def impl_name() -> str:
    """'dos-csrc-<isa>' ('-static' with fixed per-thread ranges) or 'torch-fused': recorded
    with every run."""
    if ops() is None:
        return "torch-fused"
    return f"dos-csrc-{isa()}" + ("-static" if _state.get("schedule") == "static" else "")


def info() -> dict:
    """What was loaded, from where, and why not: for run records."""
    ops()
    return {"impl": impl_name(), "path": _state.get("path"), "build_s": _state["build_s"],
            "fallback_reason": _state["reason"]}
