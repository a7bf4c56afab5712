"""Figures: where each notebook's data comes from, the papermill driver behind `python -m dos run`,
and the README's results table.

Each notebook under notebooks/ makes one figure of DESIGN.md §6 in one of three modes, set in its
literal-only `parameters` cell (papermill injects values after it):

- replot (the default): plot the recorded rows under RESULTS; where none of those directories has
  an `ok` row yet, the smoke records under SMOKE_RESULTS (the caption then says so).
- RERUN=True: first run SWEEP into the first RESULTS directory (a list of sweeps: each into the
  RESULTS directory at its position) on a GPU machine; a sweep runs only the configurations missing
  there, so move that directory away to measure afresh; WHERE (a list of "KEY=VALUE" strings, as
  `python -m dos sweep --where`: `["model=1.3B", "system=[dos,torch-gpu]"]`) restricts it to a
  subset. Then plot.
- SMOKE=True: first run SMOKE_SWEEP (tiny model, CPU) into SMOKE_RESULTS, then plot that.

`python -m dos run` executes every notebook with papermill; each writes figures/NN-name.png and
.svg, its executed copy is kept with the records it plotted (<records dir>/notebooks/NN-name.ipynb),
and figures/results.md gets the results table.
"""
from __future__ import annotations

import ast
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from dos.lab import results as R

NOTEBOOKS = "notebooks"
MODES = ("replot", "rerun", "smoke")
TABLE = "results.md"


# ---------------------------------------------------------------- data sources of a notebook

def plotted(results, smoke_results=None, smoke: bool = False, rerun: bool = False) -> List[Path]:
    """The records a notebook plots (see the module docstring); nothing runs here."""
    if smoke:
        return [R.resolve(smoke_results)]
    dirs = R.as_paths(results)
    if rerun:
        return dirs
    recorded = [d for d in dirs if R.has_records(d)]
    if recorded or not smoke_results:
        return recorded or dirs
    return [R.resolve(smoke_results)]


def where_pairs(where) -> dict:
    """WHERE (a list of "KEY=VALUE" strings, as `python -m dos sweep --where`) -> {KEY: value}."""
    import yaml

    out = {}
    for pair in [where] if isinstance(where, str) else list(where or ()):
        if "=" not in pair:
            raise ValueError(f"WHERE: expected KEY=VALUE, got {pair!r}")
        k, v = pair.split("=", 1)
        out[k.strip()] = yaml.safe_load(v) if v.strip() else None
    return out


def run_sweep(sweep, out, where=()) -> dict:
    """Run the sweep file `sweep` into `out` (resumable), with a progress bar; `where` restricts it
    to the runs whose fields match (KEY=VALUE strings; VALUE may be a [list])."""
    from dos.lab import sweep as sw
    from dos.lab.bench.spec import ConfigError

    s = sw.load(R.resolve(sweep))
    pairs = where_pairs(where)
    if pairs:
        try:
            s.runs = sw.select(s.runs, pairs)
        except ConfigError as e:  # this sweep of several has none of the subset: nothing to run
            print(f"{R.relative(R.resolve(sweep))}: {e}; skipped", file=sys.stderr)
            return {}
    return sw.run(s, R.resolve(out), progress=True)


def prepare(results, smoke_results=None, sweep=None, smoke_sweep=None, rerun: bool = False,
            smoke: bool = False, where=()) -> List[Path]:
    """Run the notebook's sweep if its mode asks for it (only the runs matching `where`, a list of
    KEY=VALUE strings, when given); return the directories to plot."""
    if smoke:
        run_sweep(smoke_sweep, smoke_results, where)
    elif rerun:
        sweeps = [sweep] if isinstance(sweep, (str, Path)) else list(sweep)
        for path, out in zip(sweeps, R.as_paths(results)):
            run_sweep(path, out, where)
    return plotted(results, smoke_results, smoke=smoke, rerun=rerun)


def per_source(dirs, results, status=("ok",)) -> list:
    """The rows of each RESULTS directory, in its order, from the directories `prepare` returned
    (for a notebook that reads several sweeps, one panel each): a RESULTS directory not among
    `dirs` gives an empty frame, and smoke records (one directory that is none of RESULTS) stand
    for every one of them."""
    dirs, wanted = [R.resolve(d) for d in dirs], R.as_paths(results)
    if dirs and not set(dirs) & set(wanted):
        return [R.rows(dirs, status=status) for _ in wanted]
    return [R.rows([d], status=status) if d in dirs else R.rows([], status=status) for d in wanted]


def missing(dirs, results, sweeps) -> List[str]:
    """One line per RESULTS directory without `ok` records: the sweep that fills it."""
    have = {R.resolve(d) for d in dirs if R.has_records(d)}
    sweeps = [sweeps] if isinstance(sweeps, (str, Path)) else list(sweeps)
    return [f"no records yet in {R.relative(d)}: run `python -m dos sweep {sw} --out {R.relative(d)}` (GPU machine)"
            for d, sw in zip(R.as_paths(results), sweeps) if d not in have]


def prepare_calibration(results, smoke_results, rerun: bool = False, smoke: bool = False):
    """Figure 3's sources: (calibration json, kernel-benchmark dirs). RERUN measures this machine
    into a new file beside the recorded one; SMOKE measures a rough CPU-only profile."""
    from dos import calibrate

    paths = R.as_paths(results)
    calib, kernels = paths[0], paths[1:]
    if smoke:
        calib, kernels = R.resolve(smoke_results) / "calibration.json", []
        calibrate.main(["--quick", "--threads", "1,2", "--out", str(calib)])
    elif rerun:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        calib = calib.parent / f"{(calibrate.gpu_name() or 'cpu').replace(' ', '-')}-{stamp}.json"
        calibrate.main(["--out", str(calib)])
    return calib, kernels


def describe(dirs: Sequence[Path]) -> str:
    """One line saying what a figure was made from: H200 records or smoke data."""
    dirs = [Path(d) for d in dirs]
    names = ", ".join(d.name for d in dirs)
    if dirs and dirs[0].suffix == ".json":
        c = R.calibration(dirs[0]) if dirs[0].exists() else None
        gpu = c.gpu_name if c is not None else None
        return f"{gpu} calibration: {names}" if gpu else f"smoke data (CPU calibration): {names}"
    df = R.rows(dirs)
    if not len(df):
        return f"no records: {names}"
    m = R.machine(df)
    return f"smoke data (CPU, tiny model): {names}" if m["smoke"] else f"{m['gpu']} records: {names}"


# ---------------------------------------------------------------- notebooks

def notebooks(only: Optional[Sequence[str]] = None) -> List[Path]:
    """Source notebooks NN-name.ipynb, in order; `only`: numbers or names to keep ("7", "07-micro")."""
    found = sorted(R.resolve(NOTEBOOKS).glob("[0-9][0-9]-*.ipynb"))
    if only:
        want = {str(x).zfill(2) if str(x).isdigit() else str(x) for x in only}
        found = [p for p in found if p.name[:2] in want or p.stem in want or p.name in want]
    return found


def parameters_cells(nb) -> list:
    return [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]


def notebook_parameters(path) -> dict:
    """The literal values of a notebook's `parameters` cell (each statement `NAME = literal`)."""
    import nbformat

    cells = parameters_cells(nbformat.read(str(path), as_version=4))
    if len(cells) != 1:
        raise ValueError(f"{path}: {len(cells)} cells tagged 'parameters', expected 1")
    out = {}
    for stmt in ast.parse(cells[0].source).body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)):
            raise ValueError(f"{path}: the parameters cell may hold only `NAME = literal` lines")
        out[stmt.targets[0].id] = ast.literal_eval(stmt.value)
    return out


def sources(path, mode: str = "replot", overrides: Optional[dict] = None) -> List[Path]:
    """The records notebook `path` will plot in `mode`, from its parameters (and `overrides`)."""
    p = {**notebook_parameters(path), **(overrides or {})}
    return plotted(p.get("RESULTS"), p.get("SMOKE_RESULTS"), smoke=mode == "smoke", rerun=mode == "rerun")


def execute(path, mode: str = "replot", figures: str = "figures", executed: Optional[str] = None,
            overrides: Optional[dict] = None, log_output: bool = False) -> Path:
    """Run one notebook through papermill; return its executed copy (by default kept with the
    records it plots: <records dir>/notebooks/<name>.ipynb)."""
    import papermill as pm

    path = Path(path)
    params = {"RERUN": mode == "rerun", "SMOKE": mode == "smoke", "FIGURES": str(figures),
              **(overrides or {})}
    if executed:
        out_dir = R.resolve(executed)
    else:
        first = sources(path, mode, overrides)[0]
        out_dir = (first.parent if first.is_file() else first) / "notebooks"
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / path.name
    try:
        pm.execute_notebook(str(path), str(dest), parameters=params, kernel_name="python3",
                            cwd=str(R.repo_root()), progress_bar=False, log_output=log_output,
                            extra_arguments=["--log-level=ERROR"])  # the kernel's TCP notice: noise
    finally:
        if dest.exists():
            strip_timestamps(dest)
    return dest


def strip_timestamps(path) -> None:
    """Make an executed notebook depend on its inputs only: papermill's and the kernel's clock
    (start/end times, durations, execution timestamps) and this checkout's absolute paths go, and a
    cell's consecutive stream outputs of one name become one (how the kernel chunks a cell's
    printing depends on timing: a fresh clone's `make run` split one verdict line in two), so
    that replotting unchanged records leaves the kept copies byte-identical."""
    import nbformat

    path = Path(path)
    nb = nbformat.read(str(path), as_version=4)
    pm_meta = nb.metadata.get("papermill", {})
    for key in ("start_time", "end_time", "duration"):
        pm_meta.pop(key, None)
    for key in ("input_path", "output_path"):
        if key in pm_meta:
            pm_meta[key] = R.relative(pm_meta[key])
    for cell in nb.cells:
        if "injected-parameters" in cell.metadata.get("tags", []):
            cell["id"] = "injected-parameters"  # papermill gives it a random id
        cell.metadata.pop("execution", None)
        for key in ("start_time", "end_time", "duration"):
            cell.metadata.get("papermill", {}).pop(key, None)
        if "outputs" in cell:
            cell["outputs"] = merged_streams(cell["outputs"])
    nbformat.write(nb, str(path))


def merged_streams(outputs: list) -> list:
    """`outputs` with each run of consecutive stream outputs of one name (stdout, stderr) joined."""
    out = []
    for o in outputs:
        if (out and o.get("output_type") == "stream" and out[-1].get("output_type") == "stream"
                and out[-1].get("name") == o.get("name")):
            out[-1]["text"] = "".join(out[-1]["text"]) + "".join(o["text"])
        else:
            out.append(o)
    return out


def run_all(mode: str = "replot", only=None, figures: str = "figures", executed: Optional[str] = None,
            overrides: Optional[dict] = None, table: bool = True) -> int:
    """Execute every notebook (progress bar, one line each), then write the results table.
    Returns the number of notebooks that failed."""
    from tqdm import tqdm

    nbs = notebooks(only)
    failed = []
    bar = tqdm(nbs, unit="notebook", file=sys.stderr, dynamic_ncols=True)
    for nb in bar:
        bar.set_description(nb.stem)
        t0 = time.perf_counter()
        try:
            dest = execute(nb, mode, figures, executed, overrides, log_output=mode == "rerun")
            src = describe(sources(nb, mode, overrides))
            bar.write(f"{nb.stem}: {time.perf_counter() - t0:4.1f} s  {src}  -> "
                      f"{R.relative(R.resolve(figures) / nb.stem)}.png/.svg, {R.relative(dest)}")
        except Exception as e:  # papermill keeps the failing copy: report and go on
            failed.append(nb.stem)
            bar.write(f"{nb.stem}: FAILED ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})")
    if table:
        bar.write(f"results table -> {R.relative(write_results_table(R.resolve(figures) / TABLE))}")
    if failed:
        bar.write("failed: " + ", ".join(failed))
    return len(failed)


# ---------------------------------------------------------------- the results table

def results_table(root="experiments/results") -> str:
    """Markdown: every system in its default configuration, per model, from the GPU rows
    (status ok) of every runs.csv under `root`; then the runs under a GPU memory cap (the paper's
    regime), one per system and setting (plots.one_per_point: the rule figure 9 plots by)."""
    import numpy as np
    import pandas as pd

    from dos.lab.plots import one_per_point

    dirs = sorted(p.parent for p in R.resolve(root).glob("*/runs.csv"))
    df = R.rows(dirs)
    df = df[~df["smoke"] & df["gpu_name"].fillna("").ne("")]
    capped = df[df.index.isin(R.defaults_only(df.assign(gpu_mem_cap_gib=np.nan)).index)
                & df["gpu_mem_cap_gib"].notna()]
    capped = one_per_point(capped, by=("key", "model", "gpu_mem_cap_gib", "ratio", "gpu_fraction"))
    rank = {k: i for i, k in enumerate(R.ORDER)}
    capped = capped.assign(_r=capped["key"].map(lambda k: rank.get(k, len(R.ORDER)))).sort_values(
        ["n_params", "gpu_mem_cap_gib", "_r", "ratio"]).drop(columns="_r")
    df = pd.concat([R.headline(df), capped])
    lines = [f"<!-- generated by `python -m dos run` from {root}/*/runs.csv; do not edit -->",
             "", "| model | GPU cap | micro-batch | system | state | s/iter | fwd / bwd / update (s) | tokens/s "
             "| peak GPU (GiB) | peak host (GiB) | GPU | date | records |",
             "|---|---:|---:|---|---|---:|---|---:|---:|---:|---|---|---|"]
    # Single runs of different batches and machines: no ratio between them (issue 16). Ratios
    # stand only in headline_section's table, within one batch and over >= 3 runs each.
    for (model, cap), g in df.groupby(["model", df["gpu_mem_cap_gib"].fillna(0)], sort=False):
        for _, r in g.iterrows():
            lines.append(
                f"| {model} | {f'{cap:g} GiB' if cap else 'none'} | {int(r['micro_batch'])} | {_system(r)} | "
                f"{r['state_dtype']} | {r['iter_s']:.3f} | {r['fwd_s']:.2f} / {r['bwd_s']:.2f} / "
                f"{r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {_num(r['peak_gpu_gib'])} | "
                f"{_num(r['peak_host_gib'])} | {r['gpu_name']} | {r['date']} | "
                f"{Path(r['results_dir']).name}/{r['run_id']} |")
    if not len(df):
        lines.append("| (no GPU records yet) ||||||||||||")
    return "\n".join(lines) + "\n" + headline_section(dirs)


HEADLINE_SWEEPS = ("headline-1.3b", "headline-3b", "headline-3b-fp32", "headline-5b", "headline-5b-fp32")


def headline_section(dirs) -> str:
    """Markdown: the headline batches (issue 16's protocol: every system >= 3 times round-robin in
    one batch), from the `headline-*` records among `dirs`, by `results.batch_table`: medians,
    min-max, and ratios to the fastest offload baseline of equal state precision within the batch
    only; or which sweeps are still to run."""
    head = ["", "Headline batches (each system 3 times, round-robin, one machine; ratios within the batch "
            "against the fastest offload baseline of the same optimizer-state precision):", ""]
    dirs = [d for d in dirs if Path(d).name.startswith("headline")]
    df = R.rows(dirs) if dirs else None
    if df is not None:
        df = df[~df["smoke"] & df["gpu_name"].fillna("").ne("") & df["batch_id"].fillna("").ne("")]
    if df is None or not len(df):
        sweeps = ", ".join(f"`experiments/sweeps/{s}.yaml`" for s in HEADLINE_SWEEPS)
        return "\n".join(head + [f"(none recorded yet: {sweeps})"]) + "\n"
    return "\n".join(head) + "\n" + R.batch_table(df)


def _system(r) -> str:
    import pandas as pd

    from dos.lab.plots import label

    extra = []
    if r["system"] == "dos" and r["placement"] == "interleaved":
        k, auto = r["plan_stride"], r["stride"] == "auto"
        chosen = "the model's choice" if pd.notna(r["plan_predicted_s"]) else "a fixed default"
        extra.append(f"stride {r['stride']}" + (f" (k={int(k)}, {chosen})" if auto and pd.notna(k) else ""))
    if r["key"] in ("dos-static", "deepspeed-twinflow"):
        extra.append(f"GPU share {r['gpu_fraction']:g}" if r["system"] == "dos" else f"ratio {r['ratio']:g}")
    return label(r["key"]) + (f", {', '.join(extra)}" if extra else "")


def _num(x) -> str:
    return "" if x != x or x is None else f"{x:.1f}"


README_BLOCK = ("<!-- results:begin -->", "<!-- results:end -->")


def write_results_table(path, readme="README.md") -> Path:
    """The table into `path`, and into the README between its README_BLOCK markers (if any)."""
    path = R.resolve(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = results_table()
    path.write_text(table)
    readme = R.resolve(readme)
    if readme.exists():
        text, (begin, end) = readme.read_text(), README_BLOCK
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            readme.write_text(f"{head}{begin}\n{table}{end}{rest.split(end, 1)[1]}")
    return path


def main(mode: str = "replot", only=None, figures: str = "figures", executed: Optional[str] = None,
         where=()) -> int:
    """`python -m dos run`: every figure and the results table; exit status 1 if a notebook failed.
    `where` (KEY=VALUE strings) becomes each notebook's WHERE: its sweep runs only those runs."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    t0 = time.perf_counter()
    failed = run_all(mode, only, figures, executed, overrides={"WHERE": list(where)} if where else None)
    print(f"figures: {len(notebooks(only)) - failed} notebooks ok, {failed} failed "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 1 if failed else 0
