"""The engine's all-CPU step with the CPU lane's uploads on the helper thread or inline
(dos/uploads.py, DOS_UPLOAD_THREAD), fp32 and bf16-split state, on the device, in one process.

    python experiments/scripts/upload_thread_ab.py OUT.csv [--params-per-tensor N] [--tensors K]
        [--rounds R] [--steps S]

K bf16 parameters of N elements each (gradients set once, small random) per optimizer; the four
optimizers (thread on/off x fp32/bf16-split) step in round-robin rounds of S timed steps after
2 warm-up steps; rows (one per optimizer and round: median step seconds) append to OUT.csv with
$BATCH_ID, the GPU UUID and the boot id.
"""
import argparse, os, statistics, sys, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dos  # noqa: E402
from dos.lab.bench.records import append_script_rows, batch_columns  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--params-per-tensor", type=int, default=50_331_648)
    ap.add_argument("--tensors", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    opts = {}
    for thread in ("1", "0"):
        for sd in ("fp32", "bf16-split"):
            os.environ["DOS_UPLOAD_THREAD"] = thread  # read when the optimizer is built
            ps = [torch.nn.Parameter(torch.randn(a.params_per_tensor, device="cuda", dtype=torch.bfloat16) * 0.02)
                  for _ in range(a.tensors)]
            for p in ps:
                p.grad = torch.randn_like(p) * 1e-3
            opt = dos.DeepOptimizerStates(ps, lr=1e-4, placement="cpu", state_dtype=sd)
            assert (opt._lanes.uploader is not None) == (thread == "1")
            for _ in range(2):
                opt.step()
            opts[(thread, sd)] = opt
    torch.cuda.synchronize()
    base = {**batch_columns(), "params": a.params_per_tensor * a.tensors,
            "subgroups": len(next(iter(opts.values())).layout.subgroups)}
    rows = []
    for r in range(a.rounds):
        keys = list(opts)
        keys = keys[r % len(keys):] + keys[: r % len(keys)]  # rotate: none always first
        for k in keys:
            ts = []
            for _ in range(a.steps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                opts[k].step()
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
            rows.append({**base, "round": r, "upload_thread": k[0], "state_dtype": k[1],
                         "step_s_median": round(statistics.median(ts), 5), "step_s_min": round(min(ts), 5)})
            print(rows[-1]["round"], k, rows[-1]["step_s_median"], flush=True)
    append_script_rows(a.out, rows)


if __name__ == "__main__":
    main()
