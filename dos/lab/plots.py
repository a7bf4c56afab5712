"""Tidy DataFrames (dos.lab.results) -> figures: one style, one fixed colour per system, a caption
naming the machine, the dates and the records, PNG + SVG.

This module holds the style and the figures built from rows (DESIGN.md §6: 2, 6, 7, 8, 9, 11);
`dos.lab.plots_traces` those built from traces, timelines, calibrations and per-step losses (1, 3, 4,
5, 10). Every function returns a matplotlib Figure; `save` writes it.
"""
from __future__ import annotations

from typing import Optional

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
import numpy as np
import pandas as pd
import seaborn as sns

from dos.lab import checks, results as R

# One colour per system, the same in every figure (dos in blues/greens, DeepSpeed in warm colours).
PALETTE = {
    "dos-interleaved": "#1f5fbf",
    "dos-auto": "#17a5b8",
    "dos-static": "#2ca02c",
    "dos-cpu": "#8c8c00",
    "dos-gpu": "#0b2a5b",
    "dos-interleaved-overlap": "#5a3fc0",
    "dos-cpu-overlap": "#c9b800",
    "dos-auto-overlap": "#0e7f8f",
    "torch-gpu": "#6e6e6e",
    "torch-cpu": "#b5b5b5",
    "deepspeed-zero-offload": "#d62728",
    "deepspeed-zero3-offload": "#a01c1c",
    "deepspeed-zero2-offload": "#bcbd22",
    "deepspeed-zero2-offload-bf16": "#dbdb8d",
    "deepspeed-twinflow": "#ff7f0e",
    "deepspeed-superoffload": "#9467bd",
    "deepspeed-zero3": "#8c564b",
    "torchao-cpu-offload": "#e377c2",
}
LABELS = {
    "dos-interleaved": "dos interleaved",
    "dos-auto": "dos auto",
    "dos-static": "dos static",
    "dos-cpu": "dos all-CPU",
    "dos-gpu": "dos all-GPU",
    "dos-interleaved-overlap": "dos interleaved, overlapped with backward",
    "dos-cpu-overlap": "dos all-CPU, overlapped with backward",
    "dos-auto-overlap": "dos auto, overlapped with backward",
    "torch-gpu": "torch, no offload",
    "torch-cpu": "torch (CPU device)",
    # Name what ran. The key deepspeed-zero-offload (older records) is stage 3, not the original
    # ZeRO-Offload (stage 2: deepspeed-zero2-offload).
    "deepspeed-zero-offload": "DeepSpeed ZeRO-3 + CPU optimizer offload",
    "deepspeed-zero3-offload": "DeepSpeed ZeRO-3 + CPU optimizer offload, tuned for one GPU",
    "deepspeed-zero2-offload": "DeepSpeed ZeRO-2 + CPU optimizer offload",
    "deepspeed-zero2-offload-bf16": "DeepSpeed ZeRO-2 + CPU optimizer offload, bf16 master and states",
    "deepspeed-twinflow": "DeepSpeed TwinFlow (ZeRO-3, partial offload)",
    "deepspeed-superoffload": "DeepSpeed SuperOffload (ZeRO-3)",
    "deepspeed-zero3": "DeepSpeed ZeRO-3, no offload",
    "torchao-cpu-offload": "torchao CPUOffloadOptimizer",
}
ORDER = list(R.ORDER)
PHASES = (("fwd_s", "forward", 0.35), ("bwd_s", "backward", 0.65), ("step_s", "update", 1.0))
SMOKE_NOTE = "smoke data (CPU, tiny model)"


def style() -> None:
    """The one style of every figure."""
    sns.set_theme(context="paper", style="whitegrid", font_scale=1.1,
                  rc={"figure.dpi": 110, "savefig.dpi": 160, "axes.titleweight": "bold",
                      "svg.hashsalt": "dos", "legend.frameon": False})


def label(key: str) -> str:
    return LABELS.get(key, key)


def keys_in(df: pd.DataFrame) -> list:
    present = set(df["key"]) if len(df) else set()
    return [k for k in ORDER if k in present] + sorted(present - set(ORDER))


def caption_text(df: pd.DataFrame, note: str = "") -> str:
    m = R.machine(df)
    if not len(df):
        head = "no records"
    elif m["smoke"]:
        head = f"{SMOKE_NOTE} | {m['cpu']}"
    else:
        head = f"{m['gpu'] or 'no GPU'} | host CPU {m['cpu']}"
    when = m["first"] if m["first"] == m["last"] else f"{m['first']} to {m['last']}"
    parts = [head, f"runs {when}" if when else "", "records: " + ", ".join(m["sources"]), note]
    return " | ".join(p for p in parts if p)


def caption(fig, df: pd.DataFrame, note: str = "") -> None:
    fig.text(0.005, -0.01, caption_text(df, note), ha="left", va="top", fontsize=7, color="0.35",
             wrap=True)


def figure(nrows: int = 1, ncols: int = 1, w: float = 4.2, h: float = 3.2, **kw):
    style()
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, h * nrows), squeeze=False,
                             layout="constrained", **kw)
    return fig, axes


def save(fig, out_dir, name: str) -> list:
    """Write `name`.png and `name`.svg under `out_dir` (relative to the repository root); return
    their paths (relative to the root when inside it)."""
    out = R.resolve(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    # Same records, same bytes: fixed SVG ids (hash salt), glyphs as paths, no dates or versions.
    with plt.rc_context({"svg.hashsalt": "dos", "svg.fonttype": "path"}):
        for ext, kw in (("png", {"metadata": {"Software": None}}),
                        ("svg", {"metadata": {"Date": None, "Creator": None}})):
            path = out / f"{name}.{ext}"
            fig.savefig(path, bbox_inches="tight", **kw)
            paths.append(R.relative(path))
    return paths


def plain_log(ax, axis: str = "y") -> None:
    """A log axis labelled with plain numbers."""
    a = ax.yaxis if axis == "y" else ax.xaxis
    a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    a.set_minor_formatter(NullFormatter())


def binary(n: float) -> str:
    """4096 -> '4 Ki', 50331648 -> '48 Mi'."""
    for unit, scale in (("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:g}"


def empty(ax, what: str, why: str = "no records yet") -> None:
    """An empty panel that says what would be there and why it is not."""
    ax.text(0.5, 0.5, f"{why}\n{what}", ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _models(df: pd.DataFrame) -> list:
    return list(df.sort_values("n_params")["model"].drop_duplicates()) if len(df) else []


# ---------------------------------------------------------------- figure 2

def breakdown(df: pd.DataFrame, note: str = ""):
    """Fig. 2: forward / backward / update seconds per iteration, per system, one panel per model."""
    d = R.headline(df)
    models = _models(d) or ["-"]
    fig, axes = figure(1, len(models), w=max(4.2, 0.55 * d["key"].nunique() + 1.5), sharey=False)
    for ax, model in zip(axes[0], models):
        m = d[d["model"] == model]
        if not len(m):
            empty(ax, "forward/backward/update per system")
            continue
        x = np.arange(len(m))
        bottom = np.zeros(len(m))
        for col, name, alpha in PHASES:
            vals = m[col].fillna(0).to_numpy()
            ax.bar(x, vals, bottom=bottom, color=[PALETTE.get(k, "0.5") for k in m["key"]],
                   alpha=alpha, edgecolor="white", linewidth=0.6, label=name)
            bottom += vals
        for xi, total in zip(x, m["iter_s"]):
            ax.text(xi, total, f"{total:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x, [label(k) for k in m["key"]], rotation=35, ha="right")
        ax.set_title(f"{model} ({m['params_b'].iloc[0]:.2f}B params)")
        ax.set_ylabel("time per iteration (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color="0.3", alpha=a) for _, _, a in PHASES]
    fig.legend(handles, [n for _, n, _ in PHASES], loc="outside upper right", ncols=3)
    caption(fig, d, note)
    return fig


# ---------------------------------------------------------------- figure 6

def scaling(df: pd.DataFrame, note: str = ""):
    """Fig. 6: iteration time and tokens/s against model size, every system; dos interleaved's
    speedup over DeepSpeed ZeRO-Offload annotated where both ran."""
    d = R.headline(df)
    fig, axes = figure(1, 2)
    for ax, col, ylabel in ((axes[0, 0], "iter_s", "time per iteration (s)"),
                            (axes[0, 1], "tokens_per_s", "throughput (tokens/s)")):
        if not len(d):
            empty(ax, "model-size sweep")
            continue
        for key in keys_in(d):
            k = d[d["key"] == key].sort_values("n_params")
            ax.plot(k["params_b"], k[col], "o-", color=PALETTE.get(key), label=label(key), ms=5)
        ax.set_xlabel("model size (billion parameters)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log")
        ax.set_xticks(sorted(d["params_b"].unique()), [f"{x:.2g}" for x in sorted(d["params_b"].unique())])
        ax.xaxis.set_minor_formatter(NullFormatter())
    _speedups(axes[0, 0], d)
    if len(d):
        axes[0, 0].set_yscale("log")
        axes[0, 0].yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        plain_log(axes[0, 0])
    axes[0, 1].legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle("dos keeps most of no offload's speed as the model grows; DeepSpeed's offload falls "
                 "far behind", fontsize=10, fontweight="bold")
    # Each size comes from its own device call: say which, so that no one compares across them
    # more than the calls allow (no offload at 1.3B ran two days before 3B, on an older build).
    calls = "; ".join(f"{m}: {', '.join(sorted(g['results_dir'].map(lambda x: x.rstrip('/').split('/')[-1]).unique()))} "
                      f"({', '.join(sorted(g['date'].unique()))})" for m, g in d.groupby("model", sort=False))
    caption(fig, d, note or f"one sequence of 2048 tokens per step at every size; each size from its own "
                            f"device calls ({calls}): compare systems within a size; across sizes the "
                            f"calls differ (no offload's 1.3B row is the older one)")
    return fig


def _speedups(ax, d: pd.DataFrame, ours: str = "dos-interleaved", ref: str = "deepspeed-zero-offload"):
    a = d[d["key"] == ours].set_index("model")
    b = d[d["key"] == ref].set_index("model")
    for model in a.index.intersection(b.index):
        if a.loc[model, "results_dir"] != b.loc[model, "results_dir"]:
            continue  # a ratio only side by side: the same sweep (one device call, one machine)
        s = b.loc[model, "iter_s"] / a.loc[model, "iter_s"]
        ax.annotate(f"dos interleaved {s:.1f}x faster\nthan ZeRO-3 + CPU offload",
                    (b.loc[model, "params_b"], b.loc[model, "iter_s"]),
                    textcoords="offset points", xytext=(6, -14), ha="left", fontsize=7, color=PALETTE[ours])


# ---------------------------------------------------------------- figure 7

def microbatch(df: pd.DataFrame, failed: Optional[pd.DataFrame] = None, note: str = ""):
    """Fig. 7: throughput and the update phase's share of the iteration against micro-batch size;
    an x where a system ran out of memory (rows with status oom: no number is taken from them)."""
    fig, axes = figure(1, 2)
    ax_t, ax_s = axes[0]
    if not len(df):
        empty(ax_t, "micro-batch sweep")
    d = df.assign(update_share=df["step_s"] / df["iter_s"])
    for key in keys_in(d):
        k = d[d["key"] == key].groupby("micro_batch", as_index=False)
        k = k[["tokens_per_s", "update_share"]].median()
        ls, mfc = ("--", "white") if key.endswith("-overlap") else ("-", PALETTE.get(key))
        for ax, col in ((ax_t, "tokens_per_s"), (ax_s, "update_share")):
            ax.plot(k["micro_batch"], k[col], "o", ls=ls, color=PALETTE.get(key), mfc=mfc,
                    label=label(key), ms=5)
    if failed is not None and len(failed):
        oom = failed[failed["status"] == "oom"]
        for i, key in enumerate(keys_in(oom)):
            xs = oom[oom["key"] == key]["micro_batch"]
            ax_t.scatter(xs, [0.02 + 0.04 * i] * len(xs), marker="x", s=50, color=PALETTE.get(key),
                         transform=ax_t.get_xaxis_transform(), label=f"{label(key)}: OOM")
    for ax in (ax_t, ax_s):
        ax.set_xscale("log", base=2)
        ticks = sorted(d["micro_batch"].dropna().unique())
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("micro-batch size (sequences)")
    ax_t.set_ylabel("throughput (tokens/s)")
    ax_s.set_ylabel("update phase / iteration time")
    ax_s.set_ylim(0, 1)
    ax_t.legend(fontsize=7)
    if len(d):
        models = ", ".join(_models(d))
        cap = d["gpu_mem_cap_gib"].dropna()
        fig.suptitle(f"{models}{f', GPU capped at {cap.max():g} GiB' if len(cap) else ', whole GPU'}: "
                     "a larger micro-batch hides dos' update phase; overlapped with backward it nears "
                     "no offload", fontsize=10, fontweight="bold")
    caption(fig, d, note or "dashed, hollow: the CPU lane overlapped with backward (overlap_backward=True)")
    return fig


# ---------------------------------------------------------------- figure 8

def subgroup_size(df: pd.DataFrame, note: str = ""):
    """Fig. 8: update-phase time against the subgroup size, one panel per model."""
    d = df[df["system"] == "dos"].copy()
    models = _models(d) or ["-"]
    fig, axes = figure(1, len(models))
    for ax, model in zip(axes[0], models):
        m = d[d["model"] == model]
        if not len(m):
            empty(ax, "subgroup-size sweep")
            continue
        for key in keys_in(m):
            k = m[m["key"] == key].sort_values("plan_subgroup_numel")
            ax.plot(k["plan_subgroup_numel"], k["step_s"], "o-", color=PALETTE.get(key),
                    label=label(key), ms=5)
        ax.set_xscale("log", base=2)
        sizes = sorted(m["plan_subgroup_numel"].dropna().unique())
        ticks = [t for t in sizes if int(t) & (int(t) - 1) == 0] or sizes  # powers of two: no overlap
        ax.set_xticks(ticks, [binary(t) for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("subgroup size (elements)")
        ax.set_ylabel("update phase (s)")
        best = m.loc[m["step_s"].idxmin()]  # the message: where the update phase is shortest
        ax.set_title(f"{model}, whole GPU: shortest update phase at {binary(best['plan_subgroup_numel'])} "
                     f"({label(best['key'])})", fontsize=9)
        ax.legend(fontsize=7)
    caption(fig, d, note)
    return fig


# ---------------------------------------------------------------- figure 9

FAMILIES = {"dos-static": ("dos-gpu", "dos-static", "dos-cpu"),
            "deepspeed-twinflow": ("deepspeed-zero3", "deepspeed-twinflow", "deepspeed-zero-offload")}
"""Figure 9's sweeps: a static share from all-GPU to all-CPU, drawn as one line per family."""


MARKERS = {"deepspeed-zero-offload": "s", "deepspeed-superoffload": "D", "deepspeed-twinflow": "s",
           "deepspeed-zero3": "s", "torch-gpu": "P"}


def one_per_point(df: pd.DataFrame, by=("key", "model", "gpu_mem_cap_gib", "cpu_state_share"),
                  side_by_side: str = "deepspeed-zero-offload") -> pd.DataFrame:
    """One row per point, by the rule of the results table (`results.headline`): the row from the
    results directory of the model's latest `side_by_side` run where there is one, else the latest.
    The same configuration thus shows the same number in the figure and in the table."""
    d = df.sort_values("timestamp")
    base = d[d["key"] == side_by_side].groupby("model")["results_dir"].last()
    d = d.assign(_side=[base.get(m) == r for m, r in zip(d["model"], d["results_dir"])])
    return d.sort_values(["_side", "timestamp"]).drop_duplicates(list(by), keep="last").drop(columns="_side")


def _panel_name(model: str, cap) -> str:
    return f"{model}, GPU capped at {cap:g} GiB" if pd.notna(cap) else f"{model}, whole GPU"


def ratio_sweep(df: pd.DataFrame, note: str = "", gpu_gib: Optional[float] = None):
    """Fig. 9: iteration time (log) and peak GPU memory against the share of the optimizer state in
    host memory, one column per model and GPU cap: every DeepSpeed TwinFlow ratio recorded
    (ZeRO-3 at 0, ZeRO-Offload and SuperOffload at 1) and dos (all-GPU at 0, static shares, all-CPU,
    interleaved and auto at ~1: all state in host memory, part of it updated on the GPU). Points at
    the same share are set apart slightly (each keeps its own marker); dos auto's speed-up over the
    fastest TwinFlow ratio is written where both ran under a cap (checks.capped_check)."""
    # defaults but for the cap: a capped panel is the paper's regime
    d = df[df.index.isin(R.defaults_only(df.assign(gpu_mem_cap_gib=np.nan)).index)]
    d = one_per_point(d)
    panels = (d.assign(_n=d["n_params"]).sort_values(["_n", "gpu_mem_cap_gib"], na_position="first")
              [["model", "gpu_mem_cap_gib"]].drop_duplicates().itertuples(index=False)) if len(d) else []
    panels = list(panels) or [("-", np.nan)]
    fig, axes = figure(2, len(panels), w=3.6, h=2.9, sharex=True)
    for j, (model, cap) in enumerate(panels):
        m = d[(d["model"] == model) & (d["gpu_mem_cap_gib"].isna() if pd.isna(cap) else d["gpu_mem_cap_gib"].eq(cap))]
        keys = keys_in(m)
        for i, (col, ylabel) in enumerate((("iter_s", "time per iteration (s, log)"),
                                           ("peak_gpu_gib", "peak GPU memory (GiB)"))):
            ax = axes[i, j]
            if not len(m):
                empty(ax, "ratio sweep")
                continue
            for family, members in FAMILIES.items():
                f = m[m["key"].isin(members)].sort_values("cpu_state_share")
                ax.plot(f["cpu_state_share"], f[col], "-", color=PALETTE[family], alpha=0.45, lw=1.2)
            # points at (nearly) the same share are spread over +-0.03 so none hides another
            share = m["cpu_state_share"].round(1)
            for key in keys:
                k = m[m["key"] == key]
                for _, r in k.iterrows():
                    near = [x for x in keys if (share[m["key"] == x] == round(r["cpu_state_share"], 1)).any()]
                    dx = 0.03 * (near.index(key) - (len(near) - 1) / 2) if len(near) > 1 else 0.0
                    ax.plot(r["cpu_state_share"] + dx, r[col], MARKERS.get(key, "o"), color=PALETTE.get(key),
                            ms=6, mec="white", mew=0.6, zorder=3)
                    if key == "deepspeed-twinflow" and i == 0:
                        ax.annotate(f"{r['ratio']:g}", (r["cpu_state_share"] + dx, r[col]), fontsize=6.5,
                                    textcoords="offset points", xytext=(0, 5), ha="center",
                                    color=PALETTE[key])
            if i == 0:
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
                plain_log(ax)
                lo, hi = m[col].min(), m[col].max()
                ax.set_ylim(lo / 1.4, hi * 1.6)
            else:
                top = max(m[col].max(), cap if pd.notna(cap) else 0)
                ax.set_ylim(0, top * 1.15)
                if pd.notna(cap):
                    ax.axhline(cap, color="0.3", ls="--", lw=0.9)
                    ax.text(0.5, cap, f"cap {cap:g} GiB", fontsize=7, va="bottom", color="0.3")
            ax.set_xlim(-0.1, 1.12)
            if j == 0:
                ax.set_ylabel(ylabel)
        axes[0, j].set_title(_panel_name(model, cap), fontsize=9)
        if pd.notna(cap):
            chk = checks.capped_check(m)
            if len(chk):
                c = chk.iloc[0]
                axes[0, j].text(0.03, 0.04, f"dos auto {c['iter_s']:.2f} s vs TwinFlow {c['best_ratio']:g} "
                                f"{c['baseline_iter_s']:.2f} s:\n{1 / c['vs_baseline']:.1f}x faster",
                                transform=axes[0, j].transAxes, fontsize=7, color=PALETTE["dos-auto"])
    fig.supxlabel("optimizer state in host memory (share; DeepSpeed TwinFlow's ratio, 1 - dos' resident share)",
                  fontsize=9)
    fig.suptitle("At every share of the state in host memory dos is faster than DeepSpeed at the same "
                 "GPU memory", fontsize=10, fontweight="bold")
    keys = keys_in(d)
    handles = [plt.Line2D([], [], marker=MARKERS.get(k, "o"), ls="", color=PALETTE.get(k), ms=6) for k in keys]
    fig.legend(handles, [label(k) for k in keys], loc="outside right center", fontsize=8)
    caption(fig, d, note or "TwinFlow's points are labelled with their ratio; points at one share are "
                            "set apart by up to \u00b10.03 so that none hides another")
    return fig


# ---------------------------------------------------------------- figure 11

def memory_per_param(df: pd.DataFrame, note: str = ""):
    """Fig. 11: peak GPU and host memory per parameter, per system (solid: GPU, hatched: host)."""
    d = R.headline(df)
    models = _models(d) or ["-"]
    fig, axes = figure(1, len(models), w=max(4.2, 0.6 * d["key"].nunique() + 1.5))
    for ax, model in zip(axes[0], models):
        m = d[d["model"] == model]
        if not len(m):
            empty(ax, "memory per parameter")
            continue
        x = np.arange(len(m))
        colors = [PALETTE.get(k, "0.5") for k in m["key"]]
        ax.bar(x - 0.2, m["gpu_bytes_per_param"], 0.4, color=colors, label="GPU (peak allocated)")
        ax.bar(x + 0.2, m["host_bytes_per_param_peak"], 0.4, color=colors, alpha=0.45, hatch="///",
               edgecolor="white", label="host (peak RSS)")
        ax.set_xticks(x, [label(k) for k in m["key"]], rotation=35, ha="right")
        ax.set_ylabel("peak memory per parameter (bytes)")
        ax.set_title(f"{model} ({m['params_b'].iloc[0]:.2f}B params)")
    handles = [plt.Rectangle((0, 0), 1, 1, color="0.35"),
               plt.Rectangle((0, 0), 1, 1, color="0.35", alpha=0.45, hatch="///")]
    fig.legend(handles, ["GPU (peak allocated)", "host (peak RSS)"], loc="outside upper right", ncols=2)
    caption(fig, d, note)
    return fig


# ---------------------------------------------------------------- figure 12

GPU_SCALING_MISSING = "no records yet: needs nvidia-h200-x2"


def gpu_scaling(df: pd.DataFrame, note: str = "", ideal: str = "dos-auto"):
    """Fig. 12: tokens/s (every rank's) against the GPU count, one panel per model, each system's
    median over its repeats with the min-max range; linear scaling from `ideal`'s 1-GPU point
    dashed, and each system's speedup at the largest count annotated. Without rows: one panel
    saying which machine the records need."""
    d = df[df["status"].eq("ok")] if "status" in df and len(df) else df
    models = _models(d)
    fig, axes = figure(1, max(1, len(models)))
    if not models:
        empty(axes[0, 0], "tokens/s on 1 and 2 GPUs, dos against DeepSpeed\n"
                          "(experiments/sweeps/gpus.yaml)", GPU_SCALING_MISSING)
        fig.suptitle("Scaling with GPUs (FSDP2 + dos under torchrun)", fontsize=10, fontweight="bold")
        caption(fig, d, note or "the 2-GPU sweep has not run: the 2-GPU machine was not lent yet")
        return fig
    for ax, model in zip(axes[0], models):
        m = d[d["model"].eq(model)]
        counts = sorted(m["gpus"].fillna(1).astype(int).unique())
        for key in keys_in(m):
            g = m[m["key"].eq(key)].groupby(m["gpus"].fillna(1).astype(int))["tokens_per_s"].agg(["median", "min", "max"])
            ax.errorbar(g.index, g["median"], yerr=[g["median"] - g["min"], g["max"] - g["median"]],
                        fmt="o-", color=PALETTE.get(key), label=label(key), ms=5, capsize=3)
            if len(g) > 1 and g.index[0] == 1:
                ax.annotate(f"{g['median'].iloc[-1] / g['median'].iloc[0]:.2f}x",
                            (g.index[-1], g["median"].iloc[-1]), textcoords="offset points",
                            xytext=(6, 0), va="center", fontsize=7, color=PALETTE.get(key))
        base = m[m["key"].eq(ideal) & m["gpus"].fillna(1).astype(int).eq(1)]["tokens_per_s"]
        if len(base):
            ax.plot(counts, [base.median() * n for n in counts], "--", color="0.6", lw=1,
                    label=f"linear from {label(ideal)}")
        ax.set_title(model)
        ax.set_xlabel("GPUs (torchrun ranks)")
        ax.set_xticks(counts)
        ax.set_ylabel("throughput (tokens/s, all ranks)")
        ax.set_ylim(bottom=0)
    axes[0, -1].legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.suptitle("Scaling with GPUs (FSDP2 + dos under torchrun)", fontsize=10, fontweight="bold")
    caption(fig, d, note)
    return fig


# ---------------------------------------------------------------- figure 13

def state_precision(*args, **kwargs):
    """Fig. 13 (issue 17): `dos.lab.plots_state.state_precision` (imported when called: that
    module builds on this one)."""
    from dos.lab.plots_state import state_precision as draw

    return draw(*args, **kwargs)
