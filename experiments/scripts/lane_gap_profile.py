"""Where the CPU lane's time between two subgroups' updates goes (issue 17, criterion 3: ~25 ms a
step that fp32 and bf16-split both pay, 150-260 us between updates; docs/DESIGN.md decision log
2026-12-07). An all-CPU engine on the device steps with host timers around each part of
`Lanes.cpu_update` and `Lanes._upload` (wrapped here, the engine unchanged); per part the median
host microseconds per subgroup.

    python experiments/scripts/lane_gap_profile.py OUT.csv [--params-per-tensor N] [--tensors K]
        [--steps S] [--trace]

Parts: `host_wait` (the gradient's D2H and write-back events), `kernel` (adam.cpu_state_step_:
the update itself), `span` (the timeline's host span), `upload` (the whole upload stage) and
inside it `copy` (the copy_ call), `record` (an event record) and `on` (a stream switch: its
enter and exit), and `gap` (from one update's end to the next one's start). One
row per state format and part, with $BATCH_ID, the GPU UUID and the boot id.
"""
import argparse, collections, os, statistics, sys, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dos  # noqa: E402
from dos import adam  # noqa: E402
from dos.lab.bench.records import append_script_rows, batch_columns  # noqa: E402


class Timers:
    """Host timers around named callables (attributes swapped for timed ones; `undo` restores)."""

    def __init__(self):
        self.t = collections.defaultdict(list)
        self.on = False
        self.last_kernel_end = None
        self._undo = []

    def wrap(self, obj, name, part):
        f = getattr(obj, name)

        def timed(*a, **k):
            if not self.on:
                return f(*a, **k)
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                t1 = time.perf_counter()
                self.t[part].append(t1 - t0)
                if part == "kernel":
                    if self.last_kernel_end is not None:
                        self.t["gap"].append(t0 - self.last_kernel_end)
                    self.last_kernel_end = t1
        return self.replace(obj, name, timed)

    def replace(self, obj, name, new):
        """obj.name = new until `undo`; the original."""
        f = getattr(obj, name)
        setattr(obj, name, new)
        self._undo.append(lambda: setattr(obj, name, f))
        return f

    def undo(self):
        while self._undo:
            self._undo.pop()()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--params-per-tensor", type=int, default=50_331_648)
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--trace", action="store_true", help="the engine's timeline on (as in the sweeps)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    rows = []
    for sd in ("fp32", "bf16-split"):
        tm = Timers()
        ps = [torch.nn.Parameter(torch.randn(a.params_per_tensor, device=a.device, dtype=torch.bfloat16) * 0.02)
              for _ in range(a.tensors)]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        opt = dos.DeepOptimizerStates(ps, lr=1e-4, placement="cpu", state_dtype=sd, trace=a.trace)
        L = opt._lanes
        tm.wrap(adam, "cpu_state_step_", "kernel")  # lanes.py calls adam.cpu_state_step_
        tm.wrap(L.sync, "host_wait", "host_wait")
        tm.wrap(L.tl, "host", "span")
        tm.wrap(L, "_upload", "upload")
        tm.wrap(L.sync, "record", "record")  # event records: a stage's start and end, the grads'
        on = L.sync.on  # the stream switch, entered and left (timed together)
        tm.replace(L.sync, "on", lambda name: _TimedCtx(on(name), tm))
        param = L.dev.param  # the upload's destination view: its copy_ timed (_Dst)
        tm.replace(L.dev, "param", lambda layout, s: _Dst(param(layout, s), tm))
        for _ in range(2):
            opt.step()
        steps = []
        for _ in range(a.steps):
            if a.device == "cuda":
                torch.cuda.synchronize()
            tm.on, tm.last_kernel_end = True, None
            t = time.perf_counter()
            opt.step()
            if a.device == "cuda":
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - t)
            tm.on = False
        n_sub = len(opt.layout.subgroups)
        base = {**batch_columns(), "state_dtype": sd, "params": a.params_per_tensor * a.tensors,
                "subgroups": n_sub, "trace": a.trace, "step_s_median": round(statistics.median(steps), 5)}
        for part, ts in tm.t.items():
            rows.append({**base, "part": part, "calls": len(ts), "median_us": round(statistics.median(ts) * 1e6, 2),
                         "p90_us": round(sorted(ts)[int(0.9 * (len(ts) - 1))] * 1e6, 2),
                         "total_ms_per_step": round(sum(ts) / a.steps * 1e3, 3)})
            print(sd, part, rows[-1]["calls"], rows[-1]["median_us"], rows[-1]["total_ms_per_step"], flush=True)
        tm.undo()
        opt.close()
        del opt, ps
    append_script_rows(a.out, rows)


class _TimedCtx:
    """A context manager whose enter and exit are timed together as part `on`."""

    def __init__(self, ctx, tm):
        self._ctx, self._tm, self._dt = ctx, tm, 0.0

    def __enter__(self):
        t0 = time.perf_counter()
        out = self._ctx.__enter__()
        self._dt = time.perf_counter() - t0
        return out

    def __exit__(self, *exc):
        t0 = time.perf_counter()
        out = self._ctx.__exit__(*exc)
        if self._tm.on:
            self._tm.t["on"].append(self._dt + time.perf_counter() - t0)
        return out


class _Dst:
    """The upload's destination: its copy_ timed, everything else passed through."""

    def __init__(self, t, tm):
        self._t, self._tm = t, tm

    def copy_(self, src, non_blocking=False):
        t0 = time.perf_counter()
        out = self._t.copy_(src, non_blocking=non_blocking)
        if self._tm.on:
            self._tm.t["copy"].append(time.perf_counter() - t0)
        return out

    def __getattr__(self, k):
        return getattr(self._t, k)


if __name__ == "__main__":
    main()
