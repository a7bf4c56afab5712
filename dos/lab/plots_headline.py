"""Figure 15 (issue 16, DESIGN.md §6): the headline batches — every system's iterations, 3 runs
each round-robin in one batch per model, in the style and colours of `dos.lab.plots` (its
`figure`/`caption`/`save`: same records, same bytes). Ratios are taken within a batch only
(`results.headline_ratios`), against the fastest offload baseline of equal state precision."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import pandas as pd

from dos.lab import results as R
from dos.lab.plots import PALETTE, caption, empty, figure, label, save

NAME = "15-headline"
MISSING = "run experiments/sweeps/{}.yaml\non the H200"
OFFSETS = (-0.18, 0.0, 0.18, -0.09, 0.09)  # a run's dot beside its system, by repeat: no random jitter


def latest_batch(df: pd.DataFrame) -> pd.DataFrame:
    """The rows (status ok) of the batch recorded last in `df` (by its rows' latest timestamp):
    one panel shows one batch, never a mix."""
    d = df[df["status"].eq("ok") & df["batch_id"].fillna("").ne("")] if len(df) else df
    if not len(d):
        return d
    last = d.groupby("batch_id")["timestamp"].max().sort_values().index[-1]
    return d[d["batch_id"].eq(last)]


def _panel(ax, g: pd.DataFrame) -> None:
    """One batch: each system's runs as dots, its median as a bar end; the title names the batch
    and dos interleaved's ratio to the fastest offload baseline of its precision."""
    summ = R.summary(g)
    ks = list(summ["key"])
    for y, r in enumerate(summ.itertuples()):
        runs = g[g["key"].eq(r.key) & g["config_id"].eq(r.config_id)].sort_values("timestamp")
        col = PALETTE.get(r.key, "0.5")
        ax.barh(y, r.median, color=col, alpha=0.35, height=0.6)
        ax.scatter(runs["iter_s"], [y + OFFSETS[i % len(OFFSETS)] for i in range(len(runs))], s=16, color=col,
                   zorder=3)
        ax.text(r.max * 1.03, y, f"{r.median:.3f} s ({r.min:.3f}-{r.max:.3f}, {r.runs} runs)", va="center",
                fontsize=6)
    names = [label(k) + (f", {r:g}" if k == "deepspeed-twinflow" and r == r else "") + f" [{d}]"
             for k, r, d in zip(ks, summ["ratio"], summ["state_dtype"])]
    ax.set_yticks(range(len(ks)), names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(0, float(summ["max"].max()) * 1.6)  # room for the numbers
    ax.set(xlabel="iteration (s): bar the median, dots the runs")
    h = R.headline_ratios(g, keys=R.INTERLEAVED)
    vs = (f"dos interleaved {h['vs_baseline'].iloc[0]:.2f}x {label(h['baseline'].iloc[0])}"
          if len(h) else "no fp32 offload baseline in this batch")
    ax.set_title(f"{g['model'].iloc[0]}, batch {g['batch_id'].iloc[0]}\n{vs}", fontsize=8)


def headline_figure(df: pd.DataFrame, out: Optional[str] = None, sweeps: Sequence[str] = (), note: str = ""):
    """One panel per headline sweep (`sweeps`: names, in order; its rows are those whose results
    directory has that name): its latest batch, or a panel naming the sweep to run. Where no sweep
    has records (smoke data, other names), one panel: the latest batch in `df`."""
    src = df["results_dir"].map(lambda p: Path(p).name) if len(df) else pd.Series(dtype=str)
    panels = [(s, latest_batch(df[src.eq(s)])) for s in sweeps]
    if not any(len(g) for _, g in panels) and len(latest_batch(df)):
        g = latest_batch(df)
        panels = [(g["batch_id"].iloc[0], g)]
    panels = panels or [("headline-3b", df.iloc[0:0])]
    rows = max(g.groupby(["key", "config_id"]).ngroups if len(g) else 3 for _, g in panels)
    fig, axes = figure(len(panels), 1, w=7.2, h=0.3 * rows + 1.0)
    for ax, (name, g) in zip(axes[:, 0], panels):
        if len(g):
            _panel(ax, g)
        else:
            empty(ax, MISSING.format(name))
            ax.set_title(name, fontsize=8)
    caption(fig, latest_batch(df) if len(df) else df, note)
    if out:
        save(fig, out, NAME)
    return fig
