"""Issue 17's checks (fewer bytes per parameter): convergence per moment format against the
no-offload band, update-phase speed per format, what fits one GPU machine, host bytes per
non-resident parameter. Each returns a `CheckTable` (dos.lab.verdicts) and raises ValueError on
empty input; `dos.lab.checks` re-exports them. Split from dos/lab/checks.py."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import pandas as pd

from dos.lab.results import NO_OFFLOAD, baseline_key, require_rows
from dos.lab.verdicts import MISS, PASS, CheckTable, _check_table


def _dtype_of(df: pd.DataFrame) -> pd.Series:
    return df["state_dtype"].replace("", "fp32").fillna("fp32") if "state_dtype" in df else \
        pd.Series("fp32", index=df.index)


def _rng(v: pd.Series) -> str:
    return f"{v.min():.4g}-{v.max():.4g}" if len(v) else ""


CONVERGENCE_BAND_TOLERANCE = 0.01
"""Issue 17, criterion 2: bf16 moments within the no-offload band, or within 1% of dos fp32."""


def final_losses(steps: pd.DataFrame, window: int = 50, upto: Optional[int] = None) -> pd.DataFrame:
    """Per run (run_id): the mean loss of its last `window` measured steps (`final_mean`), with its
    key, system, state precision and last step (`last_step`); with `upto`, of the steps up to that
    one (a shorter run's window, in a longer one)."""
    require_rows(steps, "final_losses")
    s = steps[steps["measured"].astype(str).eq("True")] if "measured" in steps else steps
    if upto is not None:
        s = s[s["step"] <= upto]
    s = s.assign(state_dtype=_dtype_of(s)).sort_values("step")
    out = []
    for rid, g in s.groupby("run_id", sort=False):
        g = g.drop_duplicates("step", keep="last")
        tail = g.tail(window)
        out.append({"run_id": rid, "key": g["key"].iloc[0], "system": g["system"].iloc[0] if "system" in g else "",
                    "state_dtype": g["state_dtype"].iloc[0], "steps": len(g),
                    "batch_id": g["batch_id"].iloc[0] if "batch_id" in g else "",
                    "last_steps": f"{tail['step'].iloc[0]}-{tail['step'].iloc[-1]}",
                    "last_step": int(tail["step"].iloc[-1]), "final_mean": tail["loss"].mean()})
    return pd.DataFrame(out)


def state_dtype_convergence_check(steps: pd.DataFrame, window: int = 50, baselines: Sequence[str] = NO_OFFLOAD,
                                  tolerance: float = CONVERGENCE_BAND_TOLERANCE,
                                  graded: Sequence[str] = ("bf16",), ours: str = "dos") -> CheckTable:
    """Issue 17, criterion 2: per system key and state precision, the median over its runs of the
    final `window`-step mean loss, against (a) the no-offload band: min-max of the no-offload
    baseline's own repeated runs (its run-to-run spread; >= 2 runs make a band), and (b) dos with
    fp32 moments of the same key (else any dos fp32 run). PASS when inside the band or within
    `tolerance` (1%) of fp32. Graded: `ours` rows whose state precision is in `graded` (bf16
    moments); int8, dos fp32 itself and other systems (DeepSpeed's bf16 offload) are reported
    beside them with the same test. Each row is compared over its own runs' last `window` steps
    (a shorter run against the band and fp32 over those steps) and names the batches it draws on.
    Raises on empty input."""
    require_rows(steps, "state_dtype_convergence_check")
    columns = ("key", "state_dtype", "batches", "last_steps", "final_mean", "band", "vs_fp32")
    fin = final_losses(steps, window)
    base_key = baseline_key(fin["key"], baselines)
    out = []
    for (key, dt), g in fin[fin["key"].ne(base_key)].groupby(["key", "state_dtype"], sort=False):
        # Every comparison over one step window: a shorter run (DeepSpeed's, cut to fit a device
        # call) is held against the band and fp32 over its own last `window` steps, not theirs.
        upto = int(g["last_step"].min())
        at = final_losses(steps, window, upto=upto)
        base = at[at["key"].eq(base_key)]["final_mean"] if base_key else pd.Series(dtype=float)
        lo, hi = (base.min(), base.max()) if len(base) >= 2 else (math.nan, math.nan)
        fp32 = at[at["system"].eq(ours) & at["state_dtype"].eq("fp32")]
        runs = at[at["run_id"].isin(g["run_id"])]
        x = runs["final_mean"].median()
        ref = fp32[fp32["key"].eq(key)] if fp32["key"].eq(key).any() else fp32
        ref_x = ref["final_mean"].median() if len(ref) else math.nan
        in_band = bool(lo <= x <= hi)
        vs = x / ref_x - 1 if ref_x == ref_x else math.nan
        held = in_band or (vs == vs and abs(vs) <= tolerance)
        # Loss, not speed: a row may come from another batch than the band (another machine
        # start: GPU nondeterminism alone); `batches` says so where it does.
        batches = sorted({str(b) for b in pd.concat([g["batch_id"], at[at["key"].eq(base_key)]["batch_id"],
                                                     ref["batch_id"]])})
        out.append({"key": key, "state_dtype": dt, "runs": len(g), "last_steps": runs["last_steps"].iloc[0],
                    "batches": ", ".join(b for b in batches if b),
                    "final_mean": x,
                    "baseline": base_key, "baseline_runs": len(base), "band": f"{lo:.4f}-{hi:.4f}" if lo == lo else "",
                    "in_band": in_band, "fp32_final_mean": ref_x, "vs_fp32": vs,
                    "graded": bool(g["system"].eq(ours).all() and dt in graded),
                    "target": f"final {window}-step mean inside the no-offload band (min-max of its runs) "
                              f"or within {tolerance:.0%} of dos fp32, over the same steps",
                    "verdict": PASS if held else MISS})
    return _check_table(out, columns)


STATE_SPEED_TARGET = 1.35
"""Issue 17, criterion 3: the update phase with bf16 moments >= 1.35x faster than with fp32 state."""
LOWP_BASELINES = ("deepspeed-zero2-offload-bf16", "torchao-cpu-offload")


def _vals(g: pd.DataFrame, key: str, dt: str, metric: str) -> pd.Series:
    return g[g["key"].eq(key) & g["state_dtype"].eq(dt)][metric].astype(float).dropna()


def state_dtype_speed_check(df: pd.DataFrame, keys: Sequence[str] = ("dos-cpu", "dos-auto"),
                            baselines: Sequence[str] = LOWP_BASELINES, target: float = STATE_SPEED_TARGET,
                            min_runs: int = 3, models: Optional[Sequence[str]] = None) -> CheckTable:
    """Issue 17, criterion 3, per batch (ratios only within one batch_id) and model: for each dos
    key of `keys`, the median update phase (`step_s`) with fp32 state over the median with bf16
    moments (PASS when >= `target`; int8 reported beside it); and the dos bf16-moment median
    iteration (`iter_s`) over each of `baselines`' (PASS when < 1: faster). Medians with min-max
    ranges; a graded row needs >= `min_runs` runs on each side. Rows without a batch_id are left
    out. bf16 moments come in two formats: "bf16" (fp32 master) and "bf16-split" (the master as
    its bf16 weight and a remainder, fewer bytes; docs/DESIGN.md §3.7); where a batch has
    bf16-split rows of a key those are graded (the format for bf16 parameters) and the bf16 rows
    reported beside them, else the bf16 rows are graded. Raises on empty input."""
    require_rows(df, "state_dtype_speed_check")
    d = df[df["status"].eq("ok")] if "status" in df else df
    d = d.assign(state_dtype=_dtype_of(d))
    d = d[d["batch_id"].astype(str).ne("")]
    if models is not None:
        d = d[d["model"].isin(list(models))]
    out = []
    for (batch, model), g in d.groupby(["batch_id", "model"], sort=False):
        for key in keys:
            fp32 = _vals(g, key, "fp32", "step_s")
            bf = "bf16-split" if len(_vals(g, key, "bf16-split", "step_s")) else "bf16"
            for dt in ("bf16", "bf16-split", "int8"):
                low = _vals(g, key, dt, "step_s")
                if not len(fp32) or not len(low):
                    continue
                r = fp32.median() / low.median()
                enough = len(fp32) >= min_runs and len(low) >= min_runs
                out.append({"batch_id": batch, "model": model, "key": key, "state_dtype": dt, "metric": "step_s",
                            "comparison": f"update phase: fp32 state / {dt} moments", "median_s": low.median(),
                            "range_s": _rng(low), "runs": len(low), "reference": f"{key} fp32",
                            "reference_median_s": fp32.median(), "reference_range_s": _rng(fp32),
                            "reference_runs": len(fp32), "value": r, "graded": dt == bf,
                            "target": f"speedup >= {target} (medians, >= {min_runs} runs each, one batch)",
                            "verdict": PASS if r >= target and enough else MISS})
            ours = _vals(g, key, bf, "iter_s")
            for b in baselines:
                theirs = g[g["key"].eq(b)]["iter_s"].astype(float).dropna()
                if not len(ours) or not len(theirs):
                    continue
                r = ours.median() / theirs.median()
                enough = len(ours) >= min_runs and len(theirs) >= min_runs
                out.append({"batch_id": batch, "model": model, "key": key, "state_dtype": bf, "metric": "iter_s",
                            "comparison": f"iteration: dos {bf} moments / {b}", "median_s": ours.median(),
                            "range_s": _rng(ours), "runs": len(ours), "reference": b,
                            "reference_median_s": theirs.median(), "reference_range_s": _rng(theirs),
                            "reference_runs": len(theirs), "value": r, "graded": True,
                            "target": f"ratio < 1 (faster; medians, >= {min_runs} runs each, one batch)",
                            "verdict": PASS if r < 1 and enough else MISS})
    return _check_table(out, ("batch_id", "model", "key", "comparison", "value"))


SPEED_MODELS = ("3B", "5B")
"""Issue 17, criterion 3's models: 3B and the ~5B shape (`5B` in the sweeps)."""


def state_dtype_speed_criterion(df: pd.DataFrame, models: Sequence[str] = SPEED_MODELS,
                                keys: Sequence[str] = ("dos-cpu", "dos-auto"),
                                baselines: Sequence[str] = LOWP_BASELINES, target: float = STATE_SPEED_TARGET,
                                min_runs: int = 3) -> CheckTable:
    """Issue 17, criterion 3 as one verdict ("same batch, 3B and ~5B"): per model of `models`, the
    rows of `state_dtype_speed_check` from the model's latest *complete* batch are graded, where
    complete means the batch has every part of the criterion with >= `min_runs` runs on each
    side: for each of `keys` the graded update-phase ratio, and the bf16-moment iteration against
    each of `baselines`. Every other batch's rows are reported, not graded, with `role` saying
    why (superseded by the later complete batch, or incomplete: which parts it lacks). A model
    without a complete batch adds a MISS row saying so. Latest = the batch's last row timestamp
    (else its batch_id, which starts with its UTC start). The rule was fixed before the batches it
    grades ran (docs/DESIGN.md decision log, 2026-12-07): not chosen after seeing their numbers.
    Raises on empty input."""
    require_rows(df, "state_dtype_speed_criterion")
    chk = state_dtype_speed_check(df, keys=keys, baselines=baselines, target=target, min_runs=min_runs,
                                  models=models)
    d = df[df["batch_id"].astype(str).ne("")]
    when = (d.groupby("batch_id")["timestamp"].max().astype(str) if "timestamp" in d else
            pd.Series({b: str(b) for b in d["batch_id"].unique()}))
    need = [(k, "step_s", None) for k in keys] + [(k, "iter_s", b) for k in keys for b in baselines]
    out = pd.DataFrame(chk).copy()
    out["role"] = ""
    out["graded"] = False
    extra = []
    for model in models:
        m = out[out["model"].eq(model)]
        complete, lacking = [], {}
        for batch, g in m.groupby("batch_id", sort=False):
            g = g[chk.loc[g.index, "graded"].astype(bool)]
            missing = []
            for key, metric, base in need:
                r = g[g["key"].eq(key) & g["metric"].eq(metric)]
                if base is not None:
                    r = r[r["reference"].eq(base)]
                if not len(r) or not ((r["runs"] >= min_runs) & (r["reference_runs"] >= min_runs)).any():
                    missing.append(f"{key} {'update' if base is None else 'vs ' + base}")
            if missing:
                lacking[batch] = missing
            else:
                complete.append(batch)
        latest = max(complete, key=lambda b: (str(when.get(b, b)), str(b))) if complete else None
        for batch in m["batch_id"].unique():
            sel = out["model"].eq(model) & out["batch_id"].eq(batch)
            if batch == latest:
                out.loc[sel, "graded"] = chk.loc[sel, "graded"].astype(bool)
                out.loc[sel, "role"] = "graded: the model's latest complete batch"
            elif batch in lacking:
                out.loc[sel, "role"] = "reported: incomplete batch (lacks " + ", ".join(lacking[batch]) + ")"
            else:
                out.loc[sel, "role"] = f"reported: superseded by the later complete batch {latest}"
        if latest is None:
            extra.append({"batch_id": "", "model": model, "key": "", "state_dtype": "", "metric": "",
                          "comparison": "every part of criterion 3 in one batch", "value": math.nan,
                          "graded": True, "role": "graded: no complete batch",
                          "target": f"a batch with every part, >= {min_runs} runs each", "verdict": MISS})
    if extra:
        out = pd.concat([out, pd.DataFrame(extra)], ignore_index=True)
    return CheckTable(out)


CAPACITY_CASES = {"13B": ("fp32",), "20B": ("bf16", "int8")}
"""Issue 17, criterion 4: the model that must train with each set of moment formats (any one)."""


def _host_need(error: str) -> float:
    """GiB a preflight-skipped row said it needs (`... needs ~X GiB ...`), else NaN."""
    import re

    m = re.search(r"needs ~([\d.]+) GiB", str(error or ""))
    return float(m.group(1)) if m else math.nan


def _estimated_need(row) -> tuple:
    """(GiB, how) the sweep's preflight estimates a row's run needs of host memory (dos.lab.preflight
    .host_bytes_estimate, from the run's recorded spec); (NaN, "") where the row has no spec."""
    import json

    from dos.lab.bench.spec import RunSpec
    from dos.lab.preflight import host_bytes_estimate

    try:
        cfg = row["config"]
        spec = RunSpec.from_dict((json.loads(cfg) if isinstance(cfg, str) else cfg)["run"])
        need, how = host_bytes_estimate(spec)
    except (KeyError, TypeError, ValueError):
        return math.nan, ""
    return need / 2**30, how


def capacity_check(df: pd.DataFrame, cases: Optional[dict] = None, steps: int = 20, ours: str = "dos",
                   others: Sequence[str] = ("deepspeed-zero2-offload", "deepspeed-zero2-offload-bf16")) -> CheckTable:
    """Issue 17, criterion 4: for each model of `cases` (model -> moment formats, any one of which
    must work; CAPACITY_CASES), each format's latest `ours` row: PASS when it ran (status ok)
    >= `steps` measured steps with a finite last loss; its peak GPU and host memory, s/iter and
    host bytes per parameter beside it. A model's verdict needs one format: the formats that
    passed are graded (all of them when none did). `others` (DeepSpeed's offload at the same
    models) are reported, not graded, with the host memory they needed (measured, or the
    preflight's estimate from a skipped row). `df` holds every status (results.rows(dirs,
    status=records.STATUSES)). Raises on empty input."""
    require_rows(df, "capacity_check")
    cases = CAPACITY_CASES if cases is None else cases
    d = df.assign(state_dtype=_dtype_of(df)).sort_values("timestamp")
    out = []
    for model, formats in cases.items():
        rows_ = []
        for dt in formats:
            m = d[d["system"].eq(ours) & d["model"].eq(model) & d["state_dtype"].eq(dt)]
            ok = m[m["status"].eq("ok")] if len(m) else m
            r = (ok if len(ok) else m).iloc[-1] if len(m) else None
            n = float(r["steps"]) if r is not None and r["steps"] == r["steps"] else 0.0
            loss = float(r["loss_last"]) if r is not None and r["loss_last"] == r["loss_last"] else math.nan
            held = r is not None and r["status"] == "ok" and n >= steps and math.isfinite(loss)
            rows_.append({"model": model, "system": ours, "key": r["key"] if r is not None else None,
                          "state_dtype": dt, "status": r["status"] if r is not None else "no run",
                          "steps": n, "loss_last": loss,
                          "iter_s": r["iter_s"] if r is not None else math.nan,
                          "peak_gpu_gib": r["peak_gpu_gib"] if r is not None else math.nan,
                          "peak_host_gib": r["peak_host_gib"] if r is not None else math.nan,
                          "host_need_gib": _host_need(r["error"]) if r is not None else math.nan,
                          "host_bytes_per_param": r["host_bytes_per_param"] if r is not None else math.nan,
                          "gpu_fraction": r["gpu_fraction"] if r is not None else None,
                          "why": (str(r["error"])[:160] if r is not None and not held else ""),
                          "run_id": r["run_id"] if r is not None else None,
                          "target": f"{model} with {' or '.join(formats)} moments: {steps} steps, finite loss",
                          "verdict": PASS if held else MISS})
        any_pass = any(x["verdict"] == PASS for x in rows_)
        for x in rows_:
            x["graded"] = x["verdict"] == PASS or not any_pass
        out += rows_
        for sysname in others:
            m = d[d["system"].eq(sysname) & d["model"].eq(model)]
            if not len(m):
                continue
            r = m.iloc[-1]
            need, why = (r["peak_host_gib"] if r["status"] == "ok" else _host_need(r["error"])), str(r["error"] or "")
            if not need == need:  # skipped for another reason (e.g. not installed): the preflight's estimate
                need, how = _estimated_need(r)
                why += f"; preflight estimate: {how}" if how else ""
            out.append({"model": model, "system": sysname, "key": r["key"], "state_dtype": r["state_dtype"],
                        "status": r["status"], "steps": r["steps"], "loss_last": r["loss_last"],
                        "iter_s": r["iter_s"], "peak_gpu_gib": r["peak_gpu_gib"], "peak_host_gib": r["peak_host_gib"],
                        "host_need_gib": need,
                        "host_bytes_per_param": r["host_bytes_per_param"], "gpu_fraction": None,
                        "why": why[:200], "run_id": r["run_id"], "graded": False,
                        "target": "reported beside dos (host memory it needs)",
                        "verdict": PASS if r["status"] == "ok" else MISS})
    return _check_table(out, ("model", "system", "state_dtype", "status"))


HOST_BYTES_TARGET = {"bf16": 10.0, "int8": 8.0, "bf16-split": 10.0}
"""Issue 17, criterion 5: host bytes per non-resident parameter."""
NOMINAL_HOST_BYTES = {"fp32": 14.0, "bf16": 10.0, "int8": 8.0 + 8 / 2048, "bf16-split": 10.0}
"""What each format needs per element: fp32 master 4 + moments (8, 4, or 2 + two fp32 scales per
2048-element block) + the bf16 gradient slot 2 (dos.state_format; dos.lab.sweep.DOS_STATE_BPP)."""


def host_bytes_check(df: pd.DataFrame, targets: Optional[dict] = None, ours: str = "dos") -> CheckTable:
    """Issue 17, criterion 5, per model and state precision of `ours`' ok rows: the measured host
    bytes per non-resident parameter, `host_bytes_per_param` (the optimizer's describe(): arena
    bytes over all parameters) / the non-resident share (1 - the plan's resident fraction), the
    largest over the rows. PASS when <= the format's target (HOST_BYTES_TARGET), compared as
    recorded (4 decimals), never rounded further: int8's two fp32 scales per 2048-element block
    (8/2048 = 0.0039 B per element) make it 8.004 > 8, a MISS whose `reason` says so; padding (each
    parameter 64-element aligned, a short last block) shows as the excess over the nominal bytes.
    fp32 rows are reported (14 B), not graded. Rows with `grad_ring` (spec_grad_ring: K shared host
    gradient slots, no 2 B slot per subgroup) form a configuration of their own. A configuration's
    bytes are its worst row over every model it ran (the bytes per parameter are the format's and
    the configuration's, not the model's: only padding differs); per format the configuration with
    the fewest is graded, on each model it ran, and the others are reported. Raises on empty
    input."""
    require_rows(df, "host_bytes_check")
    targets = HOST_BYTES_TARGET if targets is None else targets
    d = df[df["status"].eq("ok")] if "status" in df else df
    d = d[d["system"].eq(ours)].assign(state_dtype=_dtype_of(d[d["system"].eq(ours)]))
    res = d["resident_fraction"].astype(float) if "resident_fraction" in d else pd.Series(0.0, index=d.index)
    share = 1.0 - res.fillna(0.0)
    d = d.assign(nonresident_share=share,
                 per_nonresident=d["host_bytes_per_param"].astype(float) / share.where(share > 0))
    d = d[d["per_nonresident"].notna()]
    ring = d["spec_grad_ring"] if "spec_grad_ring" in d else pd.Series(math.nan, index=d.index)
    d = d.assign(grad_ring=pd.to_numeric(ring, errors="coerce").fillna(0).astype(int))
    # per configuration (grad_ring: K shared gradient slots, or 0: one per subgroup) the largest
    # over its rows of every model; per format the best configuration is graded, the others reported
    worst = d.groupby(["state_dtype", "grad_ring"])["per_nonresident"].max()
    best = worst.groupby(level=0).idxmin()
    out = []
    for (model, dt, k), g in d.groupby(["model", "state_dtype", "grad_ring"], sort=False):
        r = g.loc[g["per_nonresident"].idxmax()]
        v, nominal = float(r["per_nonresident"]), NOMINAL_HOST_BYTES.get(dt, math.nan) - (2.0 if k else 0.0)
        t = targets.get(dt, nominal)
        held = v <= t
        reason = ""
        if not held:
            parts = []
            if nominal > t:
                why = ("two fp32 scales per 2048-element block: 8/2048 = 0.0039 B per element"
                       if dt == "int8" else "nominal")
                parts.append(f"the format needs {nominal:.4f} B ({why})")
            if v > nominal:
                parts.append(f"padding +{v - nominal:.4f} B (64-element alignment, short last block"
                             + (f", {k} ring slots)" if k else ")"))
            reason = "; ".join(parts) or "above target"
        out.append({"model": model, "state_dtype": dt, "grad_ring": k, "runs": len(g), "key": r["key"],
                    "run_id": r["run_id"], "host_bytes_per_param": float(r["host_bytes_per_param"]),
                    "nonresident_share": float(r["nonresident_share"]), "per_nonresident_param": v,
                    "nominal": nominal, "excess": v - t, "reason": reason,
                    "graded": dt in targets and best[dt] == (dt, k),
                    "target": f"<= {t:g} B per non-resident parameter ({dt})",
                    "verdict": PASS if held else MISS})
    return _check_table(out, ("model", "state_dtype", "per_nonresident_param"))
