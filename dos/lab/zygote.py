"""A sweep's runs forked from one server process that has imported the bench's heavy modules.

Why: on the H200 image, `import transformers` (torch, and sklearn through transformers.generation)
took 20-22 s in every run's process, of ~65 s per planner run; a 21-run sweep spent ~7 of its ~25
minutes importing (docs/DESIGN.md §10, session 10). Every run is still its own process: its CUDA
context, pinned memory, allocator and thread pools never carry over to the next run. Only the
imports are shared: `python -m dos.lab.zygote` imports `PRELOAD` once per sweep and forks one child
per run (as PyTorch's DataLoader workers are forks of an importing parent).

Protocol (one run at a time, as a sweep runs them): the server prints `ready`; per request line
(JSON: argv, log, env) it forks, prints `{"pid": P}`, waits for the child and prints `{"rc": R}`.
It exits when its stdin closes (the sweep is gone); its children die with it (PR_SET_PDEATHSIG,
`dos.lab.bench.run.die_with_parent`).

Invariants that keep a fork as good as a fresh process:
- The server imports and does nothing else: no tensor op (no OpenMP pool), no CUDA call. A CUDA
  context does not survive a fork; the server runs with PYTORCH_NVML_BASED_CUDA_CHECK=1, so an
  import-time `torch.cuda.is_available()` asks NVML instead of initialising the driver.
- A child that still finds itself in a bad fork (`torch.cuda._is_in_bad_fork()`) exits with
  `BAD_FORK` before touching its run directory; the sweep then runs that spec, and every later one,
  the old way (`python -m dos.lab.bench.run`). So does a server that fails to start or dies.
- The child makes itself a session leader at once (its process group is what a timeout kills, as
  with `start_new_session`), takes the run's environment whole, writes fds 1 and 2 to the run's
  log and reads nothing. DeepSpeed is not preloaded: its import probes accelerators.
- Packages whose import initialises CUDA are hidden while the server imports (`HIDDEN`): torchao
  0.18 asks the device's capability at import (prototype/mx_formats/kernels.py), and transformers
  imports torchao wherever it is installed (transformers.quantizers); with the DeepSpeed wheels
  carried (which bring torchao), every run of a 2026-12-02 headline batch ran by exec. A run that
  needs one imports it itself, after the fork. A server whose imports initialised CUDA anyway
  does not start (the sweep runs by exec, and says which import did it).
- A run's `init_s` no longer includes those imports (they happened before the fork).

`DOS_ZYGOTE=0` turns it off (every run by exec, as before session 10).
"""
from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import subprocess
import sys
from typing import Optional

PRELOAD = ["torch", "transformers.models.llama.modeling_llama", "dos", "dos.lab.bench.run",
           "dos.lab.bench.models", "dos.lab.bench.systems", "dos.lab.bench.timing", "dos.lab.nvml"]
# Hidden from the server's imports (sys.modules[name] = None: `import` raises ImportError and
# importlib.util.find_spec returns None, so transformers takes them for absent); unhidden before the
# first fork, so that a run imports them normally (transformers keeps its answer, which no run needs).
HIDDEN = ("torchao", "deepspeed")
BAD_FORK = 75  # the child's exit code when it cannot use CUDA after the fork (EX_TEMPFAIL)
READY_S = 600.0  # the server's imports (~25 s on the H200 image)

_server: Optional["Server"] = None
_broken = False  # the rest of this sweep runs by exec


def enabled() -> bool:
    return not _broken and os.environ.get("DOS_ZYGOTE", "1") != "0" and sys.platform.startswith("linux")


def disable(why: str = "") -> None:
    global _broken
    _broken = True
    if why:
        print(f"sweep: {why}; this and later runs start by exec", file=sys.stderr)
    _close()


# What CUDA says in a process that inherited an initialised driver: the fork is the cause, not
# the run (torch's own bad-fork check misses a driver that a library initialised directly).
_CUDA_FORK_ERRORS = ("initialization error", "re-initialize cuda in forked subprocess",
                     "cuda driver initialization failed")


def broke_cuda(error) -> bool:
    """Whether a run's error is CUDA failing to start in a forked process."""
    e = str(error or "").lower()
    return any(s in e for s in _CUDA_FORK_ERRORS)


class ServerGone(RuntimeError):
    pass


class Server:
    """The sweep's side of one `python -m dos.lab.zygote` process."""

    def __init__(self, env: dict):
        env = {**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "dos.lab.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self._buf = b""
        if self.readline(READY_S) != "ready":
            self.proc.kill()  # imports that hang: not left behind
            raise ServerGone("the fork server did not start")

    def readline(self, timeout: Optional[float]) -> Optional[str]:
        """The next line, None on timeout; ServerGone at EOF."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise ServerGone("the fork server exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode().strip()

    def request(self, argv: list, log_path: str, env: dict) -> int:
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "log": log_path, "env": env}) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ServerGone(f"the fork server is gone ({e})") from None
        line = self.readline(60.0)
        if line is None:
            raise ServerGone("the fork server did not fork")
        return int(json.loads(line)["pid"])

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


class ForkedRun:
    """The part of `subprocess.Popen` the sweep uses: pid, wait(timeout), returncode."""

    def __init__(self, server: Server, pid: int):
        self.server, self.pid = server, pid
        self.returncode: Optional[int] = None

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            try:
                line = self.server.readline(timeout)
            except ServerGone:  # the child died with the server (PR_SET_PDEATHSIG)
                disable("the fork server exited during a run")
                self.returncode = -9
                return self.returncode
            if line is None:
                raise subprocess.TimeoutExpired("forked run", timeout)
            self.returncode = int(json.loads(line)["rc"])
        return self.returncode


def start(argv: list, log_path, env: dict) -> Optional[ForkedRun]:
    """Start `python -m dos.lab.bench.run *argv` as a fork of the server (started at the first
    call), its output appended to `log_path`; None where the server cannot (run by exec)."""
    global _server
    try:
        if _server is None:  # with the run's environment: its PYTHONPATH finds this checkout
            _server = Server(dict(env))
            atexit.register(_close)
        return ForkedRun(_server, _server.request([str(a) for a in argv], str(log_path), dict(env)))
    except ServerGone as e:
        disable(str(e))
        return None


def _close() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


# ---------------------------------------------------------------- the server process

def _child(req: dict, proto_fd: int) -> None:
    try:
        os.close(proto_fd)  # the protocol's pipe is the server's alone: its EOF tells the sweep
        os.setsid()
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ["DOS_SWEEP_PID"] = str(os.getppid())  # the server: it exits when the sweep does
        import torch

        if torch.cuda._is_in_bad_fork():
            os._exit(BAD_FORK)
        from dos.lab.bench import run

        rc = run.main(req["argv"])  # ends the process itself once result.json is written
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc or 0)


def _preload() -> bool:
    """Import PRELOAD with HIDDEN hidden; False where an import initialised CUDA."""
    hidden = [name for name in HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():  # every child: a bad fork
                print(f"zygote: importing {name} initialised CUDA; runs start by exec", file=sys.stderr)
                return False
        return True
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def _cache_cpuinfo() -> None:
    """py-cpuinfo's `get_cpu_info()` answered once, in the server, for every child: DeepSpeed calls
    it three times per run (its op builders' cpu_arch and simd_width, DeepSpeedCPUAdam's vendor
    check), each a subprocess of ~1.1-1.5 s (~4.5 s of a DeepSpeed run's init_s on the H200 image).
    The CPU does not change between the forks of one sweep. No-op where py-cpuinfo is absent."""
    try:
        import cpuinfo
    except ImportError:
        return
    try:
        info = cpuinfo.get_cpu_info()
    except Exception:  # DeepSpeed then falls back to lscpu itself, as without the cache
        return

    def get_cpu_info() -> dict:
        return dict(info)

    cpuinfo.get_cpu_info = get_cpu_info
    if hasattr(cpuinfo, "cpuinfo"):
        cpuinfo.cpuinfo.get_cpu_info = get_cpu_info


def serve() -> int:
    # The protocol gets its own descriptor; fd 1 goes to stderr, so that whatever an import prints
    # cannot be taken for a reply.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if not _preload():
        return 1
    _cache_cpuinfo()
    # the imports' objects into the GC's permanent generation before any fork: a child's full
    # collections skip them (and do not copy every page of the shared heap to write GC headers)
    gc.collect()
    gc.freeze()
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req, out.fileno())
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
