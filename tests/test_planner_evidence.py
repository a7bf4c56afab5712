"""Issue 15's evidence in the lab: the planner sweeps' rows (`planner_runs`), the four checks
(both outcomes of each, exploration changing a verdict, superseded rows left out, empty input
refused) and figure 14. Synthetic rows through the real writer and reader (dos.lab.sweep.make_row,
records.append_row, results.rows) and result.json files as the bench writes them; CPU only, no
run executes, no timing assertion."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from dos.lab import planner_evidence as pe
from dos.lab import sweep as sw
from dos.lab.bench import records
from dos.lab.bench.spec import RunSpec

CONFIGS = {"cpu": {"placement": "cpu"},
           **{f"k={k}": {"placement": "interleaved", "stride": k} for k in (1, 2, 3, 4, 6)},
           "auto": {"placement": "interleaved", "stride": "auto"}}
PACE = {"cpu": 1.3, "k=1": 1.1, "k=2": 0.80, "k=3": 0.84, "k=4": 0.88, "k=6": 0.92}
"""Median iteration (s) of each fixed plan: k=2 is the best."""
WARMUP, STEPS = 16, 6


def _stride(config: str):
    return None if config == "cpu" else int(config.split("=")[1])


def _write(out, shape, *, auto_s=0.82, explore_s=0.0, kept="k=2", batch="B1", boot="boot-a", model="3B",
           cap=None, overrides=None, runs=3, hour=10, step_pred=1.0, refined=1.0, skip=(), supersede=False, ended=None,
           host_other=None, explore_extra=None):
    """One batch of a planner sweep `shape` into `out`: `runs` repetitions, round-robin, of every
    configuration (but `skip`), each fixed plan at PACE (spread -2%, 0, +2%), auto at `auto_s` with
    `explore_s` of exploration keeping `kept`; update phase = iteration / 2, the offline and in-situ
    predictions `step_pred` and `refined` times it; `supersede`: each row supersedes the earlier
    rows of its run_id (a re-measurement); `ended`: the plan auto's runs ended on when not `kept`
    (a replan after the exploration); `host_other`: the host's CPU used by others in repetition
    r's runs is host_other * r % (the sampler's record; None: recorded before it had one);
    `explore_extra`: each run also writes steps.csv (every step at its iteration time, steps 0-1
    at 5 s), auto's steps 2-9 (its exploration) `explore_extra` seconds longer.
    Returns {config: [run_id, ...]}."""
    ids = {}
    for rep in range(1, runs + 1):
        for i, (config, knobs) in enumerate(CONFIGS.items()):
            if config in skip:
                continue
            spec = RunSpec(system="dos", model=model, device="cuda", warmup=WARMUP, steps=STEPS, repeat=rep,
                           gpu_mem_cap_gib=cap, model_overrides=overrides, **knobs)
            base = auto_s if config == "auto" else PACE[config]
            iter_s = base * (0.98, 1.0, 1.02)[(rep - 1) % 3]
            stride = _stride(kept if config == "auto" else config)
            final = _stride(ended or kept) if config == "auto" else stride
            res = {"status": "ok", "iter_s": iter_s, "fwd_s": 0.05, "bwd_s": 0.15, "step_s": iter_s / 2,
                   "predicted_step_s": iter_s / 2 * step_pred, "gpu_name": "NVIDIA H200", "gpu_uuid": "GPU-1",
                   "files": {}, "n_params": 3e9,
                   "plan": {"stride": final, "cpu_threads": 16, "placement": knobs["placement"]}}
            if explore_extra is not None:
                res["files"] = {"steps_file": "steps.csv"}
            if host_other is not None:
                res["sampler"] = {"host_cpu_other_pct": host_other * rep, "host_cpu_steal_pct": 0.5,
                                  "gpu_sm_mhz_median": 1980 - 100 * rep, "gpu_sm_mhz_min": 1500,
                                  "gpu_clock_events": {"gpu_idle": 0.1, **({"sw_power_cap": 0.3} if rep == 3 else {})}}
            row = sw.make_row(spec, shape, res, 125.0, batch, (spec.run_id(),) if supersede else (),
                              "re-measured" if supersede else "")
            row.update(timestamp=f"2026-12-01T{hour:02d}:{rep:02d}:{i:02d}+00:00", boot_id=boot)
            records.append_row(out / "runs.csv", row)
            online = {"explore_steps": 0, "explore_s": 0.0, "explorations": []}
            if config == "auto":
                online = {"explore_steps": 8, "explore_s": explore_s, "explorations": [
                    {"kept": {"stride": stride, "staged_share": 0.5, "cpu_threads": 16},
                     "refined_predicted_s": iter_s / 2 * refined, "candidates": []}]}
            (out / spec.run_id()).mkdir(parents=True, exist_ok=True)
            (out / spec.run_id() / "result.json").write_text(json.dumps({**res, "online": online}))
            if explore_extra is not None:
                its = [5.0 if k < 2 else iter_s + (explore_extra if config == "auto" and k < 10 else 0.0)
                       for k in range(WARMUP + STEPS)]
                pd.DataFrame({"step": range(WARMUP + STEPS), "iter_s": its}).to_csv(
                    out / spec.run_id() / "steps.csv", index=False)
            ids.setdefault(config, []).append(spec.run_id())
    return ids


def _runs(tmp_path, name="r", **kw):
    out = tmp_path / name
    _write(out, kw.pop("shape", "planner-test"), **kw)
    return pe.planner_runs(out)


# ---------------------------------------------------------------- rows

def test_planner_runs_reads_configs_exploration_and_spreads_it_over_the_run(tmp_path):
    df = _runs(tmp_path, explore_s=0.44)
    assert len(df) == 21 and df["config"].value_counts().to_dict() == {c: 3 for c in CONFIGS}
    assert list(df["order"]) == list(range(1, 22)) and list(df["repeat"]) == [r for r in (1, 2, 3) for _ in range(7)]
    auto = df[df["config"].eq("auto")]
    assert set(auto["kept"]) == {"k=2, 16 threads"} and (auto["explore_steps"] == 8).all()
    # exploration spread over the run's own warm-up + measured iterations
    assert (auto["iter_incl_s"] - auto["iter_s"]).tolist() == pytest.approx([0.44 / (WARMUP + STEPS)] * 3)
    fixed = df[df["config"].ne("auto")]
    assert (fixed["iter_incl_s"] == fixed["iter_s"]).all() and fixed["kept"].isna().all()
    assert auto["refined_predicted_s"].tolist() == pytest.approx(auto["step_s"].tolist())
    assert df[df["config"].eq("cpu")]["plan"].eq("cpu").all()
    assert df["shape"].eq("planner-test").all() and not df["own_shape"].any()
    assert pe.plan_label(None) == "cpu" and pe.plan_label(3, 12) == "k=3, 12 threads"


def test_superseded_rows_are_left_out(tmp_path):
    """A batch re-measured (its rows name the old ones in `supersedes`) counts once: the new one."""
    out = tmp_path / "s"
    _write(out, "planner-test", auto_s=2.0, batch="B0", hour=9)  # a bad pass ...
    _write(out, "planner-test", auto_s=0.82, batch="B1", hour=10, supersede=True)  # ... re-measured
    assert len(records.read_rows(out / "runs.csv")) == 42  # every row stays in the file
    df = pe.planner_runs(out)
    assert len(df) == 21 and set(df["batch_id"]) == {"B1"}
    chk = pe.planner_check(df)
    assert len(chk) == 1 and chk["auto_vs_best"].iloc[0] == pytest.approx(0.82 / 0.80 - 1)


# ---------------------------------------------------------------- criterion 1

def test_planner_check_pass_and_miss(tmp_path):
    ok = pe.planner_check(_runs(tmp_path, "ok", auto_s=0.82))
    (r,) = ok.to_dict("records")
    assert (r["best_fixed"], r["best_fixed_s"]) == ("k=2", pytest.approx(0.80))
    assert r["k=6"] == pytest.approx(0.92) and r["runs"] == "cpu 3, k=1 3, k=2 3, k=3 3, k=4 3, k=6 3, auto 3"
    assert r["auto_vs_best"] == pytest.approx(0.025) and r["complete"] and r["round_robin"]
    assert r["verdict"] == "PASS" and ok.verdict == "PASS" and r["why"] == ""
    slow = pe.planner_check(_runs(tmp_path, "slow", auto_s=0.88))
    assert slow.verdict == "MISS" and "auto +10.0% of k=2" in slow["why"].iloc[0]
    # what bounds it: each fixed plan's runs spread 0.98-1.02 of its pace, 4% of the median
    assert slow["fixed_spread"].iloc[0] == pytest.approx(0.04) and slow["fixed_spread_max"].iloc[0] == pytest.approx(0.04)
    # ... and what the plan controls: auto's update phase (iteration / 2 here) 10% above k=2's;
    # forward + backward (0.2 s in every run) did not vary
    assert slow["auto_step_vs_best"].iloc[0] == pytest.approx(0.10) and slow["fwd_bwd_spread"].iloc[0] == 0
    assert ("(a fixed plan's runs spread 4.0% of its median, up to 4.0%; update phase: auto +10.0% of k=2; "
            "forward + backward, the same work in every run, spread 0% over the batch)") in slow["why"].iloc[0]
    # reported beside the graded number: every run's mean iteration over the same window (steps
    # 2..end: warm-up, exploration and measured steps), auto's median over the best fixed plan's
    win = pe.planner_check(_runs(tmp_path, "win", auto_s=0.82, explore_extra=0.2))
    n = WARMUP + STEPS - 2
    assert win["auto_window_vs_best"].iloc[0] == pytest.approx((0.82 + 8 * 0.2 / n) / 0.80 - 1)
    assert ok["auto_window_vs_best"].isna().all()  # no steps files: nothing to report
    # runs that recorded the host's CPU (dos.lab.nvml.HostCpu): the MISS says how busy others kept it
    host = pe.planner_check(_runs(tmp_path, "host", auto_s=0.88, host_other=2.0))
    assert host["host_other_pct"].iloc[0] == "2.0-6.0" and host["host_steal_pct"].iloc[0] == "0.5-0.5"
    assert "; the host's CPU used by others 2.0-6.0%, stolen 0.5-0.5% of its CPUs over the runs;" in host["why"].iloc[0]
    # and the GPU's clocks (dos.lab.nvml: SM clock medians over the runs, reasons for lower clocks)
    assert host["gpu_sm_mhz"].iloc[0] == "1680-1880" and host["gpu_clock_events"].iloc[0] == "sw_power_cap"
    assert "; the GPU's SM clock 1680-1880 MHz (run medians), held down by sw_power_cap)" in host["why"].iloc[0]
    assert slow["host_other_pct"].iloc[0] == "" and slow["gpu_sm_mhz"].iloc[0] == ""  # none recorded: not named
    assert "SM clock" not in slow["why"].iloc[0]
    few = pe.planner_check(_runs(tmp_path, "few", auto_s=0.80, runs=2))
    assert few.verdict == "MISS" and "fewer than 3 runs" in few["why"].iloc[0]
    missing = pe.planner_check(_runs(tmp_path, "nok6", auto_s=0.80, skip=("k=6",)))
    assert missing.verdict == "MISS" and "k=6 0" in missing["runs"].iloc[0]


def test_exploration_included_changes_the_verdict(tmp_path):
    """Measured steps alone within 5% (+2.5%); the exploration spread over the run's 22 iterations
    adds 1.1 / 22 = 0.05 s: +8.75%, a MISS."""
    df = _runs(tmp_path, auto_s=0.82, explore_s=1.1)
    chk = pe.planner_check(df)
    assert chk["auto_s"].iloc[0] / chk["best_fixed_s"].iloc[0] - 1 == pytest.approx(0.025)
    assert chk["auto_vs_best"].iloc[0] == pytest.approx((0.82 + 1.1 / 22) / 0.80 - 1)
    assert chk.verdict == "MISS"
    assert pe.planner_check(_runs(tmp_path, "cheap", auto_s=0.82, explore_s=0.1)).verdict == "PASS"


def test_runs_of_another_warm_up_are_no_comparison(tmp_path):
    df = _runs(tmp_path, auto_s=0.80)
    df.loc[df.index[0], ["warmup", "iters"]] = [2, 8]
    chk = pe.planner_check(df)
    assert chk.verdict == "MISS" and "warm-up" in chk["why"].iloc[0] and chk["iters"].iloc[0] == "2+6/16+6"


def test_a_run_out_of_round_robin_order_misses(tmp_path):
    df = _runs(tmp_path, auto_s=0.80)
    first = df.index[df["repeat"].eq(1)][0]
    df.loc[first, "timestamp"] = "2026-12-01T23:00:00+00:00"  # repetition 1 of all-CPU ran last
    chk = pe.planner_check(df)
    assert not chk["round_robin"].iloc[0] and chk.verdict == "MISS" and "not round-robin" in chk["why"].iloc[0]
    assert pe.planner_coverage_check(df).set_index("requirement").loc["shapes with a complete batch", "have"] == 0


def test_every_check_refuses_empty_input():
    for check in (pe.planner_check, pe.planner_coverage_check, pe.planner_prediction_check,
                  pe.planner_repeat_check):
        with pytest.raises(ValueError, match="empty input"):
            check(pe.planner_rows(pd.DataFrame()))


def test_coverage_needs_four_complete_shapes_two_own_and_the_two_presets(tmp_path):
    out = tmp_path / "c"
    _write(out / "a", "planner-3b")
    _write(out / "b", "planner-7b-40g", model="7B", cap=40)
    _write(out / "c", "planner-wide", overrides={"hidden": 4608, "layers": 16, "heads": 36, "ffn": 12288})
    dirs = [out / "a", out / "b", out / "c"]
    chk = pe.planner_coverage_check(pe.planner_runs(dirs)).set_index("requirement")
    assert chk.loc["shapes with a complete batch", "have"] == 3 and chk.verdict == "MISS"
    assert chk.loc["own shapes (outside the presets)", "verdict"] == "MISS"
    assert chk.loc["3B uncapped", "verdict"] == "PASS"
    assert chk.loc["7B with the GPU capped at 40 GiB", "verdict"] == "PASS"
    _write(out / "d", "planner-deep", overrides={"hidden": 2304, "layers": 40, "heads": 18, "ffn": 9216})
    full = pe.planner_coverage_check(pe.planner_runs([*dirs, out / "d"]))
    assert full.verdict == "PASS" and full.set_index("requirement").loc["own shapes (outside the presets)", "have"] == 2
    # an incomplete batch (2 runs of each) does not count, whatever auto did
    _write(out / "e", "planner-deep", overrides={"hidden": 2304, "layers": 40, "heads": 18, "ffn": 9216}, runs=2)
    assert pe.planner_coverage_check(pe.planner_runs([*dirs, out / "e"])).verdict == "MISS"


# ---------------------------------------------------------------- criterion 2

@pytest.mark.parametrize("refined, verdict", [(1.05, "PASS"), (1.15, "MISS")])
def test_prediction_check_grades_in_situ_and_reports_offline(tmp_path, refined, verdict):
    df = _runs(tmp_path, refined=refined, step_pred=1.3)  # the offline profile 30% off
    chk = pe.planner_prediction_check(df).set_index("prediction")
    assert chk.loc["in situ", "graded"] and not chk.loc["offline", "graded"]
    assert chk.loc["in situ", "median_error"] == pytest.approx(refined - 1)
    assert chk.loc["offline", "worst_error"] == pytest.approx(0.3) and chk.loc["offline", "verdict"] == "MISS"
    assert chk.loc["in situ", "verdict"] == verdict and pe.planner_prediction_check(df).verdict == verdict
    assert chk.loc["in situ", "runs"] == 3 and chk.loc["in situ", "by_shape"].startswith("planner-test: ")
    assert "not graded" in pe.planner_prediction_check(df).summary()


def test_a_refined_prediction_of_a_plan_the_run_left_is_not_compared(tmp_path):
    df = _runs(tmp_path, kept="k=2", ended="k=4")
    auto = df[df["config"].eq("auto")]
    assert set(auto["kept"]) == {"k=2, 16 threads"} and set(auto["plan"]) == {"k=4, 16 threads"}
    assert auto["refined_predicted_s"].isna().all()
    chk = pe.planner_prediction_check(df).set_index("prediction")
    assert chk.loc["in situ", "runs"] == 0 and chk.loc["in situ", "verdict"] == "MISS"
    assert "no auto run recorded" in chk.loc["in situ", "why"]


def test_prediction_check_worst_error_alone_misses(tmp_path):
    df = _runs(tmp_path)
    auto = df.index[df["config"].eq("auto")]
    df.loc[auto[0], "refined_predicted_s"] = df.loc[auto[0], "step_s"] * 1.25  # one run 25% off
    chk = pe.planner_prediction_check(df).set_index("prediction")
    assert chk.loc["in situ", "median_error"] == pytest.approx(0.0)
    assert chk.loc["in situ", "worst_error"] == pytest.approx(0.25) and chk.loc["in situ", "verdict"] == "MISS"


# ---------------------------------------------------------------- criterion 3

def test_repeat_check_same_choice_near_choice_and_miss(tmp_path):
    a = tmp_path / "a"
    _write(a, "planner-3b", kept="k=2", batch="B1", boot="boot-a", hour=10)
    first = pe.planner_runs(a)
    none = pe.planner_repeat_check(first)
    assert none.verdict == "MISS" and none["why"].iloc[0] == pe.NO_REPEAT
    # a second batch on the same boot (no restart) is no repeat on a fresh machine
    _write(tmp_path / "same", "planner-3b", batch="B2", boot="boot-a", hour=11)
    assert pe.planner_repeat_check(pe.planner_runs([a, tmp_path / "same"]))["why"].iloc[0] == pe.NO_REPEAT
    _write(tmp_path / "b", "planner-3b", kept="k=2", batch="B2", boot="boot-b", hour=12)
    same = pe.planner_repeat_check(pe.planner_runs([a, tmp_path / "b"]))
    assert same.verdict == "PASS" and same["same_choice"].iloc[0]
    assert (same["first_choice"].iloc[0], same["second_choice"].iloc[0]) == ("k=2, 16 threads",) * 2
    _write(tmp_path / "c", "planner-3b", kept="k=3", batch="B3", boot="boot-c", hour=13)  # k=3: +5% of k=2
    near = pe.planner_repeat_check(pe.planner_runs([a, tmp_path / "c"]))
    assert not near["same_choice"].iloc[0] and near["second_vs_best"].iloc[0] == pytest.approx(0.05)
    assert near.verdict == "PASS"
    _write(tmp_path / "d", "planner-3b", kept="k=6", batch="B4", boot="boot-d", hour=14)  # k=6: +15%
    far = pe.planner_repeat_check(pe.planner_runs([a, tmp_path / "d"]))
    assert far.verdict == "MISS" and far["second_vs_best"].iloc[0] == pytest.approx(0.15)
    # the same choice in a second batch cut short (one run of auto missing): not comparable yet
    cut = pe.planner_runs([a, tmp_path / "b"])
    cut = cut.drop(cut.index[cut["batch_id"].eq("B2") & cut["config"].eq("auto")][-1])
    short = pe.planner_repeat_check(cut)
    assert short["same_choice"].iloc[0] and short.verdict == "MISS"
    assert short["why"].iloc[0].startswith("second batch incomplete (") and not short["complete"].iloc[0]


def test_repeat_check_breaks_a_tie_towards_the_slowest_choice(tmp_path):
    _write(tmp_path / "a", "planner-3b", kept="k=2", boot="boot-a", hour=10)
    _write(tmp_path / "b", "planner-3b", kept="k=2", batch="B2", boot="boot-b", hour=12)
    df = pe.planner_runs([tmp_path / "a", tmp_path / "b"])
    second = df.index[df["config"].eq("auto") & df["batch_id"].eq("B2")]
    df.loc[second[0], "kept"], df.loc[second[1], "kept"] = "k=6, 16 threads", "cpu"  # three plans, once each
    chk = pe.planner_repeat_check(df)
    assert chk["second_tied"].iloc[0] and chk["second_choice"].iloc[0] == "cpu"  # all-CPU: the slowest
    assert chk.verdict == "MISS"


def test_repeat_check_grades_each_shapes_latest_pair_of_complete_batches(tmp_path):
    """Each batch is compared with the shape's previous complete batch on another machine; only
    the latest complete pair is graded (the method as it stands), the earlier ones are reported."""
    _write(tmp_path / "a", "planner-3b", kept="k=6", batch="B1", boot="boot-a", hour=10)  # k=6: +15%
    _write(tmp_path / "b", "planner-3b", kept="k=2", batch="B2", boot="boot-b", hour=12)
    _write(tmp_path / "c", "planner-3b", kept="k=2", batch="B3", boot="boot-c", hour=14)
    chk = pe.planner_repeat_check(pe.planner_runs([tmp_path / x for x in "abc"]))
    assert list(zip(chk["first_batch"], chk["second_batch"])) == [("B1", "B2"), ("B2", "B3")]
    assert list(chk["verdict"]) == ["MISS", "PASS"] and list(chk["graded"]) == [False, True]
    assert chk.verdict == "PASS"
    # a later pair that disagrees is graded: an earlier agreement does not carry the verdict
    _write(tmp_path / "d", "planner-3b", kept="k=6", batch="B4", boot="boot-d", hour=16)
    chk = pe.planner_repeat_check(pe.planner_runs([tmp_path / x for x in "abcd"]))
    assert list(chk["graded"]) == [False, False, True] and chk.verdict == "MISS"
    assert (chk["second_batch"].iloc[-1], chk["first_batch"].iloc[-1]) == ("B4", "B3")
    # a batch cut short after it: reported against the last complete one, not graded
    _write(tmp_path / "e", "planner-3b", kept="k=2", batch="B5", boot="boot-e", hour=18, skip=("k=6",))
    chk = pe.planner_repeat_check(pe.planner_runs([tmp_path / x for x in "abcde"]))
    last = chk.iloc[-1]
    assert (last["first_batch"], last["second_batch"], last["graded"]) == ("B4", "B5", False)
    assert chk.graded["second_batch"].tolist() == ["B4"] and chk.verdict == "MISS"


# ---------------------------------------------------------------- figure 14

def test_planner_figure_with_and_without_rows(tmp_path):
    pytest.importorskip("seaborn")
    from dos.lab import plots_planner

    df = _runs(tmp_path, explore_s=0.4)
    fig = plots_planner.planner_figure(df, tmp_path / "fig", shapes=["planner-test", "planner-7b-40g"])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("planner-test, batch B1") and "of best fixed (k=2)" in titles[0]
    assert any("planner-7b-40g.yaml" in t.get_text() for ax in fig.axes for t in ax.texts)
    assert all((tmp_path / "fig" / f"{plots_planner.NAME}.{e}").stat().st_size > 1000 for e in ("png", "svg"))
    fig = plots_planner.planner_figure(pe.planner_rows(pd.DataFrame()))
    assert sum("no records yet" in t.get_text() for ax in fig.axes for t in ax.texts) == 3



def test_a_repeat_sweep_measures_its_shape():
    """A sweep named `<shape>-repeat` (its own results directory) re-measures `<shape>`."""
    from dos.lab.planner_evidence import shape_of

    assert shape_of("planner-3b-repeat") == shape_of("planner-3b-repeat-2") == "planner-3b"
    assert shape_of("planner-wide-4b") == "planner-wide-4b" and shape_of("repeat-x") == "repeat-x"
