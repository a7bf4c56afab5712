"""Sweeps: a yaml grid -> isolated runs -> rows appended to runs.csv, resumable.

The sweep file's format: dos.lab.sweep_file (load, parse, select; re-exported here).

Every row carries the sweep process's `batch_id` (one per invocation, a resumed sweep a new batch,
unless `--batch-id` or `--continue-batch` names the batch it continues on the same machine), the
GPU's UUID, the host's boot id and, under `repeat`, its repetition (1..N; each a run_id of its own).
Ratios are taken within one batch only (dos.lab.results). A headline sweep refuses a dirty tree
unless `--allow-dirty` (or DOS_ALLOW_DIRTY=1) is given; the row's git_sha says so then.

Every run is a child process (`dos.lab.child`: a fork of the `zygote` server or `python -m
dos.lab.bench.run`; its own process group); the parent appends its row. Finished run_ids are not
run again (within the named batch, where one is named), so a killed sweep reruns only what was in
flight; SIGTERM (e.g. `timeout`) kills the run in flight with its whole process group before the
sweep exits. Runs that cannot fit in host
memory, or cannot run on this machine, become `skipped` rows with the reason; a resumed sweep
checks those again (on a larger machine they run, their new row superseding the skipped one; still
skipped, no row is added). The host-memory preflight waits while available memory is still growing
(a previous run's pinned memory being released), at most `SETTLE_MAX_S`. Crashes, timeouts and OOMs
become rows too. Errors in the file itself stop everything before the first run.
"""
from __future__ import annotations

import collections
import json
import math
import os
import shutil
import signal
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

import psutil

from dos.lab.child import run_child
from dos.lab.bench import records
from dos.lab.bench.spec import ConfigError, RunSpec
from dos.lab.sweep_file import ORDERS, SWEEP_KEYS, Sweep, load, parse, select  # noqa: F401 (API)
from dos.lab.preflight import (DOS_STATE_BPP, MEMORY_REASON, available_host_gib,  # noqa: F401 (API)
                               host_bytes_estimate, preflight, settled_preflight)

RESULTS = Path("experiments") / "results"
_GIB = 2**30


# ---------------------------------------------------------------- rows

def new_batch_id() -> str:
    """One per sweep process: UTC time and a random suffix (sortable, unique across machines)."""
    import datetime as dt
    import uuid

    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]


def continued_batch(out_dir: Path, batch_id: str) -> str:
    """`batch_id`, checked to be a batch this host is in the middle of: `out_dir/runs.csv` holds
    rows of it, recorded since this host's last boot (a batch is one machine without restart).
    Raises ConfigError otherwise: a device call whose checkout lacks the previous call's results
    would run the batch's first runs again under the same batch_id (session 10 did, three times)."""
    rows = [r for r in records.read_rows(Path(out_dir) / "runs.csv") if r.get("batch_id") == batch_id]
    if not rows:
        raise ConfigError(f"--continue-batch {batch_id}: {Path(out_dir) / 'runs.csv'} holds no row of that "
                          "batch (were the previous call's results put back into this directory?)")
    boots = {r.get("boot_id") for r in rows}
    if records.boot_id() not in boots:
        raise ConfigError(f"--continue-batch {batch_id}: its rows were measured on boot {sorted(boots)}, this "
                          f"host is boot {records.boot_id()!r}: a batch is one machine without restart; "
                          "start a new batch")
    return batch_id


def run_folder(run_id: str, rows_before: int) -> str:
    """The folder of a run's files under the results directory: its run_id, and for a run that has
    `rows_before` rows already (a re-measurement of a superseded run) `<run_id>.<rows_before>`, so
    that the rows it supersedes keep the files they name (records are append-only, files too)."""
    return run_id if rows_before == 0 else f"{run_id}.{rows_before}"


def make_row(spec: RunSpec, sweep: str, res: dict, host_mem_gib: float, batch_id: str = "",
             supersedes: Sequence[str] = (), supersede_reason: str = "", folder: str = "") -> dict:
    """The runs.csv row of one run; its file columns name files under `folder` (its run_id by
    default, `run_folder`)."""
    from dos.lab.bench.models import preset

    p = preset(spec.model, spec.model_overrides)
    files = res.get("files") or {}
    row = {c: res.get(c) for c in records.COLUMNS if c in res}
    row.update(
        run_id=spec.run_id(), sweep=sweep, timestamp=records.now_iso(), git_sha=records.git_sha(),
        status=res["status"], error=res.get("error"), system=spec.system, placement=spec.placement,
        stride=spec.stride, gpu_fraction=spec.gpu_fraction, ratio=res.get("ratio", spec.ratio),
        model=spec.model, n_params=res.get("n_params") or p.n_params(), seq_len=spec.seq_len,
        micro_batch=spec.micro_batch, gpus=spec.gpus, device=res.get("device") or spec.device,
        gpu_mem_cap_gib=spec.gpu_mem_cap_gib, host_mem_gib=round(host_mem_gib, 2),
        warmup=spec.warmup, steps=spec.steps, data=spec.data, dtype=spec.dtype,
        state_dtype=res.get("state_dtype") or spec.state_dtype(), batch_id=batch_id,
        gpu_uuid=res.get("gpu_uuid") or "", boot_id=records.boot_id(), repeat=spec.repeat,
        supersedes=";".join(supersedes) or None, supersede_reason=supersede_reason or None,
        plan=res.get("plan"),
        config={"run": spec.to_dict(), "model": res.get("model_record"), "data": res.get("data_record"),
                "system": res.get("config"), "sampler": res.get("sampler"),
                "gpu_mem_total_gib": res.get("gpu_mem_total_gib")},
    )
    folder = folder or spec.run_id()
    if res.get("status") != "skipped" or files:
        row["log_file"] = f"{folder}/log.txt"
    for key, name in files.items():
        row[key] = f"{folder}/{name}"
    return row


# ---------------------------------------------------------------- a sweep

class DirtyTree(ConfigError):
    """A headline sweep asked to run from a tree with uncommitted changes."""


def allow_dirty_env() -> bool:
    return os.environ.get("DOS_ALLOW_DIRTY", "") not in ("", "0")


def check_clean(sweep: Sweep, allow_dirty: bool = False) -> None:
    """A headline sweep runs from a committed tree: raise DirtyTree when the git sha ends in
    -dirty (or is unknown), unless allowed (`--allow-dirty`, DOS_ALLOW_DIRTY=1)."""
    if not sweep.headline or allow_dirty or allow_dirty_env():
        return
    sha = records.git_sha()
    if sha.endswith("-dirty") or sha == "unknown":
        raise DirtyTree(f"{sweep.name} is a headline sweep (headline: true) and the tree is {sha!r}: "
                        "commit first (records must name the code that produced them), or pass "
                        "--allow-dirty / DOS_ALLOW_DIRTY=1 for a trial")


def run(sweep: Sweep, out_dir, pack: Optional[str] = None, dry_run: bool = False,
        host_memory_gib: Optional[float] = None, progress: bool = True, allow_dirty: bool = False,
        batch_id: Optional[str] = None, stop_by_s: Optional[float] = None,
        within_batch: bool = False) -> dict:
    """Run every missing run of `sweep` into `out_dir`, and again those it supersedes; return
    counts by status. Every row gets this call's `batch_id` (a new one by default). A run is
    missing where no row has its run_id, or with `within_batch` (a batch named by `--batch-id` or
    `--continue-batch`) where no row *of this batch* has it: a new batch of a sweep measured
    before runs every run again (session 11's first call skipped 9 runs of a new batch because
    an older batch held their rows, and the batch was no longer round-robin). With
    `stop_by_s` (seconds from now: a device call's time left), a run expected to end later
    (`expected_s`) is not started: the sweep stops there (count "deferred") and resumes next time,
    instead of losing the run in flight to the call's time limit."""
    deadline = None if stop_by_s is None else time.monotonic() + stop_by_s
    out_dir = Path(out_dir)
    csv_path = out_dir / "runs.csv"
    if not dry_run:
        check_clean(sweep, allow_dirty)
    batch_id = batch_id or new_batch_id()
    rows = records.read_rows(csv_path)
    n_rows = collections.Counter(r["run_id"] for r in rows)  # every batch's: its files stay apart
    if within_batch:
        rows = [r for r in rows if r.get("batch_id") == batch_id]
    last = {r["run_id"]: r for r in rows}  # last row wins
    latest = {rid: r["status"] for rid, r in last.items()}
    # re-measured: run even where a row is there, until a row of this re-measurement is (its last
    # row names it in `supersedes`): a resumed sweep does not measure it yet again
    again = {rid for rid in sweep.supersedes
             if rid not in (last.get(rid, {}).get("supersedes") or "").split(";")}
    todo = [s for s in sweep.runs if latest.get(s.run_id(), "skipped") == "skipped" or s.run_id() in again]
    total_host = psutil.virtual_memory().total / _GIB
    counts = {"already": len(sweep.runs) - len(todo)}
    if dry_run:  # what would run, and how long it is expected to take (a device lease's plan)
        host_gib, host_src = available_host_gib(sweep, host_memory_gib)
        mine, elsewhere, total = records.read_rows(csv_path), other_rows(out_dir), 0.0
        for s in todo:
            why = preflight(s, host_gib, host_src)
            need = expected_s(s, mine, elsewhere)
            total += need
            when = f"~{need:.0f} s" if need else "(no record of this system or shape)"
            print(f"{s.run_id()}  {s.label():<50} {'skip: ' + why if why else 'run'}  {when}")
        print(f"expected: ~{total / 60:.1f} min for {len(todo)} runs, from the recorded wall times "
              f"(+{RUN_OVERHEAD_S:g} s each; a run with no record to go by counts 0)")
        return counts
    out_dir.mkdir(parents=True, exist_ok=True)
    records.write_env(out_dir)
    elsewhere = other_rows(out_dir) if deadline is not None else []
    bar = _bar(len(sweep.runs), counts["already"], progress)
    restore = _terminate_as_exit()
    try:
        for k, spec in enumerate(todo):
            need = expected_s(spec, records.read_rows(csv_path), elsewhere) if deadline is not None else 0.0
            if deadline is not None and time.monotonic() + max(need, 1.0) > deadline:
                counts["deferred"] = len(todo) - k
                bar.write(f"stopping: the next run ({spec.label()}) takes ~{need:.0f} s, "
                          f"{max(0.0, deadline - time.monotonic()):.0f} s are left; {len(todo) - k} deferred")
                break
            bar.set_description(spec.label()[:60])
            folder = run_folder(spec.run_id(), n_rows[spec.run_id()])
            run_dir = out_dir / folder
            if run_dir.exists():  # leftovers of a run killed in flight (no row names them): afresh
                _keep_killed_log(run_dir)
                shutil.rmtree(run_dir)
            why = settled_preflight(spec, sweep, host_memory_gib)
            if why:
                res = {"status": "skipped", "error": why, "files": {}}
            else:
                res = run_child(spec, run_dir, sweep.timeout_s)
            if not (why and spec.run_id() in latest):  # skipped again: its row is there already
                records.append_row(csv_path, make_row(spec, sweep.name, res, total_host, batch_id,
                                                      sweep.supersedes, sweep.supersede_reason, folder))
            counts[res["status"]] = counts.get(res["status"], 0) + 1
            bar.set_postfix_str(_postfix(res))
            bar.update(1)
            if pack:  # after every run: a sweep cut short by a time limit still returns its rows
                pack_dir(out_dir, pack)
    finally:
        restore()
        bar.close()
    if pack:
        pack_dir(out_dir, pack)
    return counts


RECENT = 3  # the latest recorded runs of a configuration `expected_s` goes by
RUN_OVERHEAD_S = 15.0  # a run's process start, imports before its clock, teardown, the preflight


def expected_s(spec: RunSpec, rows: Sequence[dict], elsewhere: Sequence[dict] = ()) -> float:
    """Seconds `spec` is expected to take, from the ok rows already recorded, each row's wall time
    taken to `spec`'s warm-up + steps (`_at_steps`): the median over the latest `RECENT` rows of the same
    configuration (every setting but the repeat), else over the rows of the same system and model,
    else over those rows in `elsewhere` (other sweeps' records: a sweep's first round has none of
    its own), else over the same system's rows at the nearest parameter count, scaled by the
    parameter count (a model size it never ran at), else the longest run of any system at that
    model (a system recorded nowhere: better deferred than killed in flight); plus
    RUN_OVERHEAD_S; 0 where nothing fits."""
    import statistics

    from dos.lab.bench.models import preset

    mine, iters = spec.to_dict(), spec.warmup + spec.steps
    recs = []  # (recorded here, the run's settings, its row, its wall at spec's step count)
    for here, rs in ((True, rows), (False, elsewhere)):
        for r in rs:
            if r.get("status") == "ok" and r.get("wall_s"):
                cfg = str(r.get("config") or "")
                run = (json.loads(cfg).get("run") or {}) if cfg.startswith("{") else {}
                recs.append((here, run, r, _at_steps(r, iters)))

    def same(run, keys) -> bool:
        return all(run.get(k) == mine.get(k) for k in keys)

    alike = ("system", "model", "model_overrides", "device")
    for where, keys in ((True, [k for k in mine if k != "repeat"]), (True, alike), (False, alike)):
        matched = [(str(r.get("timestamp") or ""), i, w) for i, (here, run, r, w) in enumerate(recs)
                   if here == where and same(run, keys)]
        if matched:
            # the latest RECENT of them (by timestamp, ties in the order recorded): a sweep's
            # older rows may be of slower code (planner-3b's first rows ran by exec, ~52 s, the
            # forked runs of session 24 ~32 s: the median of all deferred a run a call could hold)
            walls = [w for _, _, w in sorted(matched)[-RECENT:]]
            return statistics.median(walls) + RUN_OVERHEAD_S
    # a size this system never ran at: its runs at the nearest parameter count, scaled by it
    # (init, copies and the update phase grow with the parameters)
    try:
        n = preset(spec.model, spec.model_overrides).n_params()
    except Exception:  # an unknown preset: the spec's own validation reports it
        n = 0
    sized = [(abs(math.log(float(r["n_params"]) / n)), w * n / float(r["n_params"])) for _, run, r, w in recs
             if n and same(run, ("system", "device")) and float(r.get("n_params") or 0) > 0]
    if sized:
        near = min(d for d, _ in sized)
        return statistics.median(w for d, w in sized if d == near) + RUN_OVERHEAD_S
    # a system recorded nowhere: as long as the longest run recorded at this shape
    walls = [w for _, run, _, w in recs if same(run, ("model", "model_overrides", "device"))]
    return max(walls) + RUN_OVERHEAD_S if walls else 0.0


def _at_steps(row: dict, iters: int) -> float:
    """A recorded run's wall time had it run `iters` warm-up + measured steps: its init plus the
    rest of its wall per step it ran (a 500-step convergence run does not stand for a 7-step
    one); its wall where the row lacks the fields."""
    wall = float(row["wall_s"])
    try:
        init, done = float(row.get("init_s") or 0.0), int(float(row["warmup"])) + int(float(row["steps"]))
    except (KeyError, TypeError, ValueError):
        return wall
    if done <= 0 or not 0.0 <= init <= wall:
        return wall
    return init + (wall - init) * iters / done


def other_rows(out_dir: Path) -> List[dict]:
    """The rows of the other sweeps' runs.csv beside `out_dir` and under the repository's
    experiments/results (a device call's results dir lies outside the checkout), each sweep once
    (beside `out_dir` first): what a sweep's first runs are expected to take."""
    names, rows = {Path(out_dir).name}, []
    for d in (Path(out_dir).parent, RESULTS):
        for f in sorted(d.glob("*/runs.csv")) if d.is_dir() else []:
            if f.parent.name not in names:
                names.add(f.parent.name)
                rows.extend(records.read_rows(f))
    return rows


def _keep_killed_log(run_dir: Path) -> None:
    """The log of a run killed in flight (a call's time limit, a lost machine) is the only trace of
    why it never wrote a row: keep it as `killed/<folder>-<time>.log` before its folder is cleared."""
    log = run_dir / "log.txt"
    if log.is_file() and log.stat().st_size:
        dest = run_dir.parent / "killed" / f"{run_dir.name}-{time.strftime('%Y%m%dT%H%M%S')}.log"
        dest.parent.mkdir(exist_ok=True)
        shutil.copyfile(log, dest)


def _terminate_as_exit():
    """While a sweep runs, SIGTERM raises SystemExit in the main thread, so that the run in flight
    is killed with its process group (`run_child`) instead of outliving the sweep. Returns the
    function that restores the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def _exit(signum, _frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _exit)
    return lambda: signal.signal(signal.SIGTERM, old)


def _postfix(res: dict) -> str:
    if res["status"] == "ok":
        return f"ok {res.get('iter_s', 0):.3f} s/iter"
    return f"{res['status']}: {(res.get('error') or '')[:40]}"


class _NoBar:
    def set_description(self, *_):
        pass

    set_postfix_str = update = set_description

    @staticmethod
    def write(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self):
        pass


def _bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="run", file=sys.stderr, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")


def pack_dir(out_dir, dest) -> Path:
    """One tar.gz of a results directory (the device machine returns few, small files)."""
    out_dir, dest = Path(out_dir), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(out_dir, arcname=out_dir.name,
                filter=lambda ti: None if ti.name.endswith((".lock", ".tmp")) else ti)
    os.replace(tmp, dest)
    return dest


def default_out(name: str) -> Path:
    return RESULTS / name

