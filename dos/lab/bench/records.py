"""Records (DESIGN.md §5): the row schema, atomic appends to runs.csv, and env.json.

`COLUMNS` only ever grows at its end, and a file keeps the header it was created with: a row
appended to a file with an older (shorter) header is a longer line whose further cells are the
`COLUMNS` beyond that header (`read_rows` names them so; the lines already there are never
rewritten), and an old row reads its missing columns as "". `runs.csv` is only ever appended to, one physical line per row, under an exclusive lock and with an
fsync, so a sweep killed at any instant leaves every finished row intact; a torn final line (a kill
inside the write) is not a row and is cut before the next append. A resumed sweep reads the run_ids
already there and appends only the missing ones.

A run's trace files (NVML samples, lane timelines) are the bulk of the records: they are stored
gzip-compressed (`<name>.gz`, written by `open_text_out` without a name or date in the header, so
the same trace gives the same bytes), and a reader finds a file a row names as `<name>` or
`<name>.gz` (`stored`; `read_text`). Rows recorded before 2026-12-02 name the uncompressed file;
its bytes are what `gunzip` of the `.gz` beside the row gives (`tools/compress_traces.py`, which
checks that before it removes the original).
"""
from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import fcntl
import gzip
import io
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Iterable, List, Optional

import psutil

COLUMNS = (
    # identity and outcome
    "run_id", "sweep", "timestamp", "git_sha", "status", "error",
    # configuration (DESIGN.md §5)
    "system", "placement", "stride", "gpu_fraction", "ratio", "model", "n_params", "seq_len",
    "micro_batch", "gpus", "device", "gpu_name", "gpu_mem_cap_gib", "host_mem_gib",
    # medians over measured steps
    "iter_s", "fwd_s", "bwd_s", "step_s", "tokens_per_s", "peak_gpu_gib", "peak_host_gib",
    "predicted_step_s", "loss_first", "loss_last",
    # extra
    "iter_s_min", "iter_s_max", "peak_gpu_reserved_gib", "peak_gpu_nvml_gib", "host_bytes_per_param",
    "cpu_impl", "warmup", "steps", "data", "dtype", "init_s", "wall_s", "nvml", "sample_hz",
    "plan", "config", "steps_file", "markers_file", "samples_file", "lanes_file", "log_file",
    # issue 16 (appended: older files have the 51 columns above): the optimizer state's precision,
    # the protocol (one batch_id per sweep process; the GPU and the boot of the host it ran on;
    # which repetition), and what a re-run replaces (run_ids, ';'-separated, and why)
    "state_dtype", "batch_id", "gpu_uuid", "boot_id", "repeat", "supersedes", "supersede_reason",
)
STATUSES = ("ok", "oom", "error", "skipped")
JSON_COLUMNS = ("plan", "config")


RECORDS_PATHSPEC = ":(exclude)experiments/results"
"""Records are data, not code: changes under experiments/results do not make the tree dirty (a
resumed sweep appends to a tracked runs.csv)."""


def boot_id() -> str:
    """This host's boot id (/proc/sys/kernel/random/boot_id: new at every boot); "" where absent."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def gpu_uuid(device=0) -> str:
    """The CUDA device's UUID as NVML and nvidia-smi write it ("GPU-..."); "" without one."""
    import torch

    if not torch.cuda.is_available():
        return ""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    return uuid if not uuid or uuid.startswith("GPU-") else "GPU-" + uuid


def batch_columns() -> dict:
    """The columns that place a measurement script's row in its batch (issue 16): when, the code,
    $BATCH_ID, the GPU and the host's boot."""
    return {"timestamp": now_iso(), "git_sha": git_sha(), "batch_id": os.environ.get("BATCH_ID", ""),
            "gpu_uuid": gpu_uuid(), "boot_id": boot_id()}


def append_script_rows(path, rows: List[dict]) -> None:
    """Append a measurement script's rows (dicts with the same keys, in order) to its CSV: the
    header when the file is new or empty; an existing header must match (records are appended
    to, never rewritten, so a script whose columns changed writes a new file)."""
    if not rows:
        raise ValueError("no rows to append")
    cols = list(rows[0])
    if any(list(r) != cols for r in rows):
        raise ValueError("every row must have the same columns, in the same order")
    path = Path(path)
    if path.exists() and path.stat().st_size:
        with open(path, newline="") as f:
            head = next(csv.reader(f), [])
        if head != cols:
            raise ValueError(f"{path} has columns {head}, these rows {cols}: write a new file")
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, cols)
        if f.tell() == 0:
            w.writeheader()
        w.writerows(rows)


def git_sha() -> str:
    """Commit of the working tree ('-dirty' when tracked files other than records have changes);
    DOS_GIT_SHA where there is no .git."""
    if os.environ.get("DOS_GIT_SHA"):
        return os.environ["DOS_GIT_SHA"]
    root = Path(__file__).resolve().parents[3]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                RECORDS_PATHSPEC], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, (dict, list)):
        v = json.dumps(v, sort_keys=True, separators=(",", ":"), default=str)
    elif isinstance(v, float):
        v = repr(round(v, 6)) if abs(v) >= 1e-3 or v == 0 else f"{v:.6g}"
    return str(v).replace("\r", " ").replace("\n", " | ")


def format_line(row: dict, columns: Iterable[str]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow([_cell(row.get(c)) for c in columns])
    return buf.getvalue()


def append_row(path, row: dict) -> None:
    """Append `row` as one line of `path` atomically (flock + O_APPEND + fsync).

    A new file gets the header. An existing file keeps its own header: one that is a prefix of
    `COLUMNS` (an older schema) gets the row in full, a longer line (see the module docstring);
    a file of another schema gets only the columns its header names.
    """
    unknown = set(row) - set(COLUMNS)
    if unknown:
        raise KeyError(f"row has columns outside the schema: {sorted(unknown)}")
    if row.get("status") not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {row.get('status')!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            columns = _repair_and_header(fd)
            if columns and _older_schema(columns):
                columns = list(COLUMNS)
            data = format_line(row, columns or COLUMNS)
            if not columns:
                data = format_line({c: c for c in COLUMNS}, COLUMNS) + data
            os.write(fd, data.encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def _repair_and_header(fd: int) -> Optional[List[str]]:
    """Cut a torn last line (no newline: the writer was killed mid-write); return the header."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    with open(fd, "rb", closefd=False) as f:
        f.seek(max(0, size - 1))
        if f.read(1) != b"\n":
            f.seek(0)
            data = f.read()
            os.ftruncate(fd, data.rfind(b"\n") + 1)
            if data.rfind(b"\n") < 0:
                return None
        f.seek(0)
        header = f.readline().decode()
    return next(csv.reader([header])) if header.strip() else None


def _older_schema(header) -> bool:
    """Whether a file's header is `COLUMNS` or a prefix of it (this schema, maybe older)."""
    return 0 < len(header) <= len(COLUMNS) and tuple(header) == COLUMNS[: len(header)]


def read_rows(path) -> List[dict]:
    """Rows of a runs.csv as dicts of strings ([] when it does not exist). In a file of this
    schema every row has every column of `COLUMNS` ("" where its line has no cell: a row written
    before the column existed); cells beyond the header are named by `COLUMNS`."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="") as f:
        text = f.read()
    if text and not text.endswith("\n"):  # torn line: not a row
        text = text[: text.rfind("\n") + 1]
    lines = csv.reader(io.StringIO(text))
    header = next(lines, None)
    if not header:
        return []
    names = list(COLUMNS) if _older_schema(header) else header
    out = []
    for cells in lines:
        if len(cells) > len(names):
            cells = cells[: len(names)]
        r = dict(zip(names, cells + [""] * (len(names) - len(cells))))
        if r.get("run_id"):
            out.append(r)
    return out


# ---------------------------------------------------------------- environment

def _version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> Optional[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _gpus() -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:
        return {"nvml": f"absent: {type(e).__name__}: {e}", "devices": []}
    try:
        out = {"nvml": "ok", "driver": pynvml.nvmlSystemGetDriverVersion(),
               "cuda_driver": pynvml.nvmlSystemGetCudaDriverVersion(), "devices": []}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out["devices"].append({"index": i, "name": pynvml.nvmlDeviceGetName(h),
                                   "memory_gib": pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30})
        return out
    finally:
        pynvml.nvmlShutdown()


def environment() -> dict:
    """Provenance of a sweep directory: versions, GPU, driver, CPU, host memory."""
    vm = psutil.virtual_memory()
    try:
        import torch

        torch_cuda = torch.version.cuda
    except ImportError:
        torch_cuda = None
    return {
        "timestamp": now_iso(), "git_sha": git_sha(), "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {n: _version(n) for n in ("dos", "torch", "transformers", "deepspeed", "torchao",
                                              "nvidia-ml-py", "numpy", "pandas")},
        "torch_cuda": torch_cuda,
        "gpu": _gpus(),
        "cpu": {"model": _cpu_model(), "logical_cores": psutil.cpu_count(),
                "physical_cores": psutil.cpu_count(logical=False),
                "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None},
        "host_memory": {"total_gib": vm.total / 2**30, "available_gib": vm.available / 2**30},
        "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "TORCH_CUDA_ARCH_LIST",
                                                "DS_ACCELERATOR", "OMP_NUM_THREADS", "DOS_HOST_MEMORY_GIB",
                                                "TORCH_EXTENSIONS_DIR")},
    }


def write_env(out_dir) -> Path:
    """Write `env.json` once per sweep directory (kept when it exists: the first run's environment)."""
    path = Path(out_dir) / "env.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(environment(), indent=1, default=str))
        os.replace(tmp, path)
    return path


# ---------------------------------------------------------------- trace files (gzip)

def stored(path) -> Optional[Path]:
    """Where the file a row names as `path` is stored: `path`, or `path` + ".gz" (a trace stored
    compressed); None when neither exists."""
    path = Path(path)
    if path.exists():
        return path
    gz = path.with_name(path.name + ".gz")
    return gz if gz.exists() else None


def read_text(path) -> str:
    """The text of a record file, `path` or its `.gz` (`stored`); FileNotFoundError when neither."""
    found = stored(path)
    if found is None:
        raise FileNotFoundError(f"{path} (nor {Path(path).name}.gz beside it)")
    if found.suffix == ".gz":
        with gzip.open(found, "rt") as f:  # universal newlines, as Path.read_text
            return f.read()
    return found.read_text()


GZIP_KW = dict(filename="", mtime=0, compresslevel=9)
"""A gzip member without a name or date in its header: the same bytes in, the same bytes out."""


@contextlib.contextmanager
def open_text_out(path):
    """`with open_text_out(path) as f`: a text file to write; gzip-compressed when `path` ends in
    .gz, with mtime 0 and no file name in the header (the same text gives the same bytes)."""
    path = Path(path)
    if path.suffix != ".gz":
        with open(path, "w", newline="") as f:
            yield f
        return
    with open(path, "wb") as raw:
        with gzip.GzipFile(mode="wb", fileobj=raw, **GZIP_KW) as z:
            with io.TextIOWrapper(z, encoding="utf-8", newline="") as f:
                yield f
