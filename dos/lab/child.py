"""One run of a sweep in its own process, and that process's end.

A run starts as a fork of the `zygote` server (which imported torch and transformers once) or, where
a fork cannot use CUDA, as `python -m dos.lab.bench.run`; either way in a process group of its own,
so that a timeout or a killed sweep takes down the run and everything it started (DeepSpeed's
worker processes) before the next run's preflight reads the host's free memory.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from dos.lab import zygote
from dos.lab.bench.spec import RunSpec

GROUP_EXIT_S = 10.0  # how long _kill_group waits for a run's processes to be gone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the run's process group (the run and e.g. DeepSpeed's worker processes) and wait
    until none of them is left alive, so that the next run's preflight sees their memory freed."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    deadline = time.monotonic() + GROUP_EXIT_S
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (zombies hold no memory: not counted)."""
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                return True
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return False


def run_child(spec: RunSpec, run_dir: Path, timeout_s: float) -> dict:
    """Run `spec` in its own process (a fork of the `zygote` server, else `python -m`); return its
    result dict (synthesized when it died)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.json").write_text(json.dumps(spec.to_dict(), indent=1))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(_free_port()),
           "DOS_SWEEP_PID": str(os.getpid())}  # the run dies with this process (dos.lab.bench.run)
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    argv = [str(run_dir / "spec.json"), str(run_dir)]
    with open(run_dir / "log.txt", "wb") as log:
        # a fork of a server that imported torch and transformers already (None: it cannot)
        proc = (zygote.start(argv, run_dir / "log.txt", env, zygote.flavour_of(spec))
                if zygote.enabled() else None)
        if proc is None:
            # Its own session (process group) and no preexec_fn: with one, a SIGTERM arriving during
            # the fork was lost about one time in four (the sweep ran on); unsafe with threads too.
            proc = subprocess.Popen([sys.executable, "-m", "dos.lab.bench.run", *argv], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return {"status": "error", "error": f"timeout: run exceeded {timeout_s:.0f} s", "files": {}}
        except BaseException:
            _kill_group(proc)
            raise
    _kill_group(proc)  # leftovers of the run's process group (e.g. DeepSpeed worker processes)
    if rc == zygote.BAD_FORK and isinstance(proc, zygote.ForkedRun):  # CUDA unusable in a fork
        zygote.disable("a forked run could not use CUDA", proc)
        return run_child(spec, run_dir, timeout_s)
    _trim_log(run_dir / "log.txt")
    result_path = run_dir / "result.json"
    if result_path.exists():
        res = json.loads(result_path.read_text())
        if isinstance(proc, zygote.ForkedRun) and zygote.broke_cuda(res.get("error")):
            zygote.disable(f"a forked run could not initialise CUDA ({str(res['error'])[:160]})", proc)
            os.replace(run_dir / "log.txt", run_dir / "log.fork.txt")  # kept: why it ran again
            result_path.unlink()
            return run_child(spec, run_dir, timeout_s)
        return res
    tail = _log_tail(run_dir / "log.txt")
    if rc == -signal.SIGKILL:
        return {"status": "oom", "error": f"killed by SIGKILL (host out of memory?); log: {tail}", "files": {}}
    return {"status": "error", "error": f"exit code {rc} without a result; log: {tail}", "files": {}}


def _log_tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace").strip()
    except OSError:
        return ""


def _trim_log(path: Path, keep: int = 512 << 10) -> None:
    """Keep logs compact: the first and last quarter-MiB of a long one."""
    try:
        data = path.read_bytes()
    except OSError:
        return
    if len(data) > 2 * keep:
        path.write_bytes(data[:keep] + b"\n[... trimmed ...]\n" + data[-keep:])
