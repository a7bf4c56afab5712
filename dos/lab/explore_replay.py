"""Replaying recorded explorations offline (issue 15): how another scoring of the candidates would
have chosen, from what each exploring run recorded, before any such scoring is built.

An exploring run (stride="auto") records its explorations in result.json (`online.explorations`:
each candidate's plan, predicted update phase, and `measured_s`, the iteration period the Planner
timed: its update phase plus the next forward and backward) and every step in steps.csv
(`fwd_s`, `bwd_s`, `step_s` = the update phase). With one step per candidate (dos.explore.STEPS_PER)
candidate i of an exploration that starts at Planner step s ran Planner step s + i, which is
steps.csv row s + i - 1 (the Planner counts optimizer steps from 1, the bench its rows from 0). That
alignment is checked, not assumed: a candidate is `aligned` when the period rebuilt from steps.csv
(row's `step_s` + next row's `fwd_s` + `bwd_s`) is within `ALIGN_TOL` of its recorded `measured_s`;
a run's replay is used only where every candidate is aligned (older records timed steps otherwise).

`exploration_replay` gives one row per candidate; `replay_choices` one row per exploration: the
plan kept by the period (what the Planner did), the plan an update-phase score would keep, and the
batch's fixed-plan medians of both, where the batch ran that plan as a fixed configuration.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from dos.lab.results import require_rows

ALIGN_TOL = 0.02
"""A candidate's period rebuilt from steps.csv within 2% of its recorded `measured_s`."""


def _plan_name(stride) -> str:
    return "cpu" if stride is None or (isinstance(stride, float) and math.isnan(stride)) else str(stride)


def _fixed_name(row) -> str:
    return "cpu" if row["key"] == "dos-cpu" else str(row["stride"])


def exploration_replay(rows: pd.DataFrame, tol: float = ALIGN_TOL) -> pd.DataFrame:
    """Per candidate of every exploration of the exploring rows of `rows` (results.rows of the
    planner sweeps; stride "auto"): batch, run, exploration index, plan (`cpu` or the stride),
    predicted update phase, recorded period (`measured_s`), the steps.csv row it maps to, that
    row's update phase (`update_s`), the period rebuilt from steps.csv, and `aligned`. Raises on
    empty input."""
    require_rows(rows, "exploration_replay")
    out = []
    auto = rows[rows["stride"].astype(str).eq("auto")]
    for _, r in auto.iterrows():
        if not isinstance(r.get("steps_file"), str) or not r["steps_file"]:
            continue
        run_dir = (Path(r["results_dir"]) / r["steps_file"]).parent
        try:
            res = json.loads((run_dir / "result.json").read_text())
            st = pd.read_csv(run_dir / "steps.csv").drop_duplicates("step", keep="last").set_index("step")
        except (OSError, ValueError):
            continue
        for e, ex in enumerate((res.get("online") or {}).get("explorations") or []):
            for i, c in enumerate(ex.get("candidates") or []):
                row = int(ex["start_step"]) + i - 1
                upd = float(st["step_s"].get(row, math.nan))
                period = upd + float(st["fwd_s"].get(row + 1, math.nan)) + float(st["bwd_s"].get(row + 1, math.nan))
                meas = c.get("measured_s")
                aligned = bool(meas and period == period and abs(period / meas - 1) <= tol)
                out.append({"batch_id": r["batch_id"], "run_id": r["run_id"], "model": r.get("model"),
                            "exploration": e, "kept": _plan_name(ex["kept"]["stride"]) if ex.get("kept") else None,
                            "plan": _plan_name(c["stride"]), "stage": c.get("stage"),
                            "predicted_s": c.get("predicted_s"), "measured_s": meas, "row": row,
                            "update_s": upd, "period_s": period, "aligned": aligned})
    return pd.DataFrame(out)


def replay_choices(rows: pd.DataFrame, tol: float = ALIGN_TOL) -> pd.DataFrame:
    """Per exploration whose candidates are all aligned (`exploration_replay`): `by_period` (the
    candidate with the least recorded period: the Planner's choice, checked against its `kept`),
    `by_update` (the least update phase), and for each the batch's fixed-plan median iteration
    and update phase (NaN where the batch has no fixed run of that plan), with the batch's best
    fixed plan by median iteration. Raises on empty input."""
    cand = exploration_replay(rows, tol)
    if not len(cand):
        return pd.DataFrame()
    fixed = rows[~rows["stride"].astype(str).eq("auto")].copy()
    fixed["plan"] = [_fixed_name(r) for _, r in fixed.iterrows()]
    med = fixed.groupby(["batch_id", "plan"])[["iter_s", "step_s"]].median()
    out = []
    for (batch, run, e), g in cand.groupby(["batch_id", "run_id", "exploration"], sort=False):
        if not g["aligned"].all():
            continue
        by_period = g.loc[g["measured_s"].astype(float).idxmin(), "plan"]
        by_update = g.loc[g["update_s"].astype(float).idxmin(), "plan"]
        m = med.loc[batch] if batch in med.index.get_level_values(0) else pd.DataFrame(columns=["iter_s", "step_s"])
        best = m["iter_s"].idxmin() if len(m) else None

        def at(plan, col):
            return float(m.loc[plan, col]) if plan in m.index else math.nan

        out.append({"batch_id": batch, "run_id": run, "exploration": e, "candidates": " ".join(g["plan"]),
                    "kept": g["kept"].iloc[0], "by_period": by_period, "by_update": by_update,
                    "best_fixed": best, "best_fixed_iter_s": at(best, "iter_s") if best else math.nan,
                    "by_period_iter_s": at(by_period, "iter_s"), "by_update_iter_s": at(by_update, "iter_s"),
                    "by_period_update_s": at(by_period, "step_s"), "by_update_update_s": at(by_update, "step_s")})
    return pd.DataFrame(out)
