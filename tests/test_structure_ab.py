"""The core refactor's A/B on the H200 (experiments/results/structure-ab): the check and its verdicts."""
from pathlib import Path

import pandas as pd
import pytest

from dos.lab import checks
from dos.lab.bench import records

ROOT = Path(__file__).resolve().parents[1]


def _rows(old, new, config="cpu"):
    rows = [dict(status="ok", git_sha="8d3adc6-core", placement=config, gpu_fraction="0.0", batch_id="B",
                 gpu_uuid="GPU-1", boot_id="b", step_s=t, iter_s=t) for t in old]
    rows += [dict(status="ok", git_sha="abc", placement=config, gpu_fraction="0.0", batch_id="B",
                  gpu_uuid="GPU-1", boot_id="b", step_s=t, iter_s=t) for t in new]
    return pd.DataFrame(rows)


def test_core_ab_check_passes_within_noise_and_misses_beyond_it():
    ok = checks.core_ab_check(_rows([1.0, 1.1], [1.05, 1.08]), metrics=["step_s"])
    assert ok.verdict == checks.PASS and ok["noise_pct"].iloc[0] == 9.5  # 0.1 of the old median 1.05
    shifted = checks.core_ab_check(_rows([1.0, 1.02], [1.2, 1.21]), metrics=["step_s"])
    assert shifted.verdict == checks.MISS and shifted["diff_pct"].iloc[0] == pytest.approx(19.3, abs=0.1)  # medians 1.205 vs 1.01
    too_few = checks.core_ab_check(_rows([1.0], [1.0, 1.0]), metrics=["step_s"])
    assert too_few.verdict == checks.MISS  # one run of a core: no noise to judge by
    with pytest.raises(ValueError, match="empty"):
        checks.core_ab_check(pd.DataFrame())


def test_the_refactored_core_updates_within_the_old_cores_noise_on_the_h200():
    df = pd.DataFrame(records.read_rows(ROOT / "experiments/results/structure-ab/runs.csv"))
    step = checks.core_ab_check(df, metrics=["step_s"])
    assert len(step) == 5 and step.verdict == checks.PASS  # the update phase, every 3B dos row of `scaling`
    it = checks.core_ab_check(df, metrics=["iter_s"]).set_index("config")
    # The one iteration-time miss: the refactored core's runs were faster (forward/backward).
    assert list(it.index[it["verdict"] == checks.MISS]) == ["interleaved"]
    assert it.loc["interleaved", "diff_pct"] < 0


def _sched(static, dynamic, threads=16):
    rows = [dict(status="ok", cpu_impl="dos-csrc-avx512-static", placement="interleaved", stride="3",
                 cpu_threads=threads, batch_id="B", gpu_uuid="GPU-1", boot_id="b", step_s=t, iter_s=t)
            for t in static]
    rows += [dict(status="ok", cpu_impl="dos-csrc-avx512", placement="interleaved", stride="3",
                  cpu_threads=threads, batch_id="B", gpu_uuid="GPU-1", boot_id="b", step_s=t, iter_s=t)
             for t in dynamic]
    return pd.DataFrame(rows)


def test_schedule_ab_check_passes_unless_dynamic_is_slower_beyond_the_noise():
    ok = checks.schedule_ab_check(_sched([0.70, 0.66, 0.74], [0.62, 0.63, 0.65]))
    assert ok.verdict == checks.PASS and ok["diff_pct"].iloc[0] < 0  # dynamic faster
    within = checks.schedule_ab_check(_sched([0.62, 0.63, 0.70], [0.64, 0.66, 0.65]))
    assert within.verdict == checks.PASS  # slower by 0.02, inside the static runs' 0.08 range
    slower = checks.schedule_ab_check(_sched([0.60, 0.61, 0.60], [0.70, 0.71, 0.72]))
    assert slower.verdict == checks.MISS and slower["diff_pct"].iloc[0] == pytest.approx(18.3, abs=0.1)
    alone = checks.schedule_ab_check(pd.concat([_sched([0.6, 0.61], [0.6, 0.62]),
                                                _sched([], [0.58, 0.6, 0.59], threads=15)]))
    assert alone.verdict == checks.PASS and len(alone.graded) == 2  # the 15-thread rows: reported only
    assert "15 threads" in " ".join(alone["config"])
    with pytest.raises(ValueError):
        checks.schedule_ab_check(pd.DataFrame())


def test_the_dynamic_schedule_was_not_slower_on_the_h200():
    """kernel-schedule-ab-3b, its all-CPU half (batch 20261202T035128Z-bd176992): recorded rows."""
    df = pd.DataFrame(records.read_rows(ROOT / "experiments/results/kernel-schedule-ab-3b/runs.csv"))
    chk = checks.schedule_ab_check(df.assign(cpu_threads=""))
    assert chk.verdict == checks.PASS and (chk["diff_pct"] < 0).all()


def _overlap(step, overlap):
    rows = [dict(status="ok", key="dos-interleaved", placement="interleaved", stride="auto", batch_id="B",
                 gpu_uuid="GPU-1", boot_id="b", step_s=t, iter_s=t) for t in step]
    rows += [dict(status="ok", key="dos-interleaved-overlap", placement="interleaved", stride="auto",
                  batch_id="B", gpu_uuid="GPU-1", boot_id="b", step_s=t, iter_s=t) for t in overlap]
    return pd.DataFrame(rows)


def test_overlap_ab_check_passes_only_when_overlap_is_faster_beyond_the_noise():
    ok = checks.overlap_ab_check(_overlap([0.90, 0.93, 0.95], [0.80, 0.82, 0.81]))
    assert ok.verdict == checks.PASS and (ok["diff_pct"] < 0).all()
    inside = checks.overlap_ab_check(_overlap([0.90, 0.93, 0.99], [0.88, 0.86, 0.90]))
    assert inside.verdict == checks.MISS  # faster by 0.03, inside the 0.09 range: not shown
    slower = checks.overlap_ab_check(_overlap([0.80, 0.81], [0.90, 0.91]))
    assert slower.verdict == checks.MISS and slower["diff_pct"].iloc[0] > 0
    assert checks.overlap_ab_check(_overlap([0.9], [0.5, 0.5])).verdict == checks.MISS  # one run
    raw = _overlap([0.90, 0.93], [0.80, 0.81]).drop(columns="key").assign(
        config=['{"run": {}}'] * 2 + ['{"run": {"overlap_backward": true}}'] * 2)  # runs.csv as read
    assert checks.overlap_ab_check(raw).verdict == checks.PASS
    with pytest.raises(ValueError):
        checks.overlap_ab_check(pd.DataFrame())
