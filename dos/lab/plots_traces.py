"""Figures built from per-run traces, lane timelines, calibrations and per-step losses
(DESIGN.md §6: 1, 3, 4, 5, 10), in the style and colours of `dos.lab.plots`."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pandas as pd
from matplotlib.patches import Patch

from dos.lab import results as R
from dos.lab.plots import PALETTE, SMOKE_NOTE, binary, caption, empty, figure, keys_in, label, plain_log

PHASE_SHADE = {"fwd": ("forward", "0.92"), "bwd": ("backward", "0.82"), "step": ("update", "#f6e7a8")}
LANES = ("grad_d2h", "cpu", "upload", "h2d", "gpu", "d2h")
LANE_COLORS = {"grad_d2h": "#c7c7c7", "cpu": "#8fb9e3", "upload": "#9edae5", "h2d": "#ffbb78",
               "gpu": "#1f5fbf", "d2h": "#d6a0a0"}
LANE_NAMES = {"grad_d2h": "gradient D2H (backward)", "cpu": "CPU Adam", "upload": "weights H2D",
              "h2d": "state H2D", "gpu": "GPU Adam", "d2h": "state D2H"}


# ---------------------------------------------------------------- figure 1

def trace_rows(df: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """The latest run with a sample trace of each of `keys`, on the largest model they share."""
    d = df[df["key"].isin(keys) & df["samples_file"].fillna("").ne("")]
    shared = [m for m, g in d.groupby("model") if set(g["key"]) >= set(keys)]
    if shared:
        d = d[d["model"] == max(shared, key=lambda m: d[d["model"] == m]["n_params"].iloc[0])]
    d = d.sort_values("timestamp").drop_duplicates("key", keep="last")
    return d.set_index("key").reindex([k for k in keys if k in set(d["key"])]).reset_index()


METRICS = (  # (columns, y label, scale from the samples.csv unit): rows of figure 1, when recorded
    (("gpu_alloc_mib",), "GPU memory allocated,\nPyTorch (GiB)", 1 / 1024),
    (("gpu_mem_used_mib",), "GPU memory used,\nNVML (GiB)", 1 / 1024),
    (("gpu_util_pct",), "GPU busy (%)", 1.0),
    (("pcie_rx_mbps", "pcie_tx_mbps"), "PCIe H2D / D2H\n(GB/s)", 1e-3),
    (("host_rss_mib",), "host RSS (GiB)", 1 / 1024),
)


def memory_trace(df: pd.DataFrame, keys: Sequence[str] = ("deepspeed-zero-offload", "dos-interleaved"),
                 note: str = ""):
    """Fig. 1: NVML GPU memory, GPU utilization and PCIe traffic (and host RSS) over the measured
    iterations, phases shaded, one column per system. Rows without data (no NVML on the CPU) are
    left out."""
    d = trace_rows(df, keys)
    traces = [(row, *R.trace(row)) for _, row in d.iterrows()]
    metrics = [m for m in METRICS if any(s.get(c) is not None and s[c].notna().any()
                                         for _, s, _ in traces for c in m[0])]
    fig, axes = figure(max(1, len(metrics)), max(1, len(traces)), w=4.6, h=1.7, sharey="row",
                       sharex="col")
    if not traces:
        empty(axes[0, 0], "NVML traces of " + ", ".join(keys))
    for j, (row, samples, markers) in enumerate(traces):
        steps = markers[pd.to_numeric(markers["step"], errors="coerce") >= (row["warmup"] or 0)]
        t0, t1 = steps["start_s"].min(), steps["end_s"].max()
        s = samples[(samples["t_s"] >= t0) & (samples["t_s"] <= t1)]
        for i, (cols, ylabel, scale) in enumerate(metrics):
            ax = axes[i, j]
            for _, m in steps.iterrows():
                ax.axvspan(m["start_s"] - t0, m["end_s"] - t0, color=PHASE_SHADE[m["phase"]][1], lw=0)
            for c, ls in zip(cols, ("-", ":")):
                y = s[c].astype(float).where(s[c].astype(float) >= 0) * scale  # counter glitches < 0
                if c not in ("gpu_alloc_mib", "gpu_mem_used_mib"):  # memory unsmoothed: peaks stay
                    y = y.rolling(3, min_periods=1).mean()
                ax.plot(s["t_s"] - t0, y, ls, lw=1.1, color=PALETTE.get(row["key"]))
            if cols == ("gpu_alloc_mib",) and pd.notna(row["peak_gpu_gib"]):
                ax.axhline(row["peak_gpu_gib"], color="0.25", ls="--", lw=0.8)
                ax.text(0.99, row["peak_gpu_gib"], f"peak allocated {row['peak_gpu_gib']:.1f} GiB",
                        transform=ax.get_yaxis_transform(), ha="right", va="bottom", fontsize=7)
            axes[i, 0].set_ylabel(ylabel, fontsize=8)
        axes[0, j].set_title(f"{label(row['key'])}, {row['model']}\n{row['iter_s']:.2f} s/iteration, "
                             f"update {row['step_s']:.2f} s", fontsize=8.5)
        axes[-1, j].set_xlabel("time since the first measured iteration (s)")
    for ax in axes[:, 0]:
        ax.set_ylim(0, ax.get_ylim()[1])  # after every column is drawn: the rows share y
    handles = [Patch(color=c, label=n) for n, c in PHASE_SHADE.values()]
    fig.legend(handles=handles, loc="outside upper right", ncols=3)
    peaks = ", ".join(f"{label(r['key'])} {r['peak_gpu_gib']:.1f} GiB" for r, _, _ in traces
                      if pd.notna(r["peak_gpu_gib"]))
    caption(fig, d, note or (f"NVML memory is what the caching allocator holds; peak allocated over the "
                             f"whole run (dashed; torch.cuda.max_memory_allocated): {peaks}" if peaks else ""))
    return fig


# ---------------------------------------------------------------- figure 3

def update_inputs(calib, kernels: Optional[pd.DataFrame] = None, sources: Sequence = (), note: str = ""):
    """Fig. 3: the performance model's inputs: CPU AdamW rate against threads (alone and under DMA,
    with the kernel benchmarks), copy bandwidth against the CPU lane's threads, and every update
    path as elements/s (PCIe as the state it moves: 12 B per element each way)."""
    fig, axes = figure(1, 3, w=3.8)
    a, b, c = axes[0]
    th = np.array(calib.cpu_threads)
    a.plot(th, np.array(calib.cpu_rate) / 1e9, "o-", color=PALETTE["dos-cpu"], label="dos kernel, alone")
    if calib.cpu_rate_dma:
        a.plot(th, np.array(calib.cpu_rate_dma) / 1e9, "o--", color=PALETTE["dos-interleaved"],
               label="dos kernel, DMA running")
    impls = {"dos": "dos-cpu", "deepspeed+cast": "deepspeed-zero-offload", "torch-fused+cast": "torch-gpu"}
    for impl, key in impls.items():
        k = kernels[kernels["impl"] == impl] if kernels is not None and len(kernels) else pd.DataFrame()
        if len(k):
            a.scatter(k["threads"], k["gparams_per_s"], marker="s", color=PALETTE[key], zorder=3,
                      label=f"{impl} (kernel bench)")
    a.set(xlabel="CPU threads", ylabel="CPU AdamW (G elements/s)", title="CPU Adam", xticks=th)
    a.legend(fontsize=6.5)
    if calib.has_gpu:
        _copies(b, calib)
        _rates(c, calib)
    else:
        empty(b, "copy bandwidth", why="no GPU in this calibration")
        empty(c, "GPU Adam, PCIe", why="no GPU in this calibration")
    text = (f"{calib.gpu_name or 'no GPU'} | host CPU {calib.cpu_model} ({calib.host_cores} cores) | "
            f"{calib.cpu_impl} | torch {calib.torch_version} | measured {calib.created[:10]} | "
            f"records: {', '.join(R.resolve(p).name for p in sources)}" + (f" | {note}" if note else ""))
    fig.text(0.005, -0.01, (SMOKE_NOTE + " | " if not calib.has_gpu else "") + text, ha="left",
             va="top", fontsize=7, color="0.35", wrap=True)
    return fig


def _copies(ax, calib) -> None:
    th = np.array(calib.cpu_threads)
    if calib.h2d_bw_cpu:
        ax.plot(th, np.array(calib.h2d_bw_cpu) / 1e9, "o-", color="#ff7f0e", label="H2D, duplex + CPU Adam")
    if calib.d2h_bw_cpu:
        ax.plot(th, np.array(calib.d2h_bw_cpu) / 1e9, "o-", color="#8c564b", label="D2H, duplex + CPU Adam")
    for v, ls, name in ((calib.h2d_bw, ":", "H2D alone"), (calib.d2h_bw, "-.", "D2H alone"),
                        (calib.h2d_duplex_bw, "--", "H2D duplex")):
        ax.axhline(v / 1e9, color="0.4", ls=ls, lw=1, label=name)
    ax.set(xlabel="CPU Adam threads running", ylabel="pinned copy bandwidth (GB/s)", title="PCIe",
           xticks=th)
    ax.set_ylim(0, None)
    ax.legend(fontsize=6.5)


def _rates(ax, calib) -> None:
    t = calib.cpu_threads[-1]
    names = ["GPU AdamW", f"CPU AdamW\n{t} threads", "CPU AdamW\n+ DMA", "PCIe duplex\n(12 B/elem)"]
    vals = [calib.gpu_rate, calib.cpu(t), calib.cpu(t, dma=True),
            min(calib.h2d_duplex_bw, calib.d2h_duplex_bw) / 12]
    colors = [PALETTE["dos-gpu"], PALETTE["dos-cpu"], PALETTE["dos-interleaved"], "#ff7f0e"]
    ax.bar(range(4), np.array(vals) / 1e9, color=colors)
    for i, v in enumerate(vals):
        ax.text(i, v / 1e9, f"{v / 1e9:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(0.3, max(vals) / 1e9 * 2)
    ax.set_yticks([t for t in (0.3, 1, 3, 10, 30, 100, 300) if t <= max(vals) / 1e9 * 2])
    plain_log(ax)
    ax.set_xticks(range(4), names, fontsize=7)
    ax.set(ylabel="update rate (G elements/s)", title="update paths")


# ---------------------------------------------------------------- figure 4

def timeline(events: pd.DataFrame, row, step: Optional[int] = None, note: str = ""):
    """Fig. 4: one update phase, per subgroup and lane (seconds from the start of `opt.step()`;
    negative: gradient copies during backward). Default step: the traced step of median span."""
    fig, axes = figure(1, 1, w=9.0, h=4.2)
    ax = axes[0, 0]
    if not len(events):
        empty(ax, "lane timeline (a dos run with trace on)")
        caption(fig, pd.DataFrame([row]) if row is not None else events, note)
        return fig
    if step is None:
        spans = events.groupby("step")["end_s"].max().sort_values()
        step = int(spans.index[len(spans) // 2])
    e = events[events["step"] == step]
    lanes = [x for x in LANES if x in set(e["lane"])] + sorted(set(e["lane"]) - set(LANES))
    width = e["end_s"].max() - min(0.0, e["start_s"].min())
    for y, lane in enumerate(lanes):
        spans = e[e["lane"] == lane]
        # no white edges: at this scale they would hide a GPU lane's short spans
        ax.broken_barh(list(zip(spans["start_s"] * 1e3,
                                np.maximum((spans["end_s"] - spans["start_s"]) * 1e3, width * 1e3 * 0.002))),
                       (y - 0.42, 0.84), facecolors=LANE_COLORS.get(lane, "0.6"), edgecolor="none")
        for _, s in spans.iterrows():
            if s["end_s"] - s["start_s"] > 0.03 * width:
                ax.text((s["start_s"] + s["end_s"]) * 500, y, str(s["subgroup"]), ha="center",
                        va="center", fontsize=5.5)
    ax.axvline(0, color="0.2", lw=0.8)
    ax.axvline(row["step_s"] * 1e3, color="0.2", ls="--", lw=0.8, label="measured update phase (median)")
    ax.set_yticks(range(len(lanes)), [LANE_NAMES.get(x, x) for x in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time from the start of opt.step() (ms)")
    cap = row.get("gpu_mem_cap_gib")
    where = f"GPU capped at {cap:g} GiB" if pd.notna(cap) else "whole GPU"
    ax.set_title(f"{label(row['key'])}, {row['model']}, {where}: {_plan_label(row)}, step {step}\n"
                 "the GPU lanes update every k-th subgroup while the CPU updates the rest", fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    caption(fig, pd.DataFrame([row]), note)
    return fig


def _plan_label(row) -> str:
    k = row.get("plan_stride")
    n, sg = row.get("n_subgroups"), row.get("plan_subgroup_numel")
    parts = [f"stride {int(k)}" if pd.notna(k) else "no staged lane"]
    if pd.notna(n) and pd.notna(sg):
        parts.append(f"{int(n)} subgroups of {binary(sg)} elements")
    if pd.notna(row.get("cpu_threads")):
        parts.append(f"{int(row['cpu_threads'])} CPU threads")
    return ", ".join(parts)


def pick_run(df: pd.DataFrame, run_id: Optional[str] = None):
    """The row `run_id` when recorded, else the latest row with a lane timeline (None if none)."""
    if run_id and (df["run_id"] == run_id).any():
        return df[df["run_id"] == run_id].iloc[0]
    d = df[df["lanes_file"].fillna("").ne("")].sort_values("timestamp")
    return d.iloc[-1] if len(d) else None


# ---------------------------------------------------------------- figure 5

def stride_sweep(dfp: pd.DataFrame, calibration: str = "", note: str = ""):
    """Fig. 5: measured update phase against the performance model's prediction, per stride (and
    all-CPU); the model's choice (least predicted) starred. `dfp`: `results.predictions(...)`."""
    d = R.stride_panels(dfp)
    panels = list(d.sort_values(["n_params", "panel"])["panel"].drop_duplicates()) or ["-"]
    fig, axes = figure(1, len(panels), w=4.3)
    for ax, panel in zip(axes[0], panels):
        m = d[d["panel"] == panel].copy()
        if not len(m):
            empty(ax, "stride sweep")
            continue
        top = int(np.nanmax(m["plan_stride"].to_numpy(dtype=float), initial=1))
        # "auto" rows that recorded a prediction are the model's own choice; older ones ran a default
        model_auto = m["stride"].eq("auto") & m["predicted_src"].eq("recorded")
        m["x"] = m["plan_stride"].fillna(top + 1) + np.where(model_auto, 0.15, 0.0)
        m = m.sort_values("x")
        model_auto = model_auto.reindex(m.index)
        colors = [PALETTE[k] for k in m["key"]]
        ax.scatter(m["x"], m["step_s"], color=colors, s=36, zorder=3, label="measured")
        ax.plot(m["x"], m["predicted_s"], "s:", mfc="none", color="0.3", ms=6, label="predicted")
        fixed = m[~m["stride"].eq("auto")]  # an auto run's prediction is of its refined rates
        if fixed["predicted_s"].notna().any():
            best = fixed.loc[fixed["predicted_s"].idxmin()]
            ax.scatter([best["x"]], [best["predicted_s"]], marker="*", s=160, color="#ffbf00",
                       edgecolor="0.2", zorder=4, label="model's choice")
        for _, r in m[model_auto].iterrows():
            ax.annotate("auto", (r["x"], r["step_s"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xticks(range(1, top + 2), [str(k) for k in range(1, top + 1)] + ["all\nCPU"])
        ax.set(xlabel="update stride k (every k-th subgroup on the GPU)", ylabel="update phase (s)",
               title=panel)
        ax.set_ylim(0, 1.12 * np.nanmax(np.r_[m["step_s"].to_numpy(float), m["predicted_s"].to_numpy(float)]))
        ax.set_xlim(0.4, top + 1.6)  # room for every marker, the all-CPU and auto points included
        ax.legend(fontsize=7)
    computed = d["predicted_src"].eq("computed") & d["predicted_s"].notna()
    why = "predicted: recorded by each run"
    if computed.any():
        why = (f"predicted: recorded by the run where it made one ({(~computed).sum()} runs), else "
               f"dos.perfmodel.predict of the run's recorded plan under {R.resolve(calibration).name} "
               f"({computed.sum()} runs)")
    caption(fig, d, note or why)
    return fig


# ---------------------------------------------------------------- figure 10

LINESTYLES = ("-", "--", ":", "-.")


def loss_curves(steps: pd.DataFrame, rows: pd.DataFrame, baseline: Sequence[str] = R.NO_OFFLOAD,
                smooth: int = 10, window: int = 50, note: str = ""):
    """Fig. 10: training loss per step of every system on the same data (left; the curves lie on
    top of each other, so each has its own line style), and each one's per-step difference to the
    no-offload baseline (right) inside the band of the loss's own step-to-step noise: the std of
    consecutive baseline differences / sqrt 2 over a `window`-step rolling window (what one batch
    moves the loss; checks.convergence_check's noise). Same seed, same batches: an exact
    optimizer stays well inside the band."""
    fig, axes = figure(1, 2, w=4.8)
    a, b = axes[0]
    if not len(steps):
        empty(a, "loss curves (steps.csv)")
        caption(fig, rows, note)
        return fig
    base_key = R.baseline_key(steps["key"], baseline)
    base = (steps[steps["key"] == base_key].drop_duplicates("step", keep="last").set_index("step")["loss"]
            .sort_index() if base_key else None)
    keys = ([base_key] if base_key else []) + [k for k in keys_in(steps) if k != base_key]
    for i, key in enumerate(keys):
        s = steps[steps["key"] == key].sort_values("step")
        lw, ls = (2.6, "-") if key == base_key else (1.4, LINESTYLES[1 + (i - 1) % 3])
        a.plot(s["step"], s["loss"].rolling(smooth, min_periods=1).mean(), color=PALETTE.get(key),
               lw=lw, ls=ls, alpha=0.55 if key == base_key else 1.0, label=label(key))
    a.set(xlabel="training step", ylabel=f"loss (nats/token; {smooth}-step mean)", yscale="log")
    lo, hi = steps["loss"].min(), steps["loss"].max()
    a.set_yticks([t for t in (2, 3, 4, 6, 8, 10, 12, 16) if lo * 0.9 <= t <= hi * 1.1] or [lo, hi])
    plain_log(a)
    a.legend(fontsize=7)
    if base is not None:
        noise = base.diff().rolling(window, min_periods=10, center=True).std() / 2 ** 0.5
        b.fill_between(noise.index, -noise, noise, color="0.85", lw=0,
                       label=f"\u00b1 loss noise (one batch; {window}-step window)")
        b.axhline(0, color=PALETTE.get(base_key), lw=1.2)
        for i, key in enumerate(k for k in keys if k != base_key):
            d = (steps[steps["key"] == key].drop_duplicates("step", keep="last").set_index("step")["loss"]
                 - base).dropna()
            b.plot(d.index, d.values, color=PALETTE.get(key), lw=0.6, alpha=0.35)
            b.plot(d.index, d.rolling(smooth, min_periods=1).mean(), color=PALETTE.get(key), lw=1.5,
                   ls=LINESTYLES[1 + i % 3], label=f"{label(key)} ({smooth}-step mean)")
        settled = noise[noise.index >= noise.index.min() + window]  # past the first steps' fall
        lim = float(np.nanmax(settled.to_numpy())) * 1.25 if settled.notna().any() else None
        if lim:
            b.set_ylim(-lim, lim)
        b.legend(fontsize=6.5, loc="lower left")
    b.set(xlabel="training step",
          ylabel=f"loss \u2212 {label(base_key) if base_key else 'baseline'} (nats)")
    b.set_title("difference to no offload, inside the loss's own noise", fontsize=9)
    model = rows["model"].iloc[0] if len(rows) else ""
    a.set_title(f"{model}: the same loss curve with and without offload", fontsize=9)
    data = rows["data"].iloc[0] if len(rows) else ""
    caption(fig, rows, note or f"data: {data} (same seed and batches for every system); right: faint "
            f"lines per step; the band is cut at the first {window} steps' fall, where it is wider")
    return fig
