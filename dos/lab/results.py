"""Recorded results -> tidy pandas DataFrames (DESIGN.md §5), for the figures.

Everything reads what `dos.lab.sweep` wrote under `experiments/results/<sweep>/`: `runs.csv` (one row per
run), `env.json`, and each run's folder (`steps.csv`, `markers.csv`, `samples.csv[.gz]`, `lanes.json[.gz]`).
Figures are built from rows with `status == ok` only; other rows are loaded only to mark where a
configuration failed (an OOM in the micro-batch sweep), never for a number.

Relative paths are taken from the repository root (the folder holding `experiments/` beside the
`dos` package; the working directory otherwise), so notebooks run from `notebooks/` or the root alike.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

import pandas as pd

from dos.lab.bench import records

NUMERIC = ("gpu_fraction", "ratio", "n_params", "seq_len", "micro_batch", "gpus", "gpu_mem_cap_gib",
           "host_mem_gib", "iter_s", "fwd_s", "bwd_s", "step_s", "tokens_per_s", "peak_gpu_gib",
           "peak_host_gib", "predicted_step_s", "loss_first", "loss_last", "iter_s_min", "iter_s_max",
           "peak_gpu_reserved_gib", "peak_gpu_nvml_gib", "host_bytes_per_param", "warmup", "steps")
_GIB = 2**30
ORDER = ("dos-interleaved", "dos-interleaved-overlap", "dos-auto", "dos-auto-overlap", "dos-static",
         "dos-cpu", "dos-cpu-overlap", "dos-gpu", "torch-gpu", "torch-cpu",
         "deepspeed-zero2-offload", "deepspeed-zero2-offload-bf16", "deepspeed-zero3-offload",
         "deepspeed-zero-offload", "deepspeed-twinflow", "deepspeed-superoffload", "deepspeed-zero3",
         "torchao-cpu-offload")
"""Every system key, in the order figures and tables list them."""
Paths = Union[str, Path, Sequence[Union[str, Path]]]
def require_rows(df, what: str) -> None:
    if df is None or not len(df):
        raise ValueError(f"{what}: empty input (no rows to check)")


def repo_root() -> Path:
    here = Path(__file__).resolve().parents[2]
    return here if (here / "experiments").is_dir() else Path.cwd()


def resolve(path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else repo_root() / p


def relative(path) -> str:
    """`path` relative to the repository root when inside it (what notebooks print)."""
    try:
        return str(Path(path).resolve().relative_to(repo_root()))
    except ValueError:
        return str(path)


def as_paths(paths: Paths) -> List[Path]:
    if paths is None:
        return []
    if isinstance(paths, (str, Path)):
        paths = [paths]
    return [resolve(p) for p in paths]


def has_records(path: Path) -> bool:
    """A results directory with at least one `ok` row, or an existing file (a calibration)."""
    path = resolve(path)
    if path.is_file():
        return True
    return any(r.get("status") == "ok" for r in records.read_rows(path / "runs.csv"))


# ---------------------------------------------------------------- rows

def system_key(system: str, placement: Optional[str], gpu_fraction=None, overlap: bool = False) -> str:
    """The colour key of a row: `dos-auto` for dos with gpu_fraction "auto" (the model sizes the
    resident share), `dos-<placement>` for other dos rows, the system name otherwise; dos with
    the CPU lane overlapped with backward gets "-overlap" appended."""
    if system == "dos" and gpu_fraction == "auto":
        key = "dos-auto"
    else:
        key = f"dos-{placement}" if system == "dos" and placement else system
    return key + "-overlap" if system == "dos" and overlap else key


def _plan_fields(text: str) -> dict:
    plan = json.loads(text) if isinstance(text, str) and text.startswith("{") else {}
    return {"plan_stride": plan.get("stride"), "n_subgroups": plan.get("n_subgroups"),
            "plan_subgroup_numel": plan.get("subgroup_numel"), "resident_fraction":
            plan.get("resident_fraction"), "gpu_share": plan.get("gpu_share"),
            "cpu_threads": plan.get("cpu_threads"), "staging_slots": plan.get("staging_slots"),
            "plan_predicted_s": plan.get("predicted_step_s")}


SPEC_KNOBS = ("subgroup_numel", "cpu_threads", "staging_slots", "max_grad_norm", "overlap_backward", "grad_ring")
"""Run settings outside the defaults that `headline` leaves out (from the row's config.run)."""


def _spec_fields(text: str) -> dict:
    run = (json.loads(text).get("run") or {}) if isinstance(text, str) and text.startswith("{") else {}
    return {f"spec_{k}": run.get(k) for k in SPEC_KNOBS}


def _run_field(text: str, name: str):
    """Field `name` of the RunSpec recorded in a row's config (None where absent)."""
    run = (json.loads(text).get("run") or {}) if isinstance(text, str) and text.startswith("{") else {}
    return run.get(name)


def _derive(df: pd.DataFrame) -> pd.DataFrame:
    fractions = df["gpu_fraction"] if "gpu_fraction" in df else [None] * len(df)
    specs = [_spec_fields(c) for c in df["config"]]
    df["key"] = [system_key(s, p or None, f, sp["spec_overlap_backward"] is True)
                 for s, p, f, sp in zip(df["system"], df["placement"], fractions, specs)]
    for c in NUMERIC:  # after the key: gpu_fraction "auto" is no number
        if c in df:
            df[c] = pd.to_numeric(df[c].replace("", None), errors="coerce")
    plan = pd.DataFrame([{**_plan_fields(p), **sp} for p, sp in zip(df["plan"], specs)],
                        index=df.index, columns=[*_plan_fields(""), *_spec_fields("")])
    df = pd.concat([df, plan.apply(pd.to_numeric, errors="coerce")], axis=1)
    if "state_dtype" not in df:
        df["state_dtype"] = ""
    implied = [(_run_field(c, "moments") or "fp32" if s == "dos" else
                "bf16" if s == "deepspeed-zero2-offload-bf16" or (s == "torchao-cpu-offload" and d == "bf16")
                else "fp32") for s, d, c in zip(df["system"], df["dtype"] if "dtype" in df else [""] * len(df),
                                                 df["config"])]
    df["state_dtype"] = [x if isinstance(x, str) and x else i for x, i in zip(df["state_dtype"], implied)]
    for c in ("batch_id", "gpu_uuid", "boot_id"):
        df[c] = df[c].fillna("") if c in df else ""
    df["repeat"] = pd.to_numeric(df["repeat"].replace("", None), errors="coerce") if "repeat" in df else float("nan")
    df["config_id"] = [_config_id(c, r) for c, r in zip(df["config"], df["run_id"])]
    df["smoke"] = df["device"].eq("cpu")
    df["params_b"] = df["n_params"] / 1e9
    df["date"] = df["timestamp"].str[:10]
    df["cpu_state_share"] = [_cpu_share(r) for r in df.itertuples()]
    df["gpu_bytes_per_param"] = df["peak_gpu_gib"] * _GIB / df["n_params"]
    df["host_bytes_per_param_peak"] = df["peak_host_gib"] * _GIB / df["n_params"]
    return df


def _config_id(text: str, run_id: str) -> str:
    """The run_id the row's configuration has without its repetition index (repeats of one
    configuration share it; a row without a recorded configuration keeps its run_id)."""
    run = (json.loads(text).get("run") or {}) if isinstance(text, str) and text.startswith("{") else {}
    if not run:
        return run_id
    run = {k: v for k, v in run.items() if v is not None and k != "repeat"}
    import hashlib

    blob = json.dumps(run, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _cpu_share(r) -> float:
    """Share of the optimizer state kept in host memory (TwinFlow's ratio, dos' non-resident share)."""
    if r.system == "dos":
        return 1.0 - (r.resident_fraction if pd.notna(r.resident_fraction) else
                      (1.0 if r.placement == "gpu" else r.gpu_fraction or 0.0))
    if r.system.startswith("deepspeed") and r.system != "deepspeed-zero3":
        return float(r.ratio) if pd.notna(r.ratio) else 1.0
    return 1.0 if r.system == "torchao-cpu-offload" else 0.0


def rows(dirs: Paths, status: Iterable[str] = ("ok",)) -> pd.DataFrame:
    """Rows of every `runs.csv` under `dirs` with one of `status`, the latest per run_id and batch_id
    (the same configuration recorded in two sweeps counts once: its latest measurement; in two
    batches, once per batch), without rows a later row supersedes (`superseded`)."""
    frames = []
    for d in as_paths(dirs):
        recs = records.read_rows(d / "runs.csv") if d.is_dir() else []
        if recs and "system" in recs[0]:  # kernel benchmarks have rows of their own schema
            frames.append(pd.DataFrame(recs).assign(results_dir=str(d)))
    if not frames:
        return _derive(pd.DataFrame(columns=[*records.COLUMNS, "results_dir", "superseded"]))
    df = pd.concat(frames, ignore_index=True)
    for c in records.COLUMNS:  # rows of an older schema
        if c not in df:
            df[c] = ""
    df = df.fillna({c: "" for c in records.COLUMNS})
    df["superseded"] = superseded(df)
    df = df[df["status"].isin(list(status)) & ~df["superseded"]]
    # one row per run_id and batch (rows before the protocol have no batch_id: one per run_id)
    df = df.sort_values("timestamp", kind="stable").drop_duplicates(["run_id", "batch_id"], keep="last")
    return _derive(df.reset_index(drop=True))


def superseded(df: pd.DataFrame) -> pd.Series:
    """Whether each row is superseded: a later row (by timestamp) names its run_id in `supersedes`
    (a re-run marks the rows it replaces; they stay in runs.csv, and readers ignore them)."""
    marks = {}  # run_id -> latest timestamp of a row superseding it
    if "supersedes" in df:
        for ids, t in zip(df["supersedes"], df["timestamp"]):
            for rid in str(ids or "").split(";"):
                if rid.strip():
                    marks[rid.strip()] = max(marks.get(rid.strip(), ""), str(t))
    # A run that did not finish (skipped for want of memory, failed, timed out) is superseded by a
    # later ok row of the same run_id: the sweep re-ran it on resume, in whichever batch.
    ok_at = df[df["status"] == "ok"].groupby("run_id")["timestamp"].max().astype(str).to_dict() \
        if "status" in df else {}
    return pd.Series([(r in marks and str(t) < marks[r]) or (st != "ok" and str(t) < ok_at.get(r, ""))
                      for r, t, st in zip(df["run_id"], df["timestamp"], df.get("status", ["ok"] * len(df)))],
                     index=df.index, dtype=bool)


def defaults_only(df: pd.DataFrame) -> pd.DataFrame:
    """Rows at the default settings but for the placement knobs: stride "auto" for dos interleaved,
    dos with fp32 moments, the smallest micro-batch, synthetic data, no GPU memory cap, no other knob set."""
    keep = ((df["stride"].isin(["auto", ""]) | df["stride"].isna())
            & (df["system"].ne("dos") | df["state_dtype"].eq("fp32"))  # issue 17: fp32 moments
            & df["gpu_mem_cap_gib"].isna() & df["data"].isin(["synthetic", ""])
            & df[[f"spec_{k}" for k in SPEC_KNOBS]].isna().all(axis=1)
            & (df["micro_batch"] == df["micro_batch"].min()))
    return df[keep]


def headline(df: pd.DataFrame, side_by_side: str = "deepspeed-zero-offload") -> pd.DataFrame:
    """Each system in its default configuration (what a user gets): `defaults_only`, dos static and
    TwinFlow at 0.5; one run per (system, model): from the results directory of that model's latest
    `side_by_side` run where it has one (ratios only side by side: one call, one machine), else the
    latest; by model size and `ORDER`."""
    df = defaults_only(df)
    keep = ((df["ratio"].isna() | df["ratio"].isin([0.5, 1.0]))
            & (df["gpu_fraction"].isna() | df["gpu_fraction"].isin([0.0, 0.5])))
    df = df[keep].sort_values("timestamp")
    base = df[df["key"] == side_by_side].groupby("model")["results_dir"].last()
    df = df.assign(_side=[base.get(m) == d for m, d in zip(df["model"], df["results_dir"])])
    out = df.sort_values(["_side", "timestamp"]).drop_duplicates(["key", "model"], keep="last").drop(columns="_side")
    rank = {k: i for i, k in enumerate(ORDER)}
    return out.assign(_r=out["key"].map(lambda k: rank.get(k, len(ORDER)))).sort_values(
        ["n_params", "_r"]).drop(columns="_r")


def kernel_rows(dirs: Paths) -> pd.DataFrame:
    """CPU-kernel benchmark rows (dos.lab.bench.kernel: impl, threads, gparams_per_s, ...)."""
    frames = [pd.DataFrame(records.read_rows(d / "runs.csv")) for d in as_paths(dirs) if d.is_dir()]
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=["impl", "threads", "gparams_per_s", "gbytes_per_s", "params", "status"])
    df = pd.concat(frames, ignore_index=True)
    df = df[df["status"] == "ok"].copy()
    for c in ("threads", "gparams_per_s", "gbytes_per_s", "params"):
        df[c] = pd.to_numeric(df[c].replace("", None), errors="coerce")
    return df


# ---------------------------------------------------------------- provenance

def env(results_dir) -> dict:
    path = resolve(results_dir) / "env.json"
    return json.loads(path.read_text()) if path.exists() else {}


def machine(df: pd.DataFrame) -> dict:
    """GPU, CPU and dates of the rows in `df` (env.json of their results directories)."""
    dirs = list(dict.fromkeys(df["results_dir"])) if len(df) else []
    envs = [env(d) for d in dirs]
    cpus = {f"{e['cpu']['model']} ({e['cpu']['logical_cores']} cores)" for e in envs if e.get("cpu")}
    gpus = sorted({g for g in df["gpu_name"].dropna() if g}) if len(df) else []
    dates = sorted(df["date"].dropna()) if len(df) else []
    return {"gpu": ", ".join(gpus) or None, "cpu": ", ".join(sorted(cpus)) or None,
            "first": dates[0] if dates else None, "last": dates[-1] if dates else None,
            "smoke": bool(len(df)) and bool(df["smoke"].all()),
            "sources": [Path(d).name for d in dirs]}


# ---------------------------------------------------------------- per-run files

def run_file(row, column: str) -> Optional[Path]:
    name = row.get(column) if isinstance(row, dict) else getattr(row, column, None)
    if not isinstance(name, str) or not name:
        return None
    path = Path(row["results_dir"] if isinstance(row, dict) else row.results_dir) / name
    return records.stored(path)  # as named, or its .gz (a trace stored compressed)


def steps(df: pd.DataFrame, keep: Sequence[str] = ("run_id", "key", "model", "system")) -> pd.DataFrame:
    """Per-step times and losses (steps.csv) of every row in `df`, with `keep` columns attached."""
    frames = []
    for _, r in df.iterrows():
        path = run_file(r, "steps_file")
        if path is not None:
            s = pd.read_csv(path)
            frames.append(s.assign(**{k: r[k] for k in keep}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def trace(row) -> tuple:
    """(samples, markers) DataFrames of one run: the NVML/host-memory trace and its phases."""
    samples = run_file(row, "samples_file")
    markers = run_file(row, "markers_file")
    s = pd.read_csv(samples) if samples else pd.DataFrame(columns=["t_s"])
    m = pd.read_csv(markers) if markers else pd.DataFrame(columns=["phase", "step", "start_s", "end_s"])
    return s, m


def lanes(row) -> pd.DataFrame:
    """The per-subgroup lane events of every traced step of one run (seconds from `opt.step()`)."""
    path = run_file(row, "lanes_file") if row is not None else None
    if path is None:
        return pd.DataFrame(columns=["step", "lane", "subgroup", "numel", "start_s", "end_s"])
    return pd.DataFrame([e for x in json.loads(records.read_text(path)) for e in x["events"]])


# ---------------------------------------------------------------- the performance model

def calibration(path):
    from dos.perfmodel import Calibration

    return Calibration.from_json(resolve(path).read_text())


def plan_of(row):
    """The Plan a dos row ran, rebuilt from its `plan` record (lanes, sizes, threads, slots).

    Subgroups are equal (`subgroup_numel`) but the last, which holds the rest of `n_params` (the
    presets' tensors are multiples of the 64-element alignment, so there is no padding)."""
    from dos.plan import CPU, RESIDENT, STAGED, Plan

    rec = json.loads(row["plan"])
    n, sg, total = rec["n_subgroups"], rec["subgroup_numel"], int(row["n_params"])
    numels = tuple([sg] * (n - 1) + [total - sg * (n - 1)])
    lanes_ = tuple({"c": CPU, "s": STAGED, "r": RESIDENT}[c] for c in rec["lanes"])
    rest = [i for i in reversed(range(n)) if lanes_[i] != RESIDENT]  # gradient-ready order
    return Plan(placement=rec["placement"], stride=rec.get("stride"), lanes=lanes_, numels=numels,
                cpu_order=tuple(i for i in rest if lanes_[i] == CPU),
                staged_order=tuple(i for i in rest if lanes_[i] == STAGED),
                cpu_threads=rec["cpu_threads"], staging_slots=rec["staging_slots"])


def predictions(df: pd.DataFrame, calib) -> pd.DataFrame:
    """`df` (dos rows) with `predicted_s` (the recorded prediction where the run made one, else
    `perfmodel.predict` of its rebuilt plan under `calib`) and `predicted_src` saying which.
    Runs on the CPU device get no computed prediction (a GPU calibration does not describe them)."""
    from dos.perfmodel import predict

    out = df.copy()
    computed = [predict(plan_of(r), calib).total_s if r["device"] == "cuda" else float("nan")
                for _, r in out.iterrows()]
    recorded = out["predicted_step_s"]
    out["predicted_s"] = recorded.where(recorded.notna(), pd.Series(computed, index=out.index))
    out["predicted_src"] = ["recorded" if pd.notna(x) else "computed" for x in recorded]
    out["computed_s"] = computed
    return out


def stride_panels(dfp: pd.DataFrame) -> pd.DataFrame:
    """The stride-sweep rows of `predictions(...)` output, one panel per (model, GPU cap): dos
    interleaved at a stride (or "auto" without a resident share) and all-CPU, from the sweep that
    holds the most of them for that panel (a dedicated stride sweep wins over stray runs)."""
    d = dfp[dfp["placement"].isin(["interleaved", "cpu"]) & dfp["key"].ne("dos-auto")].copy()
    d["panel"] = [m + (f", GPU capped at {c:g} GiB" if c == c else "") for m, c in
                  zip(d["model"], d["gpu_mem_cap_gib"])]
    d["sweep_rows"] = d.groupby(["panel", "results_dir"])["run_id"].transform("count")
    return d[d["sweep_rows"] == d.groupby("panel")["sweep_rows"].transform("max")]


NO_OFFLOAD = ("torch-gpu", "torch-cpu")  # the no-offload baselines, the GPU one first


def baseline_key(keys, baselines: Sequence[str] = NO_OFFLOAD) -> Optional[str]:
    """The first of `baselines` among `keys` (None when none is)."""
    present = set(keys)
    return next((k for k in baselines if k in present), None)


HEADLINE_RUNS = 3  # issue 16: a headline number is a median over at least this many runs per system
OFFLOAD_BASELINES = ("deepspeed-zero2-offload", "deepspeed-zero2-offload-bf16", "deepspeed-zero3-offload",
                     "deepspeed-zero-offload", "deepspeed-twinflow", "deepspeed-superoffload",
                     "torchao-cpu-offload")
"""The offload systems dos is compared against (torch without offload is a reference, not one)."""
GROUP = ("batch_id", "model", "key", "config_id")


def summary(df: pd.DataFrame, value: str = "iter_s") -> pd.DataFrame:
    """Per (batch_id, model, system key, configuration): the median, min and max of `value` over
    its repeats (`runs` of them), the state precision, GPUs and hosts (boot ids) it ran on, and
    its label. Rows with status ok only; raises on empty input."""
    require_rows(df, "summary")
    d = df[df["status"].eq("ok")] if "status" in df else df
    require_rows(d, "summary (status ok)")
    out = []
    for (batch, model, key, cfg), g in d.groupby(list(GROUP), sort=False):
        v = g[value].astype(float)
        r = g.iloc[0]
        out.append({"batch_id": batch, "model": model, "key": key, "config_id": cfg,
                    "state_dtype": r["state_dtype"], "ratio": r.get("ratio"), "runs": len(g),
                    "median": v.median(), "min": v.min(), "max": v.max(),
                    "gpus": ", ".join(sorted(set(g["gpu_uuid"]) - {""})),
                    "hosts": ", ".join(sorted(set(g["boot_id"]) - {""})), "n_params": r["n_params"],
                    "run_ids": ", ".join(g["run_id"])})
    rank = {k: i for i, k in enumerate(ORDER)}
    return pd.DataFrame(out).assign(_r=lambda t: t["key"].map(lambda k: rank.get(k, len(ORDER)))).sort_values(
        ["batch_id", "n_params", "_r"], kind="stable").drop(columns="_r").reset_index(drop=True)


def ratio(summ: pd.DataFrame, key: str, baseline: str, model: Optional[str] = None) -> float:
    """median(`key`) / median(`baseline`) from `summary` rows, only within one batch: raises
    ValueError when the two come from different batches (or from rows without a batch_id:
    recorded before the protocol), or when either is missing or ambiguous."""
    s = summ if model is None else summ[summ["model"].eq(model)]
    a, b = s[s["key"].eq(key)], s[s["key"].eq(baseline)]
    if len(a) != 1 or len(b) != 1:
        raise ValueError(f"ratio {key} / {baseline}: need one summary row each, got {len(a)} and {len(b)} "
                         "(select one batch and model first)")
    ba, bb = a["batch_id"].iloc[0], b["batch_id"].iloc[0]
    if not ba or not bb or ba != bb:
        raise ValueError(f"ratio {key} / {baseline}: not within one batch ({ba or 'no batch_id'} against "
                         f"{bb or 'no batch_id'}); ratios are taken only within one batch")
    return float(a["median"].iloc[0] / b["median"].iloc[0])


INTERLEAVED = ("dos-interleaved", "dos-interleaved-overlap")
"""dos interleaved without resident state, its CPU lane started in step() or during backward
(issue 16 criterion 2's row)."""
DOS_HEADLINE = ("dos-interleaved", "dos-interleaved-overlap", "dos-auto", "dos-auto-overlap", "dos-cpu",
                "dos-cpu-overlap")
"""The dos rows of a headline batch, in the CPU lane's two starts (step() or during backward)."""


def headline_ratios(df: pd.DataFrame, keys: Sequence[str] = DOS_HEADLINE,
                    baselines: Sequence[str] = OFFLOAD_BASELINES) -> pd.DataFrame:
    """Per batch and model, each of `keys` (median over its repeats) against the fastest of
    `baselines` (by median) with the same optimizer-state precision, named; with the ranges.
    Rows without a batch_id (recorded before the protocol) are left out. Raises on empty input."""
    summ = summary(df)
    summ = summ[summ["batch_id"].ne("")]
    out = []
    for (batch, model), g in summ.groupby(["batch_id", "model"], sort=False):
        for _, r in g[g["key"].isin(keys)].iterrows():
            base = g[g["key"].isin(baselines) & g["state_dtype"].eq(r["state_dtype"])]
            if not len(base):
                continue
            b = base.loc[base["median"].idxmin()]
            out.append({"batch_id": batch, "model": model, "key": r["key"], "state_dtype": r["state_dtype"],
                        "median_s": r["median"], "range_s": f"{r['min']:.3f}-{r['max']:.3f}", "runs": r["runs"],
                        "baseline": b["key"], "baseline_label": _label(b["key"]),
                        "baseline_median_s": b["median"], "baseline_range_s": f"{b['min']:.3f}-{b['max']:.3f}",
                        "baseline_runs": b["runs"], "vs_baseline": r["median"] / b["median"]})
    return pd.DataFrame(out)


def _label(key: str) -> str:
    try:
        from dos.lab.plots import label
    except ImportError:  # plotting libraries absent: the key names it
        return key
    return label(key)


def batch_table(df: pd.DataFrame) -> str:
    """Markdown: per batch and model, every system's median s/iter with its min-max and runs, and
    each row's ratio to the fastest offload baseline of its state precision (named) within the
    batch, flagged where either side has fewer than `HEADLINE_RUNS` runs; rows without a batch_id
    are left out."""
    summ = summary(df)
    summ = summ[summ["batch_id"].ne("")]
    lines = ["| batch | model | system | state | runs | median s/iter | min-max | vs fastest offload baseline (same state precision) |",
             "|---|---|---|---|---:|---:|---|---|"]
    for (batch, model), g in summ.groupby(["batch_id", "model"], sort=False):
        for _, r in g.iterrows():
            base = g[g["key"].isin(OFFLOAD_BASELINES) & g["state_dtype"].eq(r["state_dtype"])]
            vs = ""
            if len(base):
                b = base.loc[base["median"].idxmin()]
                vs = (f"(the fastest {r['state_dtype']} offload baseline)" if b["key"] == r["key"] else
                      f"{r['median'] / b['median']:.2f}x {_label(b['key'])}")
                if min(r["runs"], b["runs"]) < HEADLINE_RUNS:  # shown, never a headline number
                    vs += f" (fewer than {HEADLINE_RUNS} runs)"
            name = _label(r["key"]) + (f", ratio {r['ratio']:g}" if r["key"] == "deepspeed-twinflow" else "")
            lines.append(f"| {batch} | {model} | {name} | {r['state_dtype']} | {r['runs']} | {r['median']:.3f} | "
                         f"{r['min']:.3f}-{r['max']:.3f} | {vs} |")
    return "\n".join(lines) + "\n"

