"""Issue 15's evidence ("a planner that measures: stride='auto' never loses to a fixed stride"):
the planner sweeps' rows (experiments/sweeps/planner-*.yaml) as one frame, and four checks that
grade them against the issue's criteria with a PASS or MISS verdict (`CheckTable`, as
`dos.lab.checks`; each raises ValueError on empty input).

1. `planner_check`: per shape and batch, auto's median iteration, exploration included, within
   5% of the best fixed plan's median, with >= 3 runs of each configuration, round-robin, one
   warm-up for all.
2. `planner_prediction_check`: predicted against measured update phase of the plans auto kept
   (in situ graded, offline reported beside it).
3. `planner_repeat_check`: a shape repeated in a second batch on a freshly started machine chooses
   the same plan, or both choices are within 5% of their batch's best.
4. `planner_coverage_check`: >= 4 shapes with a complete batch (2 own shapes, 3B, 7B capped at
   40 GiB).
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Optional

import pandas as pd

from dos.lab import results as R
from dos.lab.verdicts import MISS, PASS, CheckTable, _check_table
from dos.lab.results import require_rows

FIXED = ("cpu", "k=1", "k=2", "k=3", "k=4", "k=6")
"""The fixed plans every planner sweep runs (issue 15, criterion 1): all-CPU and strides 1-6."""
AUTO = "auto"
CONFIGS = (*FIXED, AUTO)
MIN_RUNS = 3
AUTO_VS_BEST = 0.05
"""Criterion 1: auto's median iteration (exploration included) <= (1 + 0.05) x the best fixed median."""
PREDICTION_TARGET = {"median_error": 0.10, "worst_error": 0.20}
"""Criterion 2: |predicted - measured| / measured of the chosen plans' update phase."""
REPEAT_TOLERANCE = 0.05
"""Criterion 3: a different choice on the second machine passes when both are within 5% of best."""
COVERAGE = {"shapes": 4, "own_shapes": 2, "presets": (("3B", None), ("7B", 40.0))}
"""Criterion 1's shapes: >= 4 with a complete batch, >= 2 outside the presets (model_overrides),
3B uncapped and 7B with the GPU capped at 40 GiB."""

PLANNER_TARGET_TEXT = (f"auto (exploration included) <= {1 + AUTO_VS_BEST:g} x best fixed median; "
                       f">= {MIN_RUNS} runs of each of cpu, k=1,2,3,4,6, auto")
NO_REPEAT = "no shape repeated on a second machine"


# ---------------------------------------------------------------- rows

def _config(placement: str, stride: str) -> str:
    """The configuration a row ran: "cpu", "k=<stride>" or "auto" (the sweep's knob, not the plan)."""
    if placement == "cpu":
        return "cpu"
    stride = str(stride or "")
    if stride == AUTO:
        return AUTO
    return f"k={int(float(stride))}" if stride else "interleaved (default stride)"


def plan_label(stride, cpu_threads=None) -> str:
    """A plan as "cpu" (no stride: every subgroup on the CPU) or "k=3, 16 threads"."""
    if stride is None or (isinstance(stride, float) and math.isnan(stride)):
        return "cpu"
    threads = "" if cpu_threads is None or cpu_threads != cpu_threads else f", {int(cpu_threads)} threads"
    return f"k={int(stride)}{threads}"


def _as_config(label: Optional[str]) -> Optional[str]:
    """The fixed configuration a kept plan label corresponds to ("k=3, 16 threads" -> "k=3")."""
    return None if label is None else label.split(",")[0]


def _result(row) -> dict:
    """A run's result.json, {} when absent. The run's folder is the one holding its recorded files
    (steps.csv, log.txt), else its run_id."""
    names = [row.get(c) for c in ("steps_file", "lanes_file", "log_file")]
    folder = next((Path(n).parent for n in names if isinstance(n, str) and n), Path(str(row["run_id"])))
    path = Path(row["results_dir"]) / folder / "result.json"
    return json.loads(path.read_text()) if path.exists() else {}


WINDOW_FROM = 2
"""`iter_window_s`: the mean iteration from this step to the run's end, warm-up included. Steps 0-1
warm up every run alike (allocations, first kernels; the planner never compares them either)."""


def _window_iter(row) -> float:
    """The run's mean iteration over steps WINDOW_FROM..end (warm-up and measured steps): the same
    window in every run of a shape, so auto's exploration counts as it ran, and so do the fixed
    plans' early steps (nan without a steps file)."""
    path = R.run_file(row, "steps_file")
    if path is None:
        return math.nan
    s = pd.read_csv(path)
    s = s[s["step"] >= WINDOW_FROM]
    return float(s["iter_s"].mean()) if len(s) else math.nan


def _events(shares) -> str:
    """A run's clock-event reasons as "sw_power_cap, sw_thermal" (idle left out: between steps)."""
    return ", ".join(k for k in sorted(shares or {}) if k != "gpu_idle")


def planner_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """`planner_runs` from rows already loaded with `dos.lab.results.rows` (ok, not superseded)."""
    cols = ["shape", "batch_id", "boot_id", "gpu_uuid", "git_sha", "config", "repeat", "order", "iter_s", "iter_incl_s",
            "iter_window_s",
            "step_s", "fwd_bwd_s", "predicted_step_s", "plan", "kept", "explore_steps", "explore_s",
            "refined_predicted_s", "host_cpu_other_pct", "host_cpu_steal_pct", "gpu_sm_mhz",
            "gpu_clock_events", "warmup", "steps", "iters", "own_shape", "model", "gpu_mem_cap_gib", "n_params", "run_id",
            "timestamp", "results_dir", "gpu_name", "date", "smoke"]
    d = rows[rows["system"].eq("dos") & rows["placement"].isin(["cpu", "interleaved"])] if len(rows) else []
    out = []
    for r in (d.sort_values("timestamp", kind="stable").to_dict("records") if len(d) else []):
        config = _config(r["placement"], r["stride"])
        result = _result(r)
        online, sampler = result.get("online") or {}, result.get("sampler") or {}
        ex = (online.get("explorations") or [{}])[-1]
        plan = plan_label(r["plan_stride"] if r["plan_stride"] == r["plan_stride"] else None, r["cpu_threads"])
        kept = plan_label(ex["kept"].get("stride"), ex["kept"].get("cpu_threads")) if ex.get("kept") else plan
        refined = ex.get("refined_predicted_s")
        # The refined prediction is of the kept plan: it describes the measured steps only where the
        # run ended on that plan (a later replan would have measured another one).
        refined = float(refined) if refined is not None and kept == plan else math.nan
        explore_s = float(online.get("explore_s") or 0.0)
        iters = r["warmup"] + r["steps"]
        # Exploration spread over the run's own iterations: every run of a shape runs the same
        # warmup + steps (the comparison unit), so auto pays its exploration once per that many.
        incl = r["iter_s"] + explore_s / iters if config == AUTO else r["iter_s"]
        out.append({"shape": shape_of(r["sweep"] or Path(r["results_dir"]).name), "batch_id": r["batch_id"],
                    "boot_id": r["boot_id"], "gpu_uuid": r["gpu_uuid"], "git_sha": r.get("git_sha", ""),
                    "config": config, "repeat": r["repeat"],
                    "iter_s": r["iter_s"], "iter_incl_s": incl, "iter_window_s": _window_iter(r),
                    "step_s": r["step_s"],
                    "fwd_bwd_s": r["fwd_s"] + r["bwd_s"],
                    "predicted_step_s": r["predicted_step_s"], "plan": plan,
                    "kept": kept if config == AUTO else None,
                    "explore_steps": int(online.get("explore_steps") or 0), "explore_s": explore_s,
                    "refined_predicted_s": refined,
                    # the host's CPU while training, beyond this run (dos.lab.nvml.HostCpu; runs
                    # recorded before 2026-12-02 session 12 have none)
                    "host_cpu_other_pct": sampler.get("host_cpu_other_pct", math.nan),
                    "host_cpu_steal_pct": sampler.get("host_cpu_steal_pct", math.nan),
                    # the GPU's median SM clock while training, and the reasons NVML gave for
                    # clocks below the maximum, by share of samples (dos.lab.nvml; runs recorded
                    # before 2026-12-04 session 21 have none)
                    "gpu_sm_mhz": (sampler.get("gpu_sm_mhz_median")
                                   if sampler.get("gpu_sm_mhz_median") is not None else math.nan),
                    "gpu_clock_events": _events(sampler.get("gpu_clock_events")),
                    "warmup": r["warmup"], "steps": r["steps"], "iters": iters,
                    "own_shape": R._run_field(r["config"], "model_overrides") is not None, "model": r["model"],
                    "gpu_mem_cap_gib": r["gpu_mem_cap_gib"], "n_params": r["n_params"], "run_id": r["run_id"],
                    "timestamp": r["timestamp"], "results_dir": r["results_dir"], "gpu_name": r["gpu_name"],
                    "date": r["date"], "smoke": r["smoke"]})
    df = pd.DataFrame(out, columns=cols)
    # order: the run's position in its batch of its shape (1-based, by time): round-robin shows here
    df["order"] = df.groupby(["shape", "batch_id"]).cumcount() + 1 if len(df) else df["order"]
    return df


def shape_of(sweep: str) -> str:
    """The shape a planner sweep measures: its name, where a sweep named `<shape>-repeat` (or
    `-repeat-N`) re-measures `<shape>` in another batch on a freshly started machine (criterion 3)
    and writes to its own results directory."""
    return re.sub(r"-repeat(-\d+)?$", "", str(sweep))


def planner_runs(dirs) -> pd.DataFrame:
    """One row per ok run of the planner sweeps under `dirs` (dos all-CPU, fixed strides and
    stride "auto"; superseded rows left out, as `dos.lab.results.rows` does for every check):
    shape (the sweep name, less a `-repeat` suffix: `shape_of`), batch_id, boot_id, gpu_uuid, git_sha, config ("cpu", "k=1", ..., "auto"),
    repeat and order (position in its batch, by time), iter_s (median of the measured steps),
    step_s (update phase), predicted_step_s (the offline model's prediction of the run's plan),
    plan (the plan the run ended on), and for auto: kept (the plan its last exploration kept, e.g.
    "k=3, 16 threads" or "cpu"), explore_steps, explore_s (seconds the exploration steps took
    beyond the kept plan's pace) and refined_predicted_s (the last exploration's prediction of the
    kept plan from rates fitted in situ; NaN where the run did not end on the kept plan).

    `iter_incl_s` = iter_s + explore_s / (warmup + steps) for auto, iter_s for the fixed plans:
    every run of a shape runs the same warmup + steps iterations, and that run is the comparison
    unit, so auto's exploration is charged to it spread over the run's own iterations (its
    measured steps are of the kept plan only: the warm-up holds the exploration)."""
    return planner_rows(R.rows(dirs))


# ---------------------------------------------------------------- criterion 1

def _round_robin(g: pd.DataFrame) -> bool:
    """Each repetition of every configuration ran before the next began (repeat non-decreasing
    in time); unknown repeats (rows before the protocol) are not round-robin."""
    rep = g.sort_values("timestamp", kind="stable")["repeat"]
    return bool(rep.notna().all() and rep.is_monotonic_increasing)


def _rng(v: pd.Series, fmt: str = ".3f") -> str:
    return f"{v.min():{fmt}}-{v.max():{fmt}}" if len(v) else ""


def _batches(df: pd.DataFrame) -> list:
    """Per (shape, batch) with a batch_id: the medians and protocol facts criterion 1 grades."""
    d = df[df["batch_id"].astype(str).ne("")].sort_values("timestamp", kind="stable")
    out = []
    for (shape, batch), g in d.groupby(["shape", "batch_id"], sort=False):
        counts = g["config"].value_counts()
        listed = [*CONFIGS, *sorted(set(counts.index) - set(CONFIGS))]
        fixed = g[g["config"].ne(AUTO)]
        med = fixed.groupby("config")["iter_s"].median()
        best = med.idxmin() if len(med) else None
        # run-to-run noise: each fixed plan's (max - min) / median over its runs
        spread = fixed.groupby("config")["iter_s"].agg(lambda v: (v.max() - v.min()) / v.median())
        auto = g[g["config"].eq(AUTO)]
        incl = auto["iter_incl_s"].median() if len(auto) else math.nan
        enough = all(counts.get(c, 0) >= MIN_RUNS for c in CONFIGS)
        one_unit = g["iters"].nunique() == 1
        rr = _round_robin(g)
        first = g.iloc[0]
        # model is the preset an own shape overrides (3B for wide-4b): params says its size
        out.append({"shape": shape, "batch_id": batch, "model": first["model"],
                    "params_b": round(float(first["n_params"]) / 1e9, 2),
                    "gpu": "/".join(dict.fromkeys(str(v) for v in g["gpu_name"])),
                    "gpu_cap_gib": first["gpu_mem_cap_gib"], "own_shape": bool(first["own_shape"]),
                    "boot_ids": tuple(dict.fromkeys(g["boot_id"])), "first": first["timestamp"],
                    "code": "/".join(dict.fromkeys(str(v) for v in g["git_sha"])) if "git_sha" in g else "",
                    "iters": "/".join(f"{w:g}+{s:g}" for w, s in g[["warmup", "steps"]].drop_duplicates().values),
                    "runs": ", ".join(f"{c} {counts.get(c, 0)}" for c in listed),
                    **{c: med.get(c, math.nan) for c in [*FIXED, *sorted(set(med.index) - set(FIXED))]},
                    "best_fixed": best, "best_fixed_s": med.min() if len(med) else math.nan,
                    "auto_s": auto["iter_s"].median() if len(auto) else math.nan, "auto_incl_s": incl,
                    "auto_vs_best": incl / med.min() - 1 if len(med) and len(auto) else math.nan,
                    # reported, not graded: every run's mean iteration over the same window of
                    # steps (WINDOW_FROM..end), auto's against the best fixed plan's (medians)
                    "auto_window_vs_best": (auto["iter_window_s"].median()
                                            / fixed.groupby("config")["iter_window_s"].median().min() - 1
                                            if len(auto) and fixed["iter_window_s"].notna().any() else math.nan),
                    "auto_range_s": _rng(auto["iter_incl_s"]), "kept": "; ".join(auto["kept"].astype(str)),
                    "explore_steps": ", ".join(str(x) for x in auto["explore_steps"]),
                    "fixed_spread": spread.median() if len(spread) else math.nan,
                    "fixed_spread_max": spread.max() if len(spread) else math.nan,
                    # what the plan controls (the update phase) and what it does not (forward and
                    # backward: the same GPU work in every run of a shape, so its spread is the host's)
                    "auto_step_vs_best": (auto["step_s"].median()
                                          / fixed[fixed["config"].eq(best)]["step_s"].median() - 1
                                          if best is not None and len(auto) else math.nan),
                    "fwd_bwd_spread": ((g["fwd_bwd_s"].max() - g["fwd_bwd_s"].min()) / g["fwd_bwd_s"].median()
                                       if g["fwd_bwd_s"].notna().any() else math.nan),
                    # the host's CPU used by anything but the run, over the batch's runs (min-max)
                    "host_other_pct": _rng(g["host_cpu_other_pct"].dropna(), ".1f"),
                    "host_steal_pct": _rng(g["host_cpu_steal_pct"].dropna(), ".1f"),
                    # the GPU's SM clock over the batch's runs (min-max of their medians) and the
                    # clock-event reasons any run saw (a power cap, a thermal slowdown)
                    "gpu_sm_mhz": _rng(g["gpu_sm_mhz"].dropna(), ".0f") if "gpu_sm_mhz" in g else "",
                    "gpu_clock_events": (", ".join(sorted({e for x in g["gpu_clock_events"].dropna()
                                                           for e in str(x).split(", ") if e}))
                                         if "gpu_clock_events" in g else ""),
                    "round_robin": rr, "complete": enough and one_unit and rr,
                    "_enough": enough, "_one_unit": one_unit, "_medians": med, "_auto": auto})
    return out


def planner_check(df: pd.DataFrame) -> CheckTable:
    """Issue 15, criterion 1, per (shape, batch) (ratios only within one batch; rows without a
    batch_id left out): the median iteration of each fixed plan (columns cpu, k=1, ...), the
    best of them, auto's median over its measured steps (`auto_s`) and with its exploration
    spread over the run (`auto_incl_s`, the median of `iter_incl_s`), `auto_vs_best` =
    auto_incl_s / best fixed median - 1, auto's min-max (exploration included), the plans its
    runs kept, the runs of each configuration, and the run-to-run noise that bounds the
    comparison: `fixed_spread` (median over the fixed plans of (max - min) / median of their
    runs) and `fixed_spread_max`; beside them what the plan controls and what it does not:
    `auto_step_vs_best` (auto's median update phase over the best fixed plan's) and
    `fwd_bwd_spread` ((max - min) / median of forward + backward over the batch's runs), the
    host's CPU used by others and stolen over the runs (`host_other_pct`, `host_steal_pct`), the
    GPU's SM clock (min-max of the runs' medians, `gpu_sm_mhz`) and the reasons NVML gave for
    clocks below their maximum (`gpu_clock_events`), and,
    reported not graded, `auto_window_vs_best`: the same comparison over every run's mean
    iteration from step WINDOW_FROM to its end (exploration as it ran, and the fixed plans' own
    early steps; `iter_window_s`). PASS
    when auto_vs_best <= 0.05 and the protocol held: >= 3 runs of each of cpu, k=1,2,3,4,6, auto; one warm-up and step count for all (the
    comparison unit of iter_incl_s); round-robin order. `why` names what missed. `df`:
    `planner_runs` output. Raises on empty input."""
    require_rows(df, "planner_check")
    out = []
    for b in _batches(df):
        why = []
        if not b["auto_vs_best"] <= AUTO_VS_BEST:
            # what bounds the comparison: the same fixed plan's runs differ by this much
            noise = (f" (a fixed plan's runs spread {b['fixed_spread']:.1%} of its median, up to "
                     f"{b['fixed_spread_max']:.1%}" if b["fixed_spread"] == b["fixed_spread"] else "")
            if noise and b["auto_step_vs_best"] == b["auto_step_vs_best"]:
                noise += (f"; update phase: auto {b['auto_step_vs_best']:+.1%} of {b['best_fixed']}; forward + "
                          f"backward, the same work in every run, spread {b['fwd_bwd_spread']:.0%} over the batch")
                if b["host_other_pct"]:
                    noise += (f"; the host's CPU used by others {b['host_other_pct']}%, stolen "
                              f"{b['host_steal_pct']}% of its CPUs over the runs")
                if b["gpu_sm_mhz"]:
                    noise += f"; the GPU's SM clock {b['gpu_sm_mhz']} MHz (run medians)"
                    noise += f", held down by {b['gpu_clock_events']}" if b["gpu_clock_events"] else ""
            noise += ")" if noise else ""
            why.append(f"auto {b['auto_vs_best']:+.1%} of {b['best_fixed']}{noise}" if b["auto_vs_best"] == b["auto_vs_best"]
                       else "no auto or fixed runs")
        if not b["_enough"]:
            why.append(f"fewer than {MIN_RUNS} runs of some configuration")
        if not b["_one_unit"]:
            why.append("runs differ in warm-up or steps")
        if not b["round_robin"]:
            why.append("not round-robin")
        row = {k: v for k, v in b.items() if not k.startswith("_") and k not in ("boot_ids", "first", "own_shape")}
        out.append({**row, "why": "; ".join(why), "target": PLANNER_TARGET_TEXT, "verdict": MISS if why else PASS})
    return _check_table(out, ("shape", "batch_id", "best_fixed", "auto_vs_best"))


def planner_coverage_check(df: pd.DataFrame) -> CheckTable:
    """Issue 15, criterion 1's shapes: one row per requirement over the shapes with a complete
    batch (the protocol of `planner_check` held: >= 3 runs of each configuration, one warm-up,
    round-robin; whatever auto's result): >= 4 such shapes, >= 2 of them own shapes (outside the
    presets: the sweep sets model_overrides), the 3B preset uncapped and the 7B preset with the
    GPU capped at 40 GiB (COVERAGE). A MISS names what is missing. Raises on empty input."""
    require_rows(df, "planner_coverage_check")
    done = [b for b in _batches(df) if b["complete"]]
    shapes = list(dict.fromkeys(b["shape"] for b in done))
    own = list(dict.fromkeys(b["shape"] for b in done if b["own_shape"]))
    target = (f">= {COVERAGE['shapes']} shapes with a complete batch, among them {COVERAGE['own_shapes']} own "
              "shapes and " + " and ".join(_preset_name(m, c) for m, c in COVERAGE["presets"]))
    out = [{"requirement": "shapes with a complete batch", "need": COVERAGE["shapes"], "have": len(shapes),
            "shapes": ", ".join(shapes)},
           {"requirement": "own shapes (outside the presets)", "need": COVERAGE["own_shapes"], "have": len(own),
            "shapes": ", ".join(own)}]
    for model, cap in COVERAGE["presets"]:
        hit = list(dict.fromkeys(b["shape"] for b in done if not b["own_shape"] and b["model"] == model
                                 and _same_cap(b["gpu_cap_gib"], cap)))
        out.append({"requirement": _preset_name(model, cap), "need": 1, "have": len(hit), "shapes": ", ".join(hit)})
    for r in out:
        held = r["have"] >= r["need"]
        r.update(why="" if held else f"{r['requirement']}: {r['have']} of {r['need']}", target=target,
                 verdict=PASS if held else MISS)
    return _check_table(out, ("requirement", "need", "have"))


def _same_cap(have, want) -> bool:
    have = None if have is None or have != have else float(have)
    return have == want


def _preset_name(model: str, cap) -> str:
    return f"{model} with the GPU capped at {cap:g} GiB" if cap is not None else f"{model} uncapped"


# ---------------------------------------------------------------- criterion 2

PREDICTIONS = (("in situ", "refined_predicted_s", True), ("offline", "predicted_step_s", False))


def planner_prediction_check(df: pd.DataFrame) -> CheckTable:
    """Issue 15, criterion 2: for the plans auto chose (its runs), the relative error
    |predicted - measured| / measured of the update phase (`step_s`, over the measured steps, all
    of the kept plan), over every auto run of every shape (per shape in `by_shape`: median / worst
    (runs)), with two predictions: `in situ` (refined_predicted_s: the planner's prediction of the
    kept plan after fitting its rates from the exploration steps' lane timelines) and `offline`
    (predicted_step_s: the calibration profile's). Only the in-situ row is graded: the prediction
    the planner makes for the plan it keeps is the refined one; the offline one is reported beside
    it (graded False) so that a reader sees the offline profile's error. Target: median <= 0.10,
    worst <= 0.20. Raises on empty input."""
    require_rows(df, "planner_prediction_check")
    auto = df[df["config"].eq(AUTO)]
    target = f"median error <= {PREDICTION_TARGET['median_error']:g}, worst <= {PREDICTION_TARGET['worst_error']:g}"
    out = []
    for kind, col, graded in PREDICTIONS:
        a = auto[auto[col].notna() & auto["step_s"].notna()]
        err = (a[col] - a["step_s"]).abs() / a["step_s"]
        worst = a.loc[err.idxmax()] if len(a) else None
        by = [f"{s}: {e.median():.3f} / {e.max():.3f} ({len(e)})" for s, e in err.groupby(a["shape"], sort=False)]
        held = (len(a) and err.median() <= PREDICTION_TARGET["median_error"]
                and err.max() <= PREDICTION_TARGET["worst_error"])
        why = "" if held else (f"{kind}: median {err.median():.1%}, worst {err.max():.1%}" if len(a) else
                               f"no auto run recorded an {kind} prediction")
        out.append({"prediction": kind, "column": col, "runs": len(a),
                    "median_error": err.median() if len(a) else math.nan,
                    "worst_error": err.max() if len(a) else math.nan,
                    "worst_run": f"{worst['shape']}/{worst['run_id']}" if worst is not None else "",
                    "by_shape": "; ".join(by), "graded": graded, "why": why, "target": target,
                    "verdict": PASS if held else MISS})
    return _check_table(out, ("prediction", "runs", "median_error", "worst_error"))


# ---------------------------------------------------------------- criterion 3

def _choice(b: dict) -> tuple:
    """A batch's auto choice: its most common kept plan. On a tie the one whose fixed median is
    slowest (unknown counts as slowest): the verdict never rests on a lucky tie-break."""
    counts = Counter(b["_auto"]["kept"].dropna())
    if not counts:
        return None, False
    top = max(counts.values())
    tied = [k for k, n in counts.items() if n == top]
    med = b["_medians"]
    slow = max(tied, key=lambda k: med.get(_as_config(k), math.inf))
    return slow, len(tied) > 1


def planner_repeat_check(df: pd.DataFrame) -> CheckTable:
    """Issue 15, criterion 3: per shape, each batch with auto runs against the shape's previous
    complete batch on a freshly started machine (no boot_id in common). Each batch's choice is the
    plan its auto runs kept most often (`_choice`: ties broken towards the slowest); `*_vs_best`
    is that choice's fixed-plan median (the fixed run of its stride, or all-CPU) over the batch's
    best fixed median - 1. A row passes when both choose the same plan, or both choices are within
    5% of their batch's best, and both batches are complete (`complete` of planner_check).

    Graded: per shape, its latest pair of complete batches — the repeat of the method as it
    stands; earlier pairs (older code: `*_code`) and pairs with a batch cut short are reported,
    not graded. (Until 2026-12-06 every batch was compared with the shape's earliest one, which
    pinned the reference to a batch of a planner since replaced: docs/DESIGN.md's decision log.)
    No shape repeated on a second machine: one MISS row saying so. Raises on empty input."""
    require_rows(df, "planner_repeat_check")
    by_shape = {}
    for b in _batches(df):
        if len(b["_auto"]):
            by_shape.setdefault(b["shape"], []).append(b)
    out = []
    target = f"same choice, or both choices' fixed medians <= {1 + REPEAT_TOLERANCE:g} x their batch's best"
    for shape, bs in by_shape.items():
        rows, prev = [], None  # prev: the latest complete batch so far
        for b in sorted(bs, key=lambda b: b["first"]):
            if prev is not None and not set(b["boot_ids"]) & set(prev["boot_ids"]):
                rows.append(_repeat_row(shape, prev, b, target))
            if b["complete"]:
                prev = b
        full = [r for r in rows if r["complete"]]
        for r in rows:
            r["graded"] = r is (full[-1] if full else None)
        out += rows
    if not any(r["graded"] for r in out):
        out.append({"shape": ", ".join(by_shape) or "-", "why": NO_REPEAT, "graded": True,
                    "target": target, "verdict": MISS})
    return _check_table(out, ("shape", "same_choice"))


def _repeat_row(shape: str, ref: dict, b: dict, target: str) -> dict:
    row = {"shape": shape}
    for tag, x in (("first", ref), ("second", b)):
        choice, tied = _choice(x)
        fixed = x["_medians"].get(_as_config(choice), math.nan) if choice else math.nan
        row.update({f"{tag}_batch": x["batch_id"], f"{tag}_code": x.get("code", ""),
                    f"{tag}_choice": choice, f"{tag}_tied": tied, f"{tag}_kept": x["kept"],
                    f"{tag}_best": x["best_fixed"], f"{tag}_vs_best": fixed / x["best_fixed_s"] - 1})
    same = row["first_choice"] is not None and row["first_choice"] == row["second_choice"]
    near = all(row[f"{t}_vs_best"] <= REPEAT_TOLERANCE for t in ("first", "second"))
    # a batch cut short (fewer than 3 runs of a configuration) has no choice to compare yet
    short = [f"{t} batch incomplete ({x['runs']})" for t, x in (("first", ref), ("second", b))
             if not x["complete"]]
    return {**row, "same_choice": same, "complete": not short, "why": "; ".join(short),
            "target": target, "verdict": PASS if (same or near) and not short else MISS}


def verdict_line(name: str, chk: CheckTable) -> str:
    """One line in plain words: the criterion, its verdict, and why a MISS missed."""
    if not len(chk):
        return f"{name}: {MISS} (no records)"
    why = [str(w) for w in chk.graded.get("why", pd.Series(dtype=str)) if isinstance(w, str) and w]
    return f"{name}: {chk.summary()}" + (f" -- {'; '.join(dict.fromkeys(why))}" if why else "")
