"""`python -m dos calibrate | bench | sweep | figures | run`. Few flags: experiments live in yaml files."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

_BENCH_EPILOG = """\
KEY=VALUE pairs are RunSpec fields (dos/lab/bench/spec.py), values parsed as YAML, e.g.
  python -m dos bench system=dos placement=interleaved stride=2 model=1.3B seq_len=2048
  python -m dos bench system=deepspeed-twinflow ratio=0.5 model=tiny device=cpu steps=3
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dos", description="Deep Optimizer States tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="run one configuration in its own process and record its row",
                       epilog=_BENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("pairs", nargs="+", metavar="KEY=VALUE")
    b.add_argument("--out", help="results directory (default experiments/results/bench)")
    b.add_argument("--timeout", type=float, default=900.0, help="seconds before the run is killed")
    s = sub.add_parser("sweep", help="run a yaml grid of configurations, resumably")
    s.add_argument("file", help="experiments/sweeps/NAME.yaml")
    s.add_argument("--out", help="results directory (default experiments/results/<name>)")
    s.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="only the runs whose field KEY equals VALUE or one of a [list] (repeatable), "
                        "e.g. model=3B or 'system=[dos, torch-gpu]'")
    s.add_argument("--dry-run", action="store_true", help="list the runs and preflight decisions only")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--allow-dirty", action="store_true",
                   help="run a headline sweep from a tree with uncommitted changes (trials; env DOS_ALLOW_DIRTY=1)")
    s.add_argument("--supersede", action="append", default=[], metavar="RUN_ID",
                   help="re-measure this recorded run (repeatable): rows are added, marked as superseding it")
    s.add_argument("--reason", help="why the --supersede rows are replaced (required with --supersede)")
    s.add_argument("--batch-id", help="name the batch (new, or continued on the same machine, e.g. a sweep "
                                      "longer than one device call; its rows' gpu_uuid and boot_id show whether "
                                      "it was): every run without a row of this batch runs, also where an older "
                                      "batch measured it; default: a new batch per invocation that runs only "
                                      "what no batch measured (a resume)")
    s.add_argument("--continue-batch", metavar="BATCH_ID",
                   help="like --batch-id, but refuse to start unless the results dir already holds rows "
                        "of that batch measured on this host since its last boot (a device call that "
                        "lost the previous call's results would otherwise start the batch over)")
    s.add_argument("--stop-by-s", type=float, metavar="SECONDS",
                   help="start no run expected to end later than this many seconds from now (a device "
                        "call's time left); the sweep resumes from there next time")
    for q in (b, s):
        q.add_argument("--host-memory-gib", type=float, help="host memory the preflight may plan for")
        q.add_argument("--pack", metavar="PATH.tar.gz", help="pack the results dir into one tar.gz (refreshed after every run)")
    c = sub.add_parser("calibrate", help="measure this machine's rates (python -m dos calibrate -h)",
                       add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    f = sub.add_parser("figures", help="execute the notebooks (papermill): every figure of DESIGN.md "
                                       "§6 into figures/, and figures/results.md")
    r = sub.add_parser("run", help="the main job: `figures` for every notebook; with --rerun (or env "
                                   "RERUN=1) the notebooks run their sweeps first (GPU machine)")
    for q in (f, r):
        q.add_argument("--rerun", action="store_true", help="run each notebook's sweep first (GPU machine)")
        q.add_argument("--smoke", action="store_true", help="run each notebook's tiny CPU sweep first")
        q.add_argument("--only", nargs="+", metavar="NN", help="only these notebooks (numbers or names)")
        q.add_argument("--figures", default="figures", help="where the PNG/SVG go (default figures/)")
        q.add_argument("--executed", help="where the executed notebooks go (default: beside the "
                                          "records each plots, <records>/notebooks/)")
        q.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                       help="with --rerun/--smoke: run only the sweep runs whose field KEY equals VALUE "
                            "or one of a [list] (repeatable; each notebook's WHERE parameter)")
    return p


def _pairs(pairs) -> dict:
    from dos.lab.bench.spec import ConfigError

    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"expected KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        out[k.strip()] = yaml.safe_load(v) if v.strip() else None
    return out


def _print_rows(csv_path: Path, run_ids) -> None:
    from dos.lab.bench.records import read_rows

    cols = ("status", "system", "placement", "stride", "ratio", "model", "iter_s", "fwd_s", "bwd_s",
            "step_s", "tokens_per_s", "peak_gpu_gib", "peak_host_gib", "error")
    for r in read_rows(csv_path):
        if r["run_id"] in run_ids:
            print("  ".join(f"{c}={r[c]}" for c in cols if r.get(c)))


def _figures(args) -> int:
    """`figures` and `run`: the notebooks through papermill (dos/lab/figures.py)."""
    from dos.lab import figures

    rerun = args.rerun or (args.cmd == "run" and os.environ.get("RERUN", "") not in ("", "0"))
    if rerun and args.smoke:
        print("error: --rerun and --smoke exclude each other", file=sys.stderr)
        return 2
    mode = "rerun" if rerun else "smoke" if args.smoke else "replot"
    return figures.main(mode, args.only, args.figures, args.executed, args.where)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:  # its own flags (argparse's REMAINDER drops leading options)
        from dos import calibrate

        return calibrate.main(argv[1:])
    args = _parser().parse_args(argv)
    if args.cmd in ("figures", "run"):
        return _figures(args)
    from dos.lab import sweep as sw
    from dos.lab.bench.spec import ConfigError, RunSpec

    try:
        if args.cmd == "bench":
            spec = RunSpec.from_dict(_pairs(args.pairs))
            sweep = sw.Sweep("bench", [spec], timeout_s=args.timeout)
            out = Path(args.out) if args.out else sw.default_out("bench")
            progress = False
        else:
            sweep = sw.load(args.file)
            sweep.runs = sw.select(sweep.runs, _pairs(args.where))
            if args.supersede:
                if not (args.reason or "").strip():
                    raise ConfigError("--supersede needs --reason (why the old rows are replaced)")
                sweep.supersedes = list(dict.fromkeys([*sweep.supersedes, *args.supersede]))
                sweep.supersede_reason = "; ".join(x for x in (sweep.supersede_reason, args.reason) if x)
            out = Path(args.out) if args.out else sw.default_out(sweep.name)
            progress = not args.no_progress
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    batch_id = getattr(args, "batch_id", None) or sw.new_batch_id()
    if getattr(args, "continue_batch", None):
        try:
            batch_id = sw.continued_batch(out, args.continue_batch)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        counts = sw.run(sweep, out, pack=args.pack, dry_run=getattr(args, "dry_run", False),
                        host_memory_gib=args.host_memory_gib, progress=progress,
                        allow_dirty=getattr(args, "allow_dirty", False), batch_id=batch_id,
                        stop_by_s=getattr(args, "stop_by_s", None),
                        within_batch=bool(getattr(args, "batch_id", None) or getattr(args, "continue_batch", None)))
    except sw.DirtyTree as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "dry_run", False):
        return 0
    summary = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
    print(f"{sweep.name}: {summary} -> {out / 'runs.csv'}, batch {batch_id}"
          + (f" (packed: {args.pack})" if args.pack else ""))
    if args.cmd == "bench":
        if counts.get("already"):
            print("already recorded in this directory (use another --out to run it again):")
        _print_rows(out / "runs.csv", {sweep.runs[0].run_id()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
