"""Figure 13 (issue 17, DESIGN.md §6): optimizer-state precision — loss per moment format against
the no-offload band, update phase and iteration per format, host bytes per non-resident
parameter — in the style and colours of `dos.lab.plots` (split from it; `plots.state_precision`
calls this)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from dos.lab import checks, results as R
from dos.lab.plots import ORDER, PALETTE, caption, empty, figure, label

DTYPE_STYLE = {"fp32": ("-", None, 1.0), "bf16": ("--", "//", 0.75), "int8": (":", "xx", 0.5),
               "bf16-split": ("-.", "..", 0.6)}
"""Per optimizer-state precision: line style, bar hatch, bar alpha (the colour stays the system's)."""
STATE_PRECISION_MISSING = "no records yet: run\nexperiments/sweeps/\n{}\non the H200"


def batch_tag(batch_id: str) -> str:
    """A short name of a batch for a tick label: its session tag ("s16") and what follows the model
    ("-auto"), else its timestamp."""
    import re

    m = re.search(r"-(s\d+)-", batch_id)
    if not m:
        return batch_id[:14]
    tail = re.search(r"-(\d+(?:\.\d+)?b)-?(.*)$", batch_id, re.IGNORECASE)
    return m.group(1) + (f"-{tail.group(2)}" if tail and tail.group(2) else "")


def state_precision(conv_steps: pd.DataFrame, conv_rows: pd.DataFrame, speed: pd.DataFrame,
                    memory: pd.DataFrame, smooth: int = 10, note: str = ""):
    """Fig. 13 (issue 17): left, the loss per step (`smooth`-step mean) of every run on the stdlib
    corpus, the no-offload runs as a grey band (min-max over its repeats) and each system and
    moment format in its colour and line style; middle, the median update phase and iteration
    (min-max bars) per system and moment format, per model and batch; right, the measured host bytes per
    non-resident parameter of dos per moment format, the targets (10 for bf16, 8 for int8) marked.
    An empty input gives a panel naming the sweep to run."""
    fig, axes = figure(1, 3, w=4.4, h=4.2)
    a, b, c = axes[0]
    # -- loss curves
    if len(conv_steps):
        s = conv_steps.assign(state_dtype=conv_steps["state_dtype"].replace("", "fp32") if "state_dtype" in conv_steps
                              else "fp32").sort_values("step")
        s = s.assign(smooth=s.groupby("run_id")["loss"].transform(lambda v: v.rolling(smooth, min_periods=1).mean()))
        base_key = R.baseline_key(s["key"])
        if base_key:
            band = s[s["key"].eq(base_key)].groupby("step")["smooth"].agg(["min", "max"])
            a.fill_between(band.index, band["min"], band["max"], color=PALETTE.get(base_key), alpha=0.35, lw=0.8,
                           label=f"{label(base_key)} (min-max of {s[s['key'].eq(base_key)]['run_id'].nunique()} runs)")
        for (key, dt), g in s[s["key"].ne(base_key)].groupby(["key", "state_dtype"], sort=False):
            for i, (_, r) in enumerate(g.groupby("run_id", sort=False)):
                a.plot(r["step"], r["smooth"], color=PALETTE.get(key), ls=DTYPE_STYLE.get(dt, ("-",))[0], lw=1.3,
                       label=f"{label(key)}, {dt} state" if i == 0 else None)
        lo = s["smooth"].quantile(0.02)
        a.set_ylim(lo * 0.95, s[s["step"] >= s["step"].min() + 20]["smooth"].max() * 1.05)
        a.set(xlabel="training step", ylabel=f"loss ({smooth}-step mean)")
        a.legend(fontsize=6.5)
        model = conv_rows["model"].iloc[0] if len(conv_rows) else ""
        a.set_title(f"{model}: loss with fp32, bf16, int8 moments", fontsize=9)
    else:
        empty(a, "loss curves, fp32 / bf16 / int8 moments", STATE_PRECISION_MISSING.format("state-dtype-convergence.yaml"))
    # -- speed
    d = speed[speed["status"].eq("ok")] if "status" in speed and len(speed) else speed
    if len(d):
        # one group of bars per batch: medians and ranges are never pooled across batches
        # (machines, days); the tick names the batch by its short tag
        d = d.assign(state_dtype=d["state_dtype"].replace("", "fp32"),
                     batch=d["batch_id"].fillna("").astype(str).map(batch_tag) if "batch_id" in d else "")
        g = d.groupby(["model", "batch", "key", "state_dtype"], sort=False).agg(
            iter_med=("iter_s", "median"), iter_min=("iter_s", "min"), iter_max=("iter_s", "max"),
            step_med=("step_s", "median"), n_params=("n_params", "first")).reset_index()
        g = g.assign(_r=g["key"].map({k: i for i, k in enumerate(ORDER)}),
                     _d=g["state_dtype"].map({k: i for i, k in enumerate(DTYPE_STYLE)})).sort_values(["n_params", "batch", "_r", "_d"])
        x = np.arange(len(g))
        for xi, r in zip(x, g.itertuples()):
            _, hatch, alpha = DTYPE_STYLE.get(r.state_dtype, ("-", None, 1.0))
            col = PALETTE.get(r.key, "0.5")
            b.bar(xi, r.iter_med, 0.8, color=col, alpha=0.3, hatch=hatch, edgecolor=col)
            b.bar(xi, r.step_med, 0.8, color=col, alpha=alpha, hatch=hatch, edgecolor="white")
            b.errorbar(xi, r.iter_med, yerr=[[r.iter_med - r.iter_min], [r.iter_max - r.iter_med]], color="0.2",
                       capsize=2, lw=0.8)
        for xi in x[1:][(g["batch"].values[1:] != g["batch"].values[:-1]) | (g["model"].values[1:] != g["model"].values[:-1])]:
            b.axvline(xi - 0.5, color="0.6", lw=0.6, ls=":")  # a new batch
        b.set_xticks(x, [f"{r.model} {r.batch} {r.key} {r.state_dtype}" for r in g.itertuples()], rotation=60,
                     ha="right", fontsize=6)
        b.set_ylabel("seconds (solid: update phase; pale: iteration)")
        b.set_title("update phase and iteration per batch, median (min-max)", fontsize=9)
    else:
        empty(b, "update phase per moment format", STATE_PRECISION_MISSING.format("state-dtype-speed.yaml"))
    # -- host bytes per non-resident parameter
    m = memory[memory["status"].eq("ok") & memory["system"].eq("dos")] if len(memory) else memory
    if len(m):
        m = m.assign(state_dtype=m["state_dtype"].replace("", "fp32"),
                     share=1.0 - m["resident_fraction"].fillna(0.0))
        m = m[m["share"] > 0].assign(per=lambda t: t["host_bytes_per_param"] / t["share"])
        ring = m["spec_grad_ring"] if "spec_grad_ring" in m else pd.Series(np.nan, index=m.index)
        m = m.assign(ring=pd.to_numeric(ring, errors="coerce").fillna(0).astype(int))
        # as host_bytes_check: the worst row of each configuration, the best configuration per format
        worst = m.groupby(["state_dtype", "ring"])["per"].max().reset_index()
        best = worst.loc[worst.groupby("state_dtype")["per"].idxmin()].set_index("state_dtype")
        best = best.reindex([k for k in DTYPE_STYLE if k in best.index])
        v = best["per"]
        for i, (dt, val) in enumerate(v.items()):
            _, hatch, alpha = DTYPE_STYLE[dt]
            c.bar(i, val, 0.6, color=PALETTE["dos-cpu"], alpha=alpha, hatch=hatch, edgecolor="white")
            c.text(i, val, f"{val:.4f}", ha="center", va="bottom", fontsize=7)
            t = checks.HOST_BYTES_TARGET.get(dt)
            if t:
                c.hlines(t, i - 0.4, i + 0.4, color="#d62728", lw=1.2, ls="--")
        c.set_xticks(range(len(v)), [f"{k} moments" + (f"\nring {r}" if r else "") for k, r in best["ring"].items()])
        c.set_ylabel("host bytes per non-resident parameter")
        c.set_title("dos host memory (dashed: issue 17 target)", fontsize=9)
    else:
        empty(c, "host bytes per parameter", STATE_PRECISION_MISSING.format("state-dtype-speed.yaml"))
    fig.suptitle("Fewer bytes per parameter: fp32, bf16 and int8 AdamW moments", fontsize=10, fontweight="bold")
    frames = [x for x in (conv_rows, speed, memory) if len(x)]
    rows = pd.concat(frames) if frames else conv_rows
    caption(fig, rows, note or ("" if frames else "the issue-17 sweeps (state-dtype-convergence, "
                                                  "state-dtype-speed, capacity) have not run yet"))
    return fig
