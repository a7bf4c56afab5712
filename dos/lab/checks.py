"""The checks: each compares recorded rows with a stated target and returns a `CheckTable` whose
rows carry the target and a PASS or MISS verdict (docs/DESIGN.md §5.3). Each raises ValueError on
empty input. The rows come from `dos.lab.results` (records -> DataFrames)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from dos.lab.results import (HEADLINE_RUNS, INTERLEAVED, NO_OFFLOAD, _run_field, baseline_key, headline_ratios, require_rows,
                             stride_panels)
from dos.lab.verdicts import MISS, PASS, CheckTable, _check_table  # noqa: F401  (checks.CheckTable: API)



def stride_check(dfp: pd.DataFrame) -> pd.DataFrame:
    """Issue 4's checks per stride-sweep panel: relative error |predicted - measured| / measured
    of the update phase over the fixed strides and all-CPU (median, worst), the best measured
    one, and how far the "auto" run is from it. Target (issue 4): median error <= 10%, worst <= 20%,
    auto within 5% of the best measured stride (STRIDE_TARGET); a panel passes when all hold."""
    require_rows(dfp, "stride_check")
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

CALL_S = 600  # a device call's limit: rows further apart than this were measured in different calls


def capped_check(df: pd.DataFrame, system: str = "deepspeed-twinflow", key: str = "dos-auto") -> pd.DataFrame:
    """Issue 7, criterion 1 (the paper's regime), per (model, GPU cap): `key`'s iteration time over
    the fastest `system` row (a TwinFlow ratio) that ran within the same cap, from the results
    directory of that model's latest capped `system` run (one machine kind). `apart_s`: seconds
    between the two rows; `same_call`: within CALL_S of each other (side by side in one call;
    a sweep resumed in a later call is not). Target (issue 7, criterion 1): `vs_baseline` <=
    CAPPED_TARGET, measured in one call (issue 16: a ratio across calls is no evidence)."""
    require_rows(df, "capped_check")
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
    require_rows(df, "reference_check")
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
    require_rows(df, "microbatch_check")
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
    require_rows(steps, "convergence_check")
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

HEADLINE_TARGET = 0.40
"""Issue 16, criterion 2: dos interleaved without resident state <= 0.40x the fastest fp32 offload
baseline (medians, same batch), at 3B and at the ~5B shape."""


def headline_check(df: pd.DataFrame, keys: Sequence[str] = INTERLEAVED,
                   target: float = HEADLINE_TARGET, models: Optional[Sequence[str]] = ("3B", "5B")) -> CheckTable:
    """Issue 16, criterion 2, per batch and model (of `models`; None: all): each of `keys` (dos
    interleaved without resident state; the headline sweeps run it with the CPU lane started
    during backward, `-overlap`) recorded there, its median over the fastest offload baseline of
    equal state precision, PASS when <= `target` with >= 3 runs of each. Raises on empty input;
    a batch without such a row or baseline gives no row, and each of `models` with no row gets a
    MISS row saying so (the criterion holds at every one of them)."""
    require_rows(df, "headline_check")
    h = headline_ratios(df, keys=tuple(keys))
    if models is not None and len(h):
        h = h[h["model"].isin(list(models))]
    out = []
    for r in h.to_dict("records"):
        enough = r["runs"] >= HEADLINE_RUNS and r["baseline_runs"] >= HEADLINE_RUNS
        r.update(target=f"vs fastest {r['state_dtype']} offload baseline <= {target} (median, >= {HEADLINE_RUNS} runs, one batch)",
                 verdict=PASS if r["vs_baseline"] <= target and enough else MISS)
        out.append(r)
    seen = set(h["model"]) if len(h) else set()
    for model in [m for m in (models or ()) if m not in seen]:
        out.append({"batch_id": "(none recorded)", "model": model, "key": keys[0], "vs_baseline": float("nan"),
                    "target": f"vs fastest fp32 offload baseline <= {target} (median, >= 3 runs, one batch)",
                    "verdict": MISS, "note": "no batch of this model with dos interleaved and an offload "
                                             "baseline of its state precision"})
    return _check_table(out, ("batch_id", "model", "key", "vs_baseline"))


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
    require_rows(df, "core_ab_check")
    df = df[df["status"].eq("ok")].copy() if "status" in df else df.copy()
    df["core"] = df["git_sha"].astype(str).str.endswith(old_suffix).map({True: "old", False: "new"})
    df["config"] = df["placement"].astype(str) + df["gpu_fraction"].astype(str).map(
        lambda f: "" if f in ("", "0.0", "0", "nan", "None") else f", gpu_fraction {f}")
    out = [dict(r, target="|median new - median old| <= the larger within-core range (>= 2 runs each)",
                verdict=PASS if r["enough"] and abs(r["diff"]) <= r["noise"] else MISS)
           for r in _ab_rows(df, "core", ("old", "new"), metrics)]
    return _check_table([_public(r) for r in out], ["batch_id", "config", "metric"])


def _ab_rows(df: pd.DataFrame, column: str, variants: Sequence[str], metrics: Sequence[str]) -> list:
    """An A/B on one machine without a restart (grouped by GPU UUID and boot id; the batch ids of
    that boot listed), per `config` and metric: each variant's runs and median (`column` says which
    variant a row ran), B - A (`diff`) and the run-to-run noise, the larger of the two variants'
    ranges (`noise`; `enough`: >= 2 runs of each)."""
    a_name, b_name = variants
    out = []
    for (_, _, config), g in df.groupby(["gpu_uuid", "boot_id", "config"], sort=False):
        batch = " + ".join(dict.fromkeys(g["batch_id"].astype(str)))
        for m in metrics:
            a = pd.to_numeric(g.loc[g[column] == a_name, m], errors="coerce").dropna()
            b = pd.to_numeric(g.loc[g[column] == b_name, m], errors="coerce").dropna()
            enough = len(a) >= 2 and len(b) >= 2
            noise = max(a.max() - a.min(), b.max() - b.min()) if enough else float("nan")
            diff = b.median() - a.median() if len(a) and len(b) else float("nan")
            out.append({"batch_id": batch, "config": config, "metric": m, f"{a_name}_runs": len(a),
                        f"{b_name}_runs": len(b),
                        f"{a_name}_median": round(a.median(), 4) if len(a) else None,
                        f"{b_name}_median": round(b.median(), 4) if len(b) else None,
                        "diff_pct": round(100 * diff / a.median(), 1) if len(a) and len(b) else None,
                        "noise_pct": round(100 * noise / a.median(), 1) if enough else None,
                        "both": bool(len(a) and len(b)), "enough": enough, "diff": diff, "noise": noise})
    return out


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("both", "enough", "diff", "noise")}


def schedule_ab_check(df: pd.DataFrame, metrics: Sequence[str] = ("step_s", "iter_s")) -> CheckTable:
    """The CPU kernel's thread schedule in situ (`kernel-schedule-ab-3b`: rows whose cpu_impl ends
    in "-static" ran fixed per-thread ranges, the others dynamic chunks), per machine boot and
    configuration (placement, stride, threads): the medians of both and their difference against
    the run-to-run noise (the larger of the two variants' ranges). PASS when dynamic is not slower
    beyond that noise (>= 2 runs each); the row says which was faster and by how much. The
    15-thread rows have no static twin: reported with one variant, not graded."""
    require_rows(df, "schedule_ab_check")
    df = df[df["status"].eq("ok")].copy() if "status" in df else df.copy()
    df["schedule"] = df["cpu_impl"].astype(str).str.endswith("-static").map({True: "static", False: "dynamic"})
    threads = df["cpu_threads"] if "cpu_threads" in df else pd.Series("", index=df.index)
    df["config"] = (df["placement"].astype(str) + df["stride"].astype(str).map(
        lambda k: "" if k in ("", "nan", "None") else f" k={k}") + ", " + threads.map(
        lambda t: "" if pd.isna(t) or t == "" else f"{int(float(t))}") + " threads")
    out = [dict(r, graded=r["both"],
                target="dynamic median <= static median + the larger within-variant range (>= 2 runs each)",
                verdict=PASS if r["enough"] and r["diff"] <= r["noise"] else MISS)
           for r in _ab_rows(df, "schedule", ("static", "dynamic"), metrics)]
    return _check_table([_public(r) for r in out], ["batch_id", "config", "metric"])


def overlap_ab_check(df: pd.DataFrame, metrics: Sequence[str] = ("iter_s", "step_s")) -> CheckTable:
    """dos's CPU lane started during backward (`overlap_backward`) against started in `step()`
    (`overlap-ab-3b`), per machine boot and configuration (placement, stride): both medians and
    their difference against the run-to-run noise (the larger of the two variants' ranges). PASS
    when overlapping is faster by more than that noise (>= 2 runs each): the evidence the headline
    sweeps would need to run dos overlapped. Raises on empty input."""
    require_rows(df, "overlap_ab_check")
    df = df[df["status"].eq("ok")].copy() if "status" in df else df.copy()
    on = (df["key"].astype(str).str.endswith("-overlap") if "key" in df  # rows from results.rows
          else df["config"].map(lambda c: _run_field(c, "overlap_backward") is True))  # raw runs.csv rows
    df["overlap"] = on.map({True: "overlap", False: "step"})
    df["config"] = df["placement"].astype(str) + df["stride"].astype(str).map(
        lambda k: "" if k in ("", "nan", "None") else f" k={k}")
    out = [dict(r, target="overlap median < step median - the larger within-variant range (>= 2 runs each)",
                verdict=PASS if r["enough"] and -r["diff"] > r["noise"] else MISS)
           for r in _ab_rows(df, "overlap", ("step", "overlap"), metrics)]
    return _check_table([_public(r) for r in out], ["batch_id", "config", "metric"])


# ---------------------------------------------------------------- issue 18: scaling with GPUs

GPU_SCALING_TARGET = 1.8
GPU_SCALING_KEYS = ("dos-auto", "dos-interleaved")


def gpu_scaling_check(df: pd.DataFrame, model: str = "7B", keys: Sequence[str] = GPU_SCALING_KEYS,
                      gpus: Sequence[int] = (1, 2), target: float = GPU_SCALING_TARGET) -> CheckTable:
    """Issue 18, criterion 2, per dos key at `model`: the median tokens/s (every rank's tokens) on
    gpus[1] GPUs over the median on gpus[0], both from one batch (one device call: the latest
    batch that ran both). Target: speedup >= `target` (1.8x on 2 GPUs). A key without both GPU
    counts in one batch is not compared (no row: the table's verdict is then MISS)."""
    require_rows(df, "gpu_scaling_check")
    d = df[df["status"].eq("ok")] if "status" in df else df
    d = d[d["model"].eq(model) & d["key"].isin(list(keys))]
    lo, hi = gpus
    out = []
    for key in [k for k in keys if k in set(d["key"])]:
        m = d[d["key"].eq(key)]
        both = [b for b, g in m.groupby("batch_id", sort=False) if {lo, hi} <= set(g["gpus"].fillna(1).astype(int))]
        if not both:
            continue
        batch = m[m["batch_id"].isin(both)].sort_values("timestamp")["batch_id"].iloc[-1]
        g = m[m["batch_id"].eq(batch)]
        one, two = (g[g["gpus"].fillna(1).astype(int).eq(n)]["tokens_per_s"].astype(float) for n in (lo, hi))
        speedup = two.median() / one.median()
        out.append({"model": model, "key": key, "batch_id": batch, f"runs_{lo}gpu": len(one),
                    f"runs_{hi}gpu": len(two), f"tokens_per_s_{lo}gpu": one.median(),
                    f"tokens_per_s_{hi}gpu": two.median(), "speedup": speedup,
                    "sweep": Path(g["results_dir"].iloc[0]).name,
                    "target": f"tokens/s on {hi} GPUs >= {target}x on {lo}, one batch",
                    "verdict": PASS if speedup >= target else MISS})
    return _check_table(out, ("model", "key", "speedup"))


# issue 17's checks live in dos/lab/state_checks.py; notebooks and tests reach them here too
from dos.lab.state_checks import (  # noqa: E402,F401
    CAPACITY_CASES, CONVERGENCE_BAND_TOLERANCE, HOST_BYTES_TARGET, LOWP_BASELINES, NOMINAL_HOST_BYTES,
    SPEED_MODELS, STATE_SPEED_TARGET, capacity_check, final_losses, host_bytes_check,
    state_dtype_convergence_check, state_dtype_speed_check, state_dtype_speed_criterion)
