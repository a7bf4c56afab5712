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
- DeepSpeed's runs fork from a *flavour* server (`FLAVOURS`): a fork of this server, started at
  the sweep's first DeepSpeed run, that imported DeepSpeed and the modules its engine loads in a
  run's init (its ops, the ZeRO stages, and torch._inductor through a module-level
  `torch.compile` in deepspeed.runtime.zero.muon: ~1100 modules; on the H200 image 5-8 s of
  torch.library registrations and 3-4 s of compiling in every DeepSpeed run's init, session 20).
  It keeps the invariants above (no CUDA, no thread started by its imports, checked); where it
  cannot start, or a run forked from it cannot use CUDA, that flavour's runs fork from this server
  as before (`disable(proc=)`), the others keep forking. The server relays its pid and rc lines.
- The child records how it started (`started_by` in result.json: "fork", "fork:deepspeed";
  "exec" without the server), so that init times are compared like with like.

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
import time
from typing import Optional

PRELOAD = ["torch", "transformers.models.llama.modeling_llama", "dos", "dos.lab.bench.run",
           "dos.lab.bench.models", "dos.lab.bench.systems", "dos.lab.bench.timing", "dos.lab.nvml"]
# Hidden from the server's imports (sys.modules[name] = None: `import` raises ImportError and
# importlib.util.find_spec returns None, so transformers takes them for absent); unhidden before the
# first fork, so that a run imports them normally (transformers keeps its answer, which no run needs).
HIDDEN = ("torchao", "deepspeed")
FLAVOURS = {
    "deepspeed": ("deepspeed", "deepspeed.ops.adam", "deepspeed.ops.op_builder",
                  "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3",
                  "deepspeed.runtime.zero.muon.muon_optimizer", "torch.utils.cpp_extension"),
}
"""Extra modules per flavour of run (DeepSpeed 0.19.8: what a ZeRO-2/3 offload run's init imports,
found by diffing sys.modules around one; what it still imports after these: ~40 small modules)."""
BAD_FORK = 75  # the child's exit code when it cannot use CUDA after the fork (EX_TEMPFAIL)
READY_S = 600.0  # the server's imports (~25 s on the H200 image)
SUB_READY_S = 300.0  # a flavour server's extra imports; beyond it its runs fork from the server

_server: Optional["Server"] = None
_broken = False  # the rest of this sweep runs by exec
_broken_flavours: set = set()  # these flavours' runs fork from the plain server


def enabled() -> bool:
    return not _broken and os.environ.get("DOS_ZYGOTE", "1") != "0" and sys.platform.startswith("linux")


def disable(why: str = "", proc=None) -> None:
    """The rest of the sweep runs by exec; or, for `proc` forked from a flavour server, that
    flavour's runs fork from the plain server (which stays good: the flavour's imports were not its)."""
    global _broken
    name = getattr(proc, "flavour", None)
    if name:
        _broken_flavours.add(name)
        if why:
            print(f"sweep: {why}; this and later {name} runs fork from the plain server", file=sys.stderr)
        return
    _broken = True
    if why:
        print(f"sweep: {why}; this and later runs start by exec", file=sys.stderr)
    _close()


def flavour_of(spec) -> Optional[tuple]:
    """(flavour, environment its imports need) for a run that forks from a flavour server, else
    None: DeepSpeed's one-process runs (a multi-GPU run is torchrun's ranks, not forks), with the
    accelerator its import picks: DS_ACCELERATOR=cpu where the run is on the CPU (as
    `systems.prepare_env` sets it), else DeepSpeed's own detection (NVML-based in the server)."""
    if not str(spec.system).startswith("deepspeed") or int(spec.gpus) != 1:
        return None
    return "deepspeed", ({"DS_ACCELERATOR": "cpu"} if spec.device == "cpu" else {})


# What CUDA says in a process that inherited an initialised driver: the fork is the cause, not
# the run (torch's own bad-fork check misses a driver that a library initialised directly).
_CUDA_FORK_ERRORS = ("initialization error", "re-initialize cuda in forked subprocess",
                     "cuda driver initialization failed")


def broke_cuda(error) -> bool:
    """Whether a run's error is CUDA failing to start in a forked process."""
    e = str(error or "").lower()
    return any(s in e for s in _CUDA_FORK_ERRORS)


class _Lines:
    """Line reads from a pipe with a timeout (None on timeout, EOFError at its end)."""

    def __init__(self, fd: int):
        self.fd, self.buf = fd, b""

    def readline(self, timeout: Optional[float]) -> Optional[str]:
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                raise EOFError
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode().strip()


class ServerGone(RuntimeError):
    pass


class Server:
    """The sweep's side of one `python -m dos.lab.zygote` process."""

    def __init__(self, env: dict):
        env = {**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "dos.lab.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self._lines = _Lines(self.proc.stdout.fileno())
        if self.readline(READY_S) != "ready":
            self.proc.kill()  # imports that hang: not left behind
            raise ServerGone("the fork server did not start")

    def readline(self, timeout: Optional[float]) -> Optional[str]:
        """The next line, None on timeout; ServerGone at EOF."""
        try:
            return self._lines.readline(timeout)
        except EOFError:
            raise ServerGone("the fork server exited") from None

    def request(self, argv: list, log_path: str, env: dict, flavour: Optional[tuple] = None) -> int:
        req = {"argv": argv, "log": log_path, "env": env}
        if flavour is not None:
            req["flavour"] = [flavour[0], dict(flavour[1])]
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ServerGone(f"the fork server is gone ({e})") from None
        line = self.readline(SUB_READY_S + 60.0)  # a flavour server may start first
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
    """The part of `subprocess.Popen` the sweep uses: pid, wait(timeout), returncode; `flavour`:
    the flavour server it was asked of (None: the plain server)."""

    def __init__(self, server: Server, pid: int, flavour: Optional[str] = None):
        self.server, self.pid, self.flavour = server, pid, flavour
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


def start(argv: list, log_path, env: dict, flavour: Optional[tuple] = None) -> Optional[ForkedRun]:
    """Start `python -m dos.lab.bench.run *argv` as a fork of the server (started at the first
    call), its output appended to `log_path`; None where the server cannot (run by exec).
    `flavour` (`flavour_of(spec)`): fork it from that flavour's server, unless it broke."""
    global _server
    if flavour is not None and flavour[0] in _broken_flavours:
        flavour = None
    try:
        if _server is None:  # with the run's environment: its PYTHONPATH finds this checkout
            _server = Server(dict(env))
            atexit.register(_close)
        pid = _server.request([str(a) for a in argv], str(log_path), dict(env), flavour)
        return ForkedRun(_server, pid, flavour[0] if flavour else None)
    except ServerGone as e:
        disable(str(e))
        return None


def _close() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


# ---------------------------------------------------------------- the server process

def _child(req: dict, close_fds: list, started_by: str = "fork", env_extra: Optional[dict] = None) -> None:
    try:
        for fd in close_fds:  # the protocol's pipes are the servers' alone: their EOF tells the sweep
            os.close(fd)
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
        os.environ.update(env_extra or {})  # what the flavour's imports saw (DS_ACCELERATOR)
        os.environ["DOS_SWEEP_PID"] = str(os.getppid())  # the server: it exits when the sweep does
        os.environ["DOS_STARTED_BY"] = started_by
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


def _tasks() -> int:
    """This process's OS threads (a library's native threads too); 0 where /proc is absent."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _import_all(names, hide=HIDDEN, threads: bool = False) -> Optional[str]:
    """Import `names` with `hide` hidden; None, or why the process can no longer fork good
    children: an import initialised CUDA, or (`threads`) started a thread (a fork keeps only the
    caller's; the plain server's imports are known to start none of their own that matter)."""
    hidden = [name for name in hide if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None
    tasks = _tasks()
    try:
        for name in names:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():  # every child: a bad fork
                return f"importing {name} initialised CUDA"
            if threads and _tasks() > tasks:
                return f"importing {name} started a thread"
        return None
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def _preload() -> bool:
    """Import PRELOAD with HIDDEN hidden; False where an import initialised CUDA."""
    why = _import_all(PRELOAD)
    if why:
        print(f"zygote: {why}; runs start by exec", file=sys.stderr)
        return False
    return True


def _cache_cpuinfo(path=None) -> None:
    """py-cpuinfo's `get_cpu_info()` answered once, in the server, for every child: DeepSpeed calls
    it three times per run (its op builders' cpu_arch and simd_width, DeepSpeedCPUAdam's vendor
    check), each a subprocess of ~1.1-1.5 s (~4.5 s of a DeepSpeed run's init_s on the H200 image).
    The cache is `dos.lab.bench.cpuinfo_cache` (per boot, also for runs by exec and torchrun's
    ranks); the server fills it before any fork, so that every child inherits the answer. An answer
    that fails is not kept (DeepSpeed then falls back to lscpu itself). No-op without py-cpuinfo."""
    from dos.lab.bench import cpuinfo_cache

    if not cpuinfo_cache.install(path):
        return
    import cpuinfo

    try:
        cpuinfo.get_cpu_info()
    except Exception:
        pass


class _Flavour:
    """A flavour server, seen from the plain server: a fork of it that imported FLAVOURS[name]
    too (with `env` set) and serves the same protocol on two pipes; `ok` False: it did not start
    or is gone, and its runs fork from the plain server."""

    def __init__(self, name: str, env: dict, close_fds: list):
        self.name, self.ok = name, False
        r_req, self.w_req = os.pipe()
        self.r_rep, w_rep = os.pipe()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                for fd in (*close_fds, self.w_req, self.r_rep):
                    os.close(fd)
                rc = _serve_flavour(name, env, r_req, w_rep)
            except BaseException:
                import traceback

                traceback.print_exc()
            os._exit(rc)
        os.close(r_req)
        os.close(w_rep)
        self.pid, self.lines = pid, _Lines(self.r_rep)
        try:
            first = self.lines.readline(SUB_READY_S)
        except EOFError:
            first = "exited"
        self.ok = first == "ready"
        took = time.perf_counter() - t0
        if self.ok:
            print(f"zygote: the {name} server is ready ({took:.1f} s of imports)", file=sys.stderr)
        else:
            print(f"zygote: the {name} server did not start ({first or 'timed out'}); its runs fork "
                  "from the plain server", file=sys.stderr)
            self.close(kill=True)

    def fds(self) -> list:
        return [self.w_req, self.r_rep] if self.pid else []

    def relay(self, line: str, out) -> bool:
        """Hand a request to this server and copy its pid and rc lines to `out`; False when it was
        gone before it forked (the request is then the plain server's)."""
        try:
            os.write(self.w_req, line.encode() if line.endswith("\n") else (line + "\n").encode())
            pid = self.lines.readline(60.0)
        except (OSError, EOFError):
            pid = None
        if pid is None:
            print(f"zygote: the {self.name} server is gone; its runs fork from the plain server",
                  file=sys.stderr)
            self.close(kill=True)
            return False
        out.write(pid + "\n")
        out.flush()
        try:
            rc = self.lines.readline(None)
        except EOFError:  # it died during the run: so did the run (PR_SET_PDEATHSIG)
            rc = None
        if rc is None:
            rc = json.dumps({"rc": -9})
            self.close(kill=True)
        out.write(rc + "\n")
        out.flush()
        return True

    def close(self, kill: bool = False) -> None:
        self.ok = False
        if self.pid:
            if kill:  # hung or half-gone: do not wait for a loop that may never read its EOF
                try:
                    os.kill(self.pid, 9)
                except ProcessLookupError:
                    pass
            for fd in (self.w_req, self.r_rep):
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                os.waitpid(self.pid, 0)  # its stdin closed: it ends its loop and exits
            except ChildProcessError:
                pass
            self.pid = 0


def _serve_flavour(name: str, env: dict, r_req: int, w_rep: int) -> int:
    """The flavour server's body (in the fork): import, check, then the same fork loop."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG: SIGKILL with the server
    except (OSError, AttributeError):
        pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the sweep's requests are the plain server's to read
    os.close(null)
    os.environ.update(env)
    out = os.fdopen(w_rep, "w")
    why = _import_all(FLAVOURS[name], hide=tuple(h for h in HIDDEN if h != name), threads=True)
    if why:
        out.write(why + "\n")
        out.flush()
        return 1
    gc.collect()
    gc.freeze()
    out.write("ready\n")
    out.flush()
    _loop(os.fdopen(r_req), out, flavours=None, started_by=f"fork:{name}", env_extra=env)
    return 0


def _loop(inp, out, flavours: Optional[dict], started_by: str = "fork", env_extra=None) -> None:
    """One request at a time: fork the run (or hand it to its flavour's server), reply with its
    pid, wait, reply with its rc. `flavours`: the plain server's flavour servers by (name, env)
    (None in a flavour server: it starts none)."""
    for line in inp:
        if not line.strip():
            continue
        req = json.loads(line)
        fl = req.get("flavour") if flavours is not None else None
        if fl and fl[0] in FLAVOURS:
            key = (fl[0], json.dumps(fl[1], sort_keys=True))
            if key not in flavours:
                flavours[key] = _Flavour(fl[0], dict(fl[1]), [out.fileno(), *_fds(flavours)])
            if flavours[key].ok and flavours[key].relay(line, out):
                continue
        pid = os.fork()
        if pid == 0:
            _child(req, [out.fileno(), *_fds(flavours)], started_by, env_extra)
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


def _fds(flavours: Optional[dict]) -> list:
    return [fd for f in (flavours or {}).values() for fd in f.fds()]


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
    flavours: dict = {}
    try:
        _loop(sys.stdin, out, flavours)
    finally:
        for f in flavours.values():
            f.close()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
