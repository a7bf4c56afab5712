"""Recorded results -> tidy pandas DataFrames (DESIGN.md §5), for the figures.

Everything reads what `dos.lab.sweep` wrote under `experiments/results/<sweep>/`: `runs.csv` (one row per
run), `env.json`, and each run's folder (`steps.csv`, `markers.csv`, `samples.csv`, `lanes.json`).
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
PASS, MISS = "PASS", "MISS"


class CheckTable(pd.DataFrame):
    """A check's table: one row per comparison with its `target` and `verdict` (PASS or MISS).
    Its `verdict` is PASS when every row passes (MISS when one misses, or when nothing could be
    compared), and it prints that verdict above the table (text and notebook HTML alike)."""

    @property
    def _constructor(self):
        return CheckTable

    @property
    def verdict(self) -> str:
        ok = "verdict" in self.columns and len(self) and self["verdict"].eq(PASS).all()
        return PASS if ok else MISS

    def summary(self) -> str:
        if "verdict" not in self.columns or not len(self):
            return f"verdict: {MISS} (no comparable rows)"
        n_pass = int(self["verdict"].eq(PASS).sum())
        targets = "; ".join(dict.fromkeys(str(t) for t in self["target"])) if "target" in self else ""
        return f"verdict: {self.verdict} ({n_pass} of {len(self)} rows pass; target: {targets})"

    def __repr__(self) -> str:
        return self.summary() + "\n" + super().__repr__()

    def _repr_html_(self):
        import html

        return f"<p><b>{html.escape(self.summary())}</b></p>" + (super()._repr_html_() or "")


def _check_table(out: list, columns: Sequence[str]) -> CheckTable:
    """`out` (dicts with `target` and `verdict`) as a CheckTable, with `columns` when empty."""
    return CheckTable(out) if out else CheckTable(columns=[*columns, "target", "verdict"])


def _require(df, what: str) -> None:
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


SPEC_KNOBS = ("subgroup_numel", "cpu_threads", "staging_slots", "max_grad_norm", "overlap_backward")
"""Run settings outside the defaults that `headline` leaves out (from the row's config.run)."""


def _spec_fields(text: str) -> dict:
    run = (json.loads(text).get("run") or {}) if isinstance(text, str) and text.startswith("{") else {}
    return {f"spec_{k}": run.get(k) for k in SPEC_KNOBS}


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
    implied = [("bf16" if s == "deepspeed-zero2-offload-bf16" or (s == "torchao-cpu-offload" and d == "bf16")
                else "fp32") for s, d in zip(df["system"], df["dtype"] if "dtype" in df else [""] * len(df))]
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
    the smallest micro-batch, synthetic data, no GPU memory cap, no other knob set."""
    keep = ((df["stride"].isin(["auto", ""]) | df["stride"].isna())
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
    return path if path.exists() else None


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
    return pd.DataFrame([e for x in json.loads(path.read_text()) for e in x["events"]])


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


def stride_check(dfp: pd.DataFrame) -> pd.DataFrame:
    """Issue 4's checks per stride-sweep panel: relative error |predicted - measured| / measured
    of the update phase over the fixed strides and all-CPU (median, worst), the best measured
    one, and how far the "auto" run is from it. Target (issue 4): median error <= 10%, worst <= 20%,
    auto within 5% of the best measured stride (STRIDE_TARGET); a panel passes when all hold."""
    _require(dfp, "stride_check")
    out = []
    for panel, m in stride_panels(dfp).groupby("panel", sort=False):
        fixed = m[m["stride"].ne("auto")]
        err = ((fixed["predicted_s"] - fixed["step_s"]).abs() / fixed["step_s"]).dropna()
        best = fixed.loc[fixed["step_s"].idxmin()] if len(fixed) else None
        auto = m[m["stride"].eq("auto")]
        auto_s = auto["step_s"].iloc[-1] if len(auto) else float("nan")
        out.append({"panel": panel, "sweep": Path(m["results_dir"].iloc[0]).name, "runs": len(err),
                    "median_error": err.median(), "worst_error": err.max(),
                    "best": "cpu" if best is not None and best["placement"] == "cpu" else
                    (f"k={best['stride']}" if best is not None else None),
                    "best_step_s": best["step_s"] if best is not None else float("nan"),
                    "auto_step_s": auto_s,
                    "auto_plan": (f"k={auto['plan_stride'].iloc[-1]:g}, {auto['cpu_threads'].iloc[-1]:g} threads"
                                  if len(auto) and auto["plan_stride"].notna().iloc[-1] else None),
                    "auto_vs_best": auto_s / best["step_s"] - 1 if best is not None else float("nan")})
        r = out[-1]
        held = (r["median_error"] <= STRIDE_TARGET["median_error"] and r["worst_error"] <= STRIDE_TARGET["worst_error"]
                and r["auto_vs_best"] <= STRIDE_TARGET["auto_vs_best"])
        r.update(target=STRIDE_TARGET_TEXT, verdict=PASS if held else MISS)
    return _check_table(out, ("panel", "median_error", "worst_error", "auto_vs_best"))


STRIDE_TARGET = {"median_error": 0.10, "worst_error": 0.20, "auto_vs_best": 0.05}
STRIDE_TARGET_TEXT = "median error <= 0.10, worst <= 0.20, auto_vs_best <= 0.05"


# ---------------------------------------------------------------- issue 7 checks

NO_OFFLOAD = ("torch-gpu", "torch-cpu")  # the no-offload baselines, the GPU one first


def baseline_key(keys, baselines: Sequence[str] = NO_OFFLOAD) -> Optional[str]:
    """The first of `baselines` among `keys` (None when none is)."""
    present = set(keys)
    return next((k for k in baselines if k in present), None)


CALL_S = 600  # a device call's limit: rows further apart than this were measured in different calls


def capped_check(df: pd.DataFrame, system: str = "deepspeed-twinflow", key: str = "dos-auto") -> pd.DataFrame:
    """Issue 7, criterion 1 (the paper's regime), per (model, GPU cap): `key`'s iteration time over
    the fastest `system` row (a TwinFlow ratio) that ran within the same cap, from the results
    directory of that model's latest capped `system` run (one machine kind). `apart_s`: seconds
    between the two rows; `same_call`: within CALL_S of each other (side by side in one call;
    a sweep resumed in a later call is not). Target (issue 7, criterion 1): `vs_baseline` <=
    CAPPED_TARGET, measured in one call (issue 16: a ratio across calls is no evidence)."""
    _require(df, "capped_check")
    d = df[df["status"].eq("ok") & df["gpu_mem_cap_gib"].notna()] if "status" in df else df
    out = []
    for (model, cap), m in d.groupby(["model", "gpu_mem_cap_gib"], sort=False):
        base = m[m["key"].eq(system)].sort_values("timestamp")
        if not len(base):
            continue
        m = m[m["results_dir"].eq(base["results_dir"].iloc[-1])]
        base, ours = m[m["key"].eq(system)], m[m["key"].eq(key)]
        if not len(ours):
            continue
        best, r = base.loc[base["iter_s"].idxmin()], ours.iloc[-1]
        apart = abs((pd.Timestamp(r["timestamp"]) - pd.Timestamp(best["timestamp"])).total_seconds())
        out.append({"model": model, "gpu_cap_gib": cap, "key": key, "iter_s": r["iter_s"],
                    "peak_gpu_gib": r["peak_gpu_gib"], "baseline": system,
                    "ratios_run": ", ".join(f"{x:g}" for x in sorted(base["ratio"].dropna())),
                    "best_ratio": best["ratio"], "baseline_iter_s": best["iter_s"],
                    "baseline_peak_gpu_gib": best["peak_gpu_gib"], "vs_baseline": r["iter_s"] / best["iter_s"],
                    "apart_s": apart, "same_call": apart <= CALL_S,
                    "sweep": Path(r["results_dir"]).name, "run_id": r["run_id"],
                    "target": f"vs_baseline <= {CAPPED_TARGET} in one call",
                    "verdict": PASS if r["iter_s"] / best["iter_s"] <= CAPPED_TARGET and apart <= CALL_S else MISS})
    return _check_table(out, ("model", "gpu_cap_gib", "key", "vs_baseline", "same_call"))


CAPPED_TARGET = 0.6


DESIGN_S8 = {  # DESIGN.md §8: DeepSpeed 0.19.8 on this H200 machine, median s/iter, seq 2048, mb 1
    ("1.3B", "deepspeed-zero-offload"): 1.91, ("3B", "deepspeed-zero-offload"): 3.64,
    ("1.3B", "deepspeed-twinflow"): 1.26, ("3B", "deepspeed-twinflow"): 2.47,
    ("1.3B", "deepspeed-superoffload"): 3.21, ("3B", "deepspeed-superoffload"): 7.47,
    ("1.3B", "deepspeed-zero3"): 0.69, ("3B", "deepspeed-zero3"): 1.09}
"""The reference DeepSpeed numbers (TwinFlow at ratio 0.5; zero3: §8's no-offload column)."""


def reference_check(df: pd.DataFrame) -> pd.DataFrame:
    """Issue 5, criterion 2: every recorded DeepSpeed row at DESIGN.md §8's settings (micro-batch
    1, synthetic data, no GPU cap, TwinFlow at 0.5) against §8's median s/iter, with and without
    gradient clipping (`clip`), and its ratio to the ZeRO-Offload row of the same results directory
    and clipping (side by side) beside §8's ratio. Target (issue 5, criterion 2): within
    REFERENCE_TOLERANCE (15%) of §8."""
    _require(df, "reference_check")
    ref = DESIGN_S8
    d = df[df["system"].str.startswith("deepspeed") & df["gpu_mem_cap_gib"].isna()
           & df["micro_batch"].eq(1) & df["data"].isin(["synthetic", ""])
           & (df["system"].ne("deepspeed-twinflow") | df["ratio"].eq(0.5))].copy()
    d["clip"] = d["spec_max_grad_norm"].notna()
    out = []
    for r in d.sort_values("timestamp").itertuples():
        want = ref.get((r.model, r.system))
        if want is None:
            continue
        zo = d[d["results_dir"].eq(r.results_dir) & d["model"].eq(r.model) & d["clip"].eq(r.clip)
               & d["system"].eq("deepspeed-zero-offload")]
        zo_ref = ref.get((r.model, "deepspeed-zero-offload"))
        out.append({"model": r.model, "system": r.system, "clip": r.clip, "sweep": Path(r.results_dir).name,
                    "run_id": r.run_id, "iter_s": r.iter_s, "fwd_s": r.fwd_s, "bwd_s": r.bwd_s,
                    "step_s": r.step_s, "reference_s": want, "vs_reference": r.iter_s / want - 1,
                    "over_zero_offload": r.iter_s / zo["iter_s"].iloc[-1] if len(zo) else float("nan"),
                    "reference_over_zero_offload": want / zo_ref if zo_ref else float("nan"),
                    "target": f"|vs_reference| <= {REFERENCE_TOLERANCE}",
                    "verdict": PASS if abs(r.iter_s / want - 1) <= REFERENCE_TOLERANCE else MISS})
    return _check_table(out, ("model", "system", "clip", "sweep", "run_id", "vs_reference"))


REFERENCE_TOLERANCE = 0.15


def microbatch_check(df: pd.DataFrame, baselines: Sequence[str] = NO_OFFLOAD) -> pd.DataFrame:
    """Issue 7, criterion 2, per (model, system): at the largest micro-batch the no-offload
    baseline fits (an `ok` row of the first of `baselines` present), each system's iteration time
    over the baseline's, and its update phase's share of its iteration. Target (issue 7,
    criterion 2): within MICROBATCH_TARGET (15%) of the baseline."""
    _require(df, "microbatch_check")
    d = df[df["status"].eq("ok")] if "status" in df else df
    baseline = baseline_key(d["key"], baselines) if len(d) else None
    out = []
    for model, m in d.groupby("model", sort=False):
        base = m[m["key"].eq(baseline)]
        if not len(base):
            continue
        mb = base["micro_batch"].max()
        b = base[base["micro_batch"].eq(mb)].iloc[-1]
        for key, r in m[m["micro_batch"].eq(mb) & m["key"].ne(baseline)].groupby("key", sort=False):
            r = r.iloc[-1]
            out.append({"model": model, "micro_batch": int(mb), "key": key, "iter_s": r["iter_s"],
                        "baseline_iter_s": b["iter_s"], "vs_baseline": r["iter_s"] / b["iter_s"] - 1,
                        "update_share": r["step_s"] / r["iter_s"], "peak_gpu_gib": r["peak_gpu_gib"],
                        "baseline_peak_gpu_gib": b["peak_gpu_gib"],
                        "target": f"vs_baseline <= {MICROBATCH_TARGET}",
                        "verdict": PASS if r["iter_s"] / b["iter_s"] - 1 <= MICROBATCH_TARGET else MISS})
    return _check_table(out, ("model", "micro_batch", "key", "vs_baseline"))


MICROBATCH_TARGET = 0.15


def convergence_check(steps: pd.DataFrame, baselines: Sequence[str] = NO_OFFLOAD, window: int = 50) -> pd.DataFrame:
    """Issue 7, criterion 3: each system's loss curve against the no-offload baseline's (same seed,
    same batches). Per window of `window` steps: the relative difference of the mean losses, and
    the standard deviation of the per-step differences over the baseline loss's step-to-step noise
    (the std of consecutive differences / sqrt 2: what one batch moves the loss). The criterion
    held here: every window's means within 0.5% (about bf16's relative precision, 2^-8) and the
    per-step differences below 10% of the loss noise. A shorter run is compared over the steps it
    has. Target (CONVERGENCE_TARGET): |mean_rel_diff| <= 0.005 and diff_over_noise <= 0.10 per
    window. Raises on empty input; without a baseline run the table is empty (verdict MISS)."""
    _require(steps, "convergence_check")
    columns = ("key", "steps", "mean_rel_diff", "diff_over_noise")
    baseline = baseline_key(steps["key"], baselines)
    if baseline is None:
        return _check_table([], columns)
    full = steps[steps["key"].eq(baseline)].sort_values("step").set_index("step")["loss"]
    out = []
    for key, s in steps[steps["key"].ne(baseline)].groupby("key", sort=False):
        s = s.drop_duplicates("step", keep="last").set_index("step")["loss"]
        base = full[full.index.isin(s.index)]
        s = s.reindex(base.index)
        starts = list(range(0, max(len(base) - window, 0) + 1, window)) or [0]
        for i, lo in enumerate(starts):  # the last window takes the remainder
            hi = starts[i + 1] if i + 1 < len(starts) else len(base)
            a, b = base.iloc[lo: hi], s.iloc[lo: hi]
            if not len(a):
                continue
            noise = a.diff().std() / 2 ** 0.5
            diff = b - a
            out.append({"key": key, "steps": f"{a.index[0]}-{a.index[-1]}", "baseline_mean": a.mean(),
                        "mean": b.mean(), "mean_rel_diff": b.mean() / a.mean() - 1,
                        "diff_std": diff.std(), "loss_noise": noise, "diff_over_noise": diff.std() / noise})
            r = out[-1]
            held = (abs(r["mean_rel_diff"]) <= CONVERGENCE_TARGET["mean_rel_diff"]
                    and r["diff_over_noise"] <= CONVERGENCE_TARGET["diff_over_noise"])
            r.update(target="|mean_rel_diff| <= 0.005, diff_over_noise <= 0.10", verdict=PASS if held else MISS)
    return _check_table(out, columns)


CONVERGENCE_TARGET = {"mean_rel_diff": 0.005, "diff_over_noise": 0.10}


# ---------------------------------------------------------------- issue 16: the protocol

OFFLOAD_BASELINES = ("deepspeed-zero2-offload", "deepspeed-zero2-offload-bf16", "deepspeed-zero3-offload",
                     "deepspeed-zero-offload", "deepspeed-twinflow", "deepspeed-superoffload",
                     "torchao-cpu-offload")
"""The offload systems dos is compared against (torch without offload is a reference, not one)."""
GROUP = ("batch_id", "model", "key", "config_id")


def summary(df: pd.DataFrame, value: str = "iter_s") -> pd.DataFrame:
    """Per (batch_id, model, system key, configuration): the median, min and max of `value` over
    its repeats (`runs` of them), the state precision, GPUs and hosts (boot ids) it ran on, and
    its label. Rows with status ok only; raises on empty input."""
    _require(df, "summary")
    d = df[df["status"].eq("ok")] if "status" in df else df
    _require(d, "summary (status ok)")
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


def headline_ratios(df: pd.DataFrame, keys: Sequence[str] = ("dos-interleaved", "dos-auto", "dos-cpu"),
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


HEADLINE_TARGET = 0.40
"""Issue 16, criterion 2: dos interleaved without resident state <= 0.40x the fastest fp32 offload
baseline (medians, same batch), at 3B and at the ~5B shape."""


def headline_check(df: pd.DataFrame, key: str = "dos-interleaved", target: float = HEADLINE_TARGET,
                   models: Optional[Sequence[str]] = ("3B", "5B")) -> CheckTable:
    """Issue 16, criterion 2, per batch and model (of `models`; None: all): `key`'s median over the
    fastest offload baseline of equal state precision, PASS when <= `target` with >= 3 runs of
    each. Raises on empty input."""
    _require(df, "headline_check")
    h = headline_ratios(df, keys=(key,))
    if models is not None and len(h):
        h = h[h["model"].isin(list(models))]
    out = []
    for r in h.to_dict("records"):
        enough = r["runs"] >= 3 and r["baseline_runs"] >= 3
        r.update(target=f"vs fastest {r['state_dtype']} offload baseline <= {target} (median, >= 3 runs, one batch)",
                 verdict=PASS if r["vs_baseline"] <= target and enough else MISS)
        out.append(r)
    return _check_table(out, ("batch_id", "model", "key", "vs_baseline"))


def batch_table(df: pd.DataFrame, keys: Sequence[str] = ("dos-interleaved", "dos-auto", "dos-cpu")) -> str:
    """Markdown: per batch and model, every system's median s/iter with its min-max and runs, and
    each row's ratio to the fastest offload baseline of its state precision (named) within the
    batch; rows without a batch_id are left out."""
    summ = summary(df)
    summ = summ[summ["batch_id"].ne("")]
    lines = ["| batch | model | system | state | runs | median s/iter | min-max | vs fastest offload baseline (same state precision) |",
             "|---|---|---|---|---:|---:|---|---|"]
    for (batch, model), g in summ.groupby(["batch_id", "model"], sort=False):
        for _, r in g.iterrows():
            base = g[g["key"].isin(OFFLOAD_BASELINES) & g["state_dtype"].eq(r["state_dtype"])
                     & g["key"].ne(r["key"])]
            vs = ""
            if len(base):
                b = base.loc[base["median"].idxmin()]
                vs = f"{r['median'] / b['median']:.2f}x {_label(b['key'])}"
            name = _label(r["key"]) + (f", ratio {r['ratio']:g}" if r["key"] == "deepspeed-twinflow" else "")
            lines.append(f"| {batch} | {model} | {name} | {r['state_dtype']} | {r['runs']} | {r['median']:.3f} | "
                         f"{r['min']:.3f}-{r['max']:.3f} | {vs} |")
    return "\n".join(lines) + "\n"


def core_ab_check(df: pd.DataFrame, old_suffix: str = "-core",
                  metrics: Sequence[str] = ("step_s", "iter_s")) -> CheckTable:
    """Two optimizer cores side by side (`structure-ab`: rows whose git_sha ends in `old_suffix`
    ran the old core, the others the new one), per batch and configuration: the difference of the
    two cores' median times against the run-to-run noise, measured as the larger of the two cores'
    own ranges (max - min over its repeated runs). PASS when the difference is within that noise;
    each core needs >= 2 runs of the configuration. The update phase (`step_s`) is the engine's own
    time; the iteration (`iter_s`) adds forward and backward. Side by side = one machine without a
    restart: rows are grouped by GPU UUID and host boot id (the batch ids of that boot listed: a
    device call that resumes the A/B on a warm machine starts a new batch id)."""
    _require(df, "core_ab_check")
    df = df[df["status"].eq("ok")].copy() if "status" in df else df.copy()
    df["core"] = df["git_sha"].astype(str).str.endswith(old_suffix).map({True: "old", False: "new"})
    df["config"] = df["placement"].astype(str) + df["gpu_fraction"].astype(str).map(
        lambda f: "" if f in ("", "0.0", "0", "nan", "None") else f", gpu_fraction {f}")
    out = []
    for (_, _, config), g in df.groupby(["gpu_uuid", "boot_id", "config"], sort=False):
        batch = " + ".join(dict.fromkeys(g["batch_id"].astype(str)))
        for m in metrics:
            old = pd.to_numeric(g.loc[g["core"] == "old", m], errors="coerce").dropna()
            new = pd.to_numeric(g.loc[g["core"] == "new", m], errors="coerce").dropna()
            enough = len(old) >= 2 and len(new) >= 2
            noise = max(old.max() - old.min(), new.max() - new.min()) if enough else float("nan")
            diff = new.median() - old.median() if len(old) and len(new) else float("nan")
            out.append(dict(batch_id=batch, config=config, metric=m, old_runs=len(old), new_runs=len(new),
                            old_median=round(old.median(), 4) if len(old) else None,
                            new_median=round(new.median(), 4) if len(new) else None,
                            diff_pct=round(100 * diff / old.median(), 1) if len(old) and len(new) else None,
                            noise_pct=round(100 * noise / old.median(), 1) if enough else None,
                            target="|median new - median old| <= the larger within-core range (>= 2 runs each)",
                            verdict=PASS if enough and abs(diff) <= noise else MISS))
    return _check_table(out, ["batch_id", "config", "metric"])
