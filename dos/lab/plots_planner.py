"""Figure 14 (issue 15, DESIGN.md §6): the planner sweeps, in the style and colours of
`dos.lab.plots` (its `figure`/`caption`/`save`: same records, same bytes)."""
from __future__ import annotations

from typing import Optional, Sequence

import matplotlib.pyplot as plt
from matplotlib.ticker import MultipleLocator
import numpy as np
import pandas as pd

from dos.lab import planner_evidence as pe
from dos.lab.plots import PALETTE, caption, empty, style

NAME = "14-planner"
MISSING = "no records yet: run\nexperiments/sweeps/{}.yaml\non the H200"
BEST = "#ffbf00"  # the best fixed plan (figure 5's "model's choice" colour)
COLOURS = {"cpu": PALETTE["dos-cpu"], pe.AUTO: PALETTE["dos-auto"]}
OFFSETS = (-0.14, 0.0, 0.14, -0.07, 0.07)  # a run's dot beside its config, by order: no random jitter
SHAPE_MARKERS = ("o", "s", "D", "^", "v", "P", "X")


def _config_colour(config: str) -> str:
    return COLOURS.get(config, PALETTE["dos-interleaved"])


def _iterations(ax, g: pd.DataFrame, b: dict, legend: bool = True) -> None:
    """One (shape, batch): each configuration's runs as dots, its median as a tick; auto's dots
    over its measured steps (open) and with exploration included (filled), the latter's median
    thick; the best fixed median in gold and the 5% target above it dashed."""
    configs = [*pe.CONFIGS, *sorted(set(g["config"]) - set(pe.CONFIGS))]
    configs = [c for c in configs if c in set(g["config"])]
    for x, c in enumerate(configs):
        runs = g[g["config"].eq(c)].sort_values("order")
        dx = np.array([OFFSETS[i % len(OFFSETS)] for i in range(len(runs))])
        col = _config_colour(c)
        if c == pe.AUTO:
            ax.scatter(x + dx, runs["iter_s"], s=22, facecolor="none", edgecolor=col, zorder=3,
                       label="auto, measured steps")
            ax.scatter(x + dx, runs["iter_incl_s"], s=26, color=col, zorder=3, label="auto, exploration included")
            ax.hlines(runs["iter_s"].median(), x - 0.3, x + 0.3, color=col, lw=1.2, ls=":")
            ax.hlines(runs["iter_incl_s"].median(), x - 0.3, x + 0.3, color=col, lw=2.6)
        else:
            best = c == b["best_fixed"]
            ax.scatter(x + dx, runs["iter_s"], s=22, color=col, zorder=3)
            ax.hlines(runs["iter_s"].median(), x - 0.3, x + 0.3, color=BEST if best else col, lw=3.0 if best else 1.8,
                      zorder=2, label="best fixed median" if best else None)
    if b["best_fixed_s"] == b["best_fixed_s"]:
        ax.axhline(b["best_fixed_s"] * (1 + pe.AUTO_VS_BEST), color="0.45", lw=0.9, ls="--",
                   label=f"best fixed + {pe.AUTO_VS_BEST:.0%}")
    ax.set_xticks(range(len(configs)), configs)
    ax.set_xlim(-0.6, len(configs) - 0.4)
    ax.set(xlabel="plan (k: every k-th subgroup on the GPU)", ylabel="iteration (s)")
    vs = (f"auto {b['auto_vs_best']:+.1%} of best fixed ({b['best_fixed']}), exploration included"
          if b["auto_vs_best"] == b["auto_vs_best"] else "auto or fixed runs missing")
    ax.set_title(f"{b['shape']}, batch {b['batch_id']}\n{vs}", fontsize=8)
    if legend:
        ax.legend(fontsize=6, loc="best")


def _predictions(ax, df: pd.DataFrame) -> None:
    """Predicted against measured update phase of auto's runs: offline (open) and in situ
    (filled) per shape, the 10% and 20% bands around equality shaded."""
    auto = df[df["config"].eq(pe.AUTO)] if len(df) else df
    vals = np.r_[auto["step_s"].to_numpy(float), auto["predicted_step_s"].to_numpy(float),
                 auto["refined_predicted_s"].to_numpy(float)]
    vals = vals[np.isfinite(vals)]
    if not len(vals):
        empty(ax, "predicted against measured update phase of auto's runs")
        return
    lo, hi = vals.min() * 0.8, vals.max() * 1.2
    x = np.linspace(lo, hi, 2)
    for band, shade in ((pe.PREDICTION_TARGET["worst_error"], "0.93"), (pe.PREDICTION_TARGET["median_error"], "0.84")):
        ax.fill_between(x, x * (1 - band), x * (1 + band), color=shade, lw=0, label=f"within {band:.0%}")
    ax.plot(x, x, color="0.4", lw=0.8)
    for i, (shape, g) in enumerate(auto.groupby("shape", sort=False)):
        m = SHAPE_MARKERS[i % len(SHAPE_MARKERS)]
        ax.scatter(g["step_s"], g["refined_predicted_s"], marker=m, s=30, color=PALETTE["dos-auto"], zorder=3,
                   label=f"{shape}: in situ (graded)")
        ax.scatter(g["step_s"], g["predicted_step_s"], marker=m, s=30, facecolor="none", edgecolor="0.25",
                   zorder=3, label=f"{shape}: offline")
    ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel="measured update phase of the kept plan (s)",
           ylabel="predicted update phase (s)")
    ax.set_aspect("equal", adjustable="box")
    ax.set_title("auto's kept plans: predicted against measured update phase", fontsize=8)
    ax.legend(fontsize=6, loc="upper left")


def _errors(ax, df: pd.DataFrame) -> None:
    """The relative error of each auto run's two predictions (bars), the criterion's median and
    worst limits as lines; runs in time order, named by shape and repeat."""
    auto = df[df["config"].eq(pe.AUTO)].sort_values(["shape", "timestamp"], kind="stable") if len(df) else df
    if not len(auto):
        empty(ax, "relative error of the chosen plans' predictions")
        return
    x = np.arange(len(auto))
    for dx, (kind, col, graded) in zip((-0.2, 0.2), pe.PREDICTIONS):
        err = ((auto[col] - auto["step_s"]).abs() / auto["step_s"]).to_numpy(float)
        ax.bar(x + dx, np.nan_to_num(err), 0.38, color=PALETTE["dos-auto"] if graded else "none",
               edgecolor=PALETTE["dos-auto"] if graded else "0.25", label=f"{kind}{' (graded)' if graded else ''}")
    for name, v in pe.PREDICTION_TARGET.items():
        ax.axhline(v, color="0.45", lw=0.9, ls="--" if name == "median_error" else ":",
                   label=f"{name.replace('_', ' ')} limit {v:.0%}")
    ax.set_xticks(x, [f"{s}\nrun {r:g} ({k})" for s, r, k in zip(auto["shape"], auto["repeat"], auto["kept"])],
                  fontsize=6, rotation=30, ha="right")
    ax.set(ylabel="|predicted - measured| / measured")
    ax.yaxis.set_major_locator(MultipleLocator(0.05))
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.set_title("relative error of each auto run's predictions", fontsize=8)
    ax.legend(fontsize=6, loc="upper left")


def planner_figure(df: pd.DataFrame, out: Optional[str] = None, shapes: Sequence[str] = (), note: str = ""):
    """Fig. 14 (issue 15): top, one panel per shape and batch: each configuration's runs (dots)
    and median (tick) iteration, auto with and without its exploration, the best fixed plan in
    gold and the 5% target dashed; a shape of `shapes` (sweep names) without records gets a panel
    naming the sweep to run. Bottom: predicted (offline, in situ) against measured update phase of
    auto's runs with the 10% / 20% bands. `df`: `planner_evidence.planner_runs` output. Returns
    the figure; with `out` (a folder) also writes it there as NAME.png / .svg (`plots.save`)."""
    style()
    batches = pe._batches(df) if len(df) else []
    have = {b["shape"] for b in batches}
    panels = [("batch", b) for b in batches] + [("missing", s) for s in shapes if s not in have]
    panels = panels or [("missing", "planner-*")]
    n = max(len(panels), 2)
    fig = plt.figure(figsize=(4.4 * n, 8.4), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=(1.0, 1.05))
    axes = top.subplots(1, n, squeeze=False)[0]
    for i, (ax, (kind, p)) in enumerate(zip(axes, panels)):
        if kind == "batch":
            _iterations(ax, df[df["shape"].eq(p["shape"]) & df["batch_id"].eq(p["batch_id"])], p, legend=i == 0)
        else:
            empty(ax, f"{p}: iteration per plan", MISSING.format(p))
    for ax in axes[len(panels):]:
        ax.set_axis_off()
    left, right = bottom.subplots(1, 2, gridspec_kw={"width_ratios": (1.0, 1.6)})
    _predictions(left, df)
    _errors(right, df)
    fig.suptitle("Planner that measures: stride 'auto' against every fixed plan", fontsize=10, fontweight="bold")
    caption(fig, df, note or ("" if len(df) else "the issue-15 planner sweeps have not run yet"))
    if out is not None:
        from dos.lab.plots import save

        save(fig, out, NAME)
    return fig
