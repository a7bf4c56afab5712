"""One run, in its own process: `python -m dos.lab.bench.run SPEC.json RUN_DIR`.

Builds the model and the system, runs the timing protocol with the sampler on, and writes into
RUN_DIR: `result.json` (the row's measured fields; written last, atomically), `steps.csv` (per-step
phase times and loss), `markers.csv` (every phase, init included, on the sampler's clock),
`samples.csv.gz` (NVML + host RSS trace) and `lanes.json.gz` (dos per-subgroup lane timeline; both
gzip-compressed, `records.read_text`). A failure
still writes `result.json` with status `oom` or `error`, and whatever trace was gathered until then.
The sweep parent (dos.lab.sweep) turns it into a row; users call `python -m dos bench` instead.

gpus = N > 1: this process is the launcher. It starts `torch.distributed.run --standalone
--nproc_per_node N -m dos.lab.bench.run SPEC RUN_DIR` (OMP_NUM_THREADS = cores // N unless set),
samples the host RSS of the whole process tree meanwhile, and merges the ranks' results into the
one `result.json` (`merge_ranks`). Each rank (env DOS_BENCH_RANKS set) runs the same protocol on
its own device (cuda:LOCAL_RANK, or the CPU with gloo) and its own batches (seed + rank), writes
its artifacts into RUN_DIR (rank 0) or RUN_DIR/rank<r>, and its result into `rank_result.json`
there.
"""
from __future__ import annotations

import contextlib
import csv
import ctypes
import gc
import json
import os
import resource
import signal
import sys
import traceback
from pathlib import Path

_GIB = 2**30


def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _write_csv(path: Path, header, rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(exc).lower()
    return any(s in msg for s in ("out of memory", "can't allocate memory", "cannot allocate memory"))


def resolve_device(spec):
    import torch

    kind = spec.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        from dos.lab.bench.systems import SkipRun

        raise SkipRun("no CUDA device on this machine")
    if kind == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0")) if _world() > 1 else 0
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _world() -> int:
    """Ranks of this run: DOS_BENCH_RANKS in a rank started by the launcher, else 1."""
    return int(os.environ.get("DOS_BENCH_RANKS", "1"))


def _rank() -> int:
    return int(os.environ.get("RANK", "0")) if _world() > 1 else 0


def _gpu_facts(device, spec) -> dict:
    import torch

    if device.type != "cuda":
        return {"gpu_name": None}
    props = torch.cuda.get_device_properties(device)
    if spec.gpu_mem_cap_gib:
        frac = min(1.0, spec.gpu_mem_cap_gib * _GIB / props.total_memory)
        torch.cuda.set_per_process_memory_fraction(frac, device)
    torch.cuda.reset_peak_memory_stats(device)
    return {"gpu_name": props.name, "gpu_mem_total_gib": props.total_memory / _GIB}


def _peaks(device, sampler_summary) -> dict:
    import torch

    out = {"peak_gpu_gib": None, "peak_gpu_reserved_gib": None}
    if device is not None and device.type == "cuda":
        out["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
        out["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved(device) / _GIB
    self_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB  # KiB on Linux
    out["peak_host_gib"] = max(self_peak, sampler_summary.get("peak_host_sampled_gib") or 0.0)
    out["peak_gpu_nvml_gib"] = sampler_summary.get("peak_gpu_nvml_gib")
    return out


def execute(spec, run_dir: Path) -> dict:
    """Run `spec`; return the result dict (never raises for a failure of the run itself)."""
    return _Run(spec, run_dir).execute()


class _Run:
    """The state of one run, so that a failure at any point still records what was gathered."""

    def __init__(self, spec, run_dir: Path):
        from dos.lab.bench.timing import Clock

        self.spec, self.run_dir, self.clock = spec, run_dir, Clock()
        # started_by: "fork" / "fork:<flavour>" (dos.lab.zygote: imports done before the run's
        # clock) or "exec" (its init_s includes them)
        self.res = {"status": "ok", "error": None, "files": {},
                    "started_by": os.environ.get("DOS_STARTED_BY", "exec")}
        self.sampler = self.system = self.device = None
        self.times, self.lanes = [], []

    def execute(self) -> dict:
        try:
            self._setup()
            self._train()
        except BaseException as e:  # every failure becomes a row; KeyboardInterrupt too
            from dos.lab.bench.systems import SkipRun

            status = "skipped" if isinstance(e, SkipRun) else "oom" if is_oom(e) else "error"
            self.res.update(status=status, error=f"{type(e).__name__}: {e}"[:2000])
            traceback.print_exc()
            if isinstance(e, KeyboardInterrupt):
                raise
        finally:
            self._finish()
        return self.res

    def _setup(self) -> None:
        import torch

        from dos.lab.bench import systems
        from dos.lab.nvml import Sampler

        spec, res = self.spec, self.res
        self.device = device = resolve_device(spec)
        res["device"] = device.type
        systems.prepare_env(spec, device, int(os.environ.get("MASTER_PORT", "0")) or None)
        if spec.cpu_schedule:  # read when dos's extension loads (dos._csrc)
            os.environ["DOS_CSRC_SCHEDULE"] = spec.cpu_schedule
        if _world() > 1:
            res["rank"] = _rank()
            if not spec.system.startswith("deepspeed"):  # DeepSpeed initializes its own group
                import torch.distributed as dist

                dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        res.update(_gpu_facts(device, spec))
        gpu = {}
        if device.type == "cuda":  # NVML numbers GPUs ignoring CUDA_VISIBLE_DEVICES: match by UUID
            from dos.lab.bench.records import gpu_uuid

            gpu = {"gpu_index": torch.cuda.current_device(), "gpu_uuid": gpu_uuid(device) or None}
            res["gpu_uuid"] = gpu["gpu_uuid"]  # the row's gpu_uuid (issue 16: which physical GPU)
        self.sampler = Sampler(self.clock.t0, hz=spec.nvml_hz, **gpu)
        if device.type != "cuda":
            self.sampler.nvml_status = f"absent: device is {device.type}"
        self.sampler.start()

    def _train(self) -> None:
        import torch

        from dos.lab.bench import models, systems, timing

        spec, res, clock, device = self.spec, self.res, self.clock, self.device
        torch.manual_seed(spec.seed)
        p = models.preset(spec.model, spec.model_overrides)
        with clock.phase("import"):
            from transformers import LlamaForCausalLM  # noqa: F401  (heavy; kept out of init_model)
        with clock.phase("init_model"):
            dtype = torch.bfloat16 if spec.dtype == "bf16" else torch.float32
            model = models.build_model(p, device, spec.seq_len, dtype, spec.checkpointing)
        res["n_params"] = sum(t.numel() for t in model.parameters())
        res["model_record"] = models.model_record(p)
        with clock.phase("init_system"), _profiled(res, "init_profile"):
            self.system = system = systems.build(spec, model, device)
        res.update(system.describe())
        res["init_s"] = sum(e - s for _, _, s, e in clock.markers)  # only init phases so far
        res["host_pages"] = {"after_init": host_pages()}
        data, res["data_record"] = models.batches(spec.data, spec.warmup + spec.steps, spec.micro_batch,
                                                  spec.seq_len, p.vocab, spec.seed + _rank())
        # The imports' and init's objects become permanent for the cyclic GC: a full collection of
        # them (~0.2 s here with transformers loaded, ~0.35 s on the H200's host) otherwise stalls
        # one step of every run, around step 7-9 (every run of planner-deep-3.5b, session 11):
        # inside a fixed plan's warm-up, but inside stride auto's exploration, whose recorded cost
        # it inflated. Large-model training loops do the same (manual or frozen GC).
        gc.collect()
        gc.freeze()
        res["gc_frozen_objects"] = gc.get_freeze_count()

        def after_step(i):
            if i >= spec.warmup:
                self.lanes.append({"step": i, "events": system.timeline()})

        self.times = timing.run_steps(system, data, spec.warmup, spec.steps, device, clock, after_step)
        res.update(timing.summarize(self.times, spec.micro_batch * spec.seq_len * spec.gpus))
        res.update(system.describe())  # plans may be refined online
        res.setdefault("host_pages", {})["after_steps"] = host_pages()

    def _finish(self) -> None:
        """Stop the sampler, take the peaks, write the artifacts: each step on its own, so that a
        broken CUDA context or a full disk loses only its own part of the record."""
        res, summary = self.res, {}
        train_start = next((a for name, _, a, _ in self.clock.markers if name == "fwd"), 0.0)
        for part in (lambda: self._stop_sampler(summary, train_start),
                     lambda: res.update(_peaks(self.device, summary)),
                     lambda: _write_artifacts(self.run_dir, self.clock, self.times, self.lanes, res),
                     lambda: self.system is not None and self.system.close()):
            try:
                part()
            except Exception:
                traceback.print_exc()
        res.update(nvml=summary.get("nvml"), sample_hz=summary.get("sample_hz"), sampler=summary)
        res["wall_s"] = self.clock.now()

    def _stop_sampler(self, summary: dict, train_start: float) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            summary.update(self.sampler.summary(host_since=train_start))
            # traces are the bulk of the records: stored compressed (records.stored / read_text)
            self.sampler.write(self.run_dir / "samples.csv.gz")
            self.res["files"]["samples_file"] = "samples.csv.gz"


# Waiting, not work: the calling thread blocked on another (a pool's workers, the NVML sampler).
# They ranked first in every dos row's init_profile (`threading.py:637(wait)` 120 s of a 23 s
# init, counted once per nesting level) and pushed the engine's own parts out of the top 12.
_WAITS = ("threading.py:", "_base.py:", "thread.py:", "queue.py:", "(<method 'acquire' of '_thread.lock' objects>)")


def _is_wait(label: str) -> bool:
    return label.startswith(_WAITS[:4]) or label.endswith(_WAITS[4])


@contextlib.contextmanager
def _profiled(res: dict, key: str, top: int = 16):
    """res[key]: the `top` functions of the calling thread by cumulative seconds while the block
    ran ("file:line(function)": seconds), waits on other threads left out (`_WAITS`), so that a
    run on the device says where its init went (a dos run at ~3.5B spent 14 s there: allocation,
    pinning, copies, the kernel's load? Measured in situ, not guessed). Worker threads' work shows
    as the time of their caller (e.g. `buffers.py:pin`)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    try:
        prof.enable()
    except ValueError:  # another profiler holds the interpreter's hook (Python 3.12): run unprofiled
        yield
        return
    try:
        yield
    finally:
        prof.disable()
        stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
        ranked = sorted(((f"{Path(f).name}:{line}({name})", ct) for (f, line, name), (_, _, _, ct, _) in stats.items()),
                        key=lambda e: -e[1])
        res[key] = {label: round(ct, 3) for label, ct in [e for e in ranked if not _is_wait(e[0])][:top]}


def host_pages() -> dict:
    """This process's resident host memory and how much of it is in transparent huge pages, GiB
    (/proc/self/smaps_rollup; {} where absent). The host arena asks for huge pages
    (dos.buffers.HostArena); the CPU lane streams through all of it every step, so a run that got
    fewer of them may update slower — recorded per run to tell that apart from other noise; so is
    the NUMA node of the pages (`numa_gib`, where /proc/self/numa_maps exists)."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return {}
    kib = {k.strip(): int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in text.splitlines()[1:] if ":" in ln)}
    out = {name: round(kib.get(field, 0) / 2**20, 3) for name, field in
           (("rss_gib", "Rss"), ("anon_huge_gib", "AnonHugePages"), ("locked_gib", "Locked"))}
    try:  # which NUMA node holds the pages: a run whose arena landed on a remote node streams slower
        out["numa_gib"] = numa_gib(Path("/proc/self/numa_maps").read_text())
    except OSError:
        pass
    return out


def numa_gib(numa_maps: str) -> dict:
    """GiB resident per NUMA node ("N0", "N1", ...) summed over a /proc/<pid>/numa_maps text (each
    mapping's `N<node>=<pages>` counts pages of its `kernelpagesize_kB`)."""
    per = {}
    for line in numa_maps.splitlines():
        fields = dict(f.split("=", 1) for f in line.split()[2:] if "=" in f)
        page_kib = int(fields.get("kernelpagesize_kB", 4))
        for k, v in fields.items():
            if k[:1] == "N" and k[1:].isdigit():
                per[k] = per.get(k, 0) + int(v) * page_kib
    return {k: round(v / 2**20, 3) for k, v in sorted(per.items())}


def _write_artifacts(run_dir: Path, clock, times, lanes, res) -> None:
    from dos.lab.bench.timing import step_rows

    _write_csv(run_dir / "markers.csv", ("phase", "step", "start_s", "end_s"),
               [(n, "" if s is None else s, f"{a:.6f}", f"{b:.6f}") for n, s, a, b in clock.markers])
    res["files"]["markers_file"] = "markers.csv"
    if times:
        rows = step_rows(times)
        _write_csv(run_dir / "steps.csv", list(rows[0]), [list(r.values()) for r in rows])
        res["files"]["steps_file"] = "steps.csv"
    if any(x["events"] for x in lanes):
        # the engine's times are relative to the start of opt.step(): the "step" phase's start
        starts = {t.step: t.start_s + t.fwd_s + t.bwd_s for t in times}
        for x in lanes:
            x["step_phase_start_s"] = starts.get(x["step"])
        from dos.lab.bench.records import open_text_out

        with open_text_out(run_dir / "lanes.json.gz") as f:
            f.write(json.dumps(lanes, separators=(",", ":"), default=str))
        res["files"]["lanes_file"] = "lanes.json.gz"


def die_with_parent() -> None:
    """Started by a sweep (DOS_SWEEP_PID): get SIGKILL when the sweep dies (PR_SET_PDEATHSIG), and
    exit at once if it died before this call."""
    parent = os.environ.get("DOS_SWEEP_PID")
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if _world() > 1:  # a rank: its parent is torchrun, which dies with the launcher's group
        return
    if os.getppid() != int(parent):
        os._exit(1)


def launch(spec, spec_path: Path, run_dir: Path) -> dict:
    """gpus > 1: run the ranks under torchrun; return the merged result (see `merge_ranks`)."""
    import subprocess
    import threading

    import psutil

    from dos.lab.nvml import _tree_usage

    n = spec.gpus
    env = {**os.environ, "DOS_BENCH_RANKS": str(n), "PYTHONUNBUFFERED": "1"}
    env.pop("DOS_SWEEP_PID", None)  # the ranks are torchrun's children, not the sweep's
    env.pop("DOS_STARTED_BY", None)  # and started by exec (torchrun's), whatever started this one
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // n)))  # torchrun's default would be 1
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
           "-m", "dos.lab.bench.run", str(spec_path), str(run_dir)]
    peak, stop = [0], threading.Event()

    def sample():  # the host's total for this run: launcher + torchrun + every rank (+ children)
        me = psutil.Process()
        while not stop.wait(0.1):
            try:
                peak[0] = max(peak[0], _tree_usage(me)[0])
            except psutil.Error:
                pass

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        rc = subprocess.call(cmd, env=env)
    finally:
        stop.set()
        t.join()
    ranks = []
    for r in range(n):
        path = (run_dir if r == 0 else run_dir / f"rank{r}") / "rank_result.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    return merge_ranks(ranks, rc, peak[0] / _GIB)


_SEVERITY = {"ok": 0, "skipped": 1, "error": 2, "oom": 3}


def merge_ranks(ranks: list, rc: int, host_total_gib: float) -> dict:
    """One row from the ranks' results: rank 0's fields (its timing: the collectives keep the ranks
    in step; tokens/s already counts every rank's tokens), the worst status with its rank's error,
    GPU peaks as the max over ranks, host RSS as the host's total for the run (the process tree's
    sampled peak, or the sum of the ranks' peaks where larger), and each rank's iter_s."""
    present = [(r, x) for r, x in enumerate(ranks) if x is not None]
    if not present or ranks[0] is None:
        missing = [r for r, x in enumerate(ranks) if x is None]
        return {"status": "error", "files": {}, "gpus": len(ranks),
                "error": f"torchrun exited with {rc}; no result from rank(s) {missing}"}
    out = dict(ranks[0])
    worst_r, worst = max(present, key=lambda rx: _SEVERITY.get(rx[1].get("status"), 2))
    if worst.get("status") != "ok":
        out["status"] = worst.get("status")
        out["error"] = f"rank {worst_r}: {worst.get('error')}"
    elif len(present) < len(ranks):
        out["status"], out["error"] = "error", f"torchrun exited with {rc}; a rank wrote no result"
    for k in ("peak_gpu_gib", "peak_gpu_reserved_gib", "peak_gpu_nvml_gib"):
        vals = [x.get(k) for _, x in present if x.get(k) is not None]
        out[k] = max(vals) if vals else None
    ranks_sum = sum(x.get("peak_host_gib") or 0.0 for _, x in present)
    out["peak_host_gib"] = max(host_total_gib, ranks_sum) if host_total_gib else ranks_sum
    out["peak_host_ranks_sum_gib"] = ranks_sum
    out["rank_iter_s"] = [x.get("iter_s") for x in ranks if x is not None]
    out["rank_status"] = [x.get("status") if x else None for x in ranks]
    out.pop("rank", None)
    return out


def main(argv=None) -> int:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m dos.lab.bench.run SPEC.json RUN_DIR", file=sys.stderr)
        return 2
    from dos.lab.bench.spec import RunSpec

    spec = RunSpec.from_dict(json.loads(Path(argv[0]).read_text()))
    run_dir = Path(argv[1])
    run_dir.mkdir(parents=True, exist_ok=True)
    if spec.gpus > 1 and _world() == 1:
        res = launch(spec, Path(argv[0]), run_dir)
    elif _world() > 1:
        rank_dir = run_dir if _rank() == 0 else run_dir / f"rank{_rank()}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        res = execute(spec, rank_dir)
        _write_json(rank_dir / "rank_result.json", res)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        res = execute(spec, run_dir)
    _write_json(run_dir / "result.json", res)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: DeepSpeed / CUDA atexit hooks can hang or crash after a failure,
    # and the result is already on disk.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
