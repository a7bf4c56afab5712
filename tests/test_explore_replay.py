"""dos.lab.explore_replay: recorded explorations replayed offline. Synthetic run folders (result.json
and steps.csv as the bench writes them); CPU only, nothing timed."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from dos.lab.explore_replay import exploration_replay, replay_choices


def _auto_run(tmp_path, run_id, cands, start=2, shift=0, fb=0.2):
    """An exploring run: candidates (stride, update_s, fb after it) from Planner step `start`, one
    step each; `shift` misplaces the recorded periods by that many rows (an older timing)."""
    d = tmp_path / run_id
    d.mkdir()
    n = start + len(cands) + 6
    upd = [0.6] * n
    fbs = [fb] * (n + 1)
    for i, (_, u, f) in enumerate(cands):
        upd[start + i - 1] = u
        fbs[start + i] = f
    steps = pd.DataFrame({"step": range(n), "measured": [False] * n, "fwd_s": [x / 3 for x in fbs[:n]],
                          "bwd_s": [2 * x / 3 for x in fbs[:n]], "step_s": upd})
    steps["iter_s"] = steps["fwd_s"] + steps["bwd_s"] + steps["step_s"]
    steps.to_csv(d / "steps.csv", index=False)
    recorded = []
    for i, (k, u, f) in enumerate(cands):
        j = start + i - 1 + shift
        recorded.append({"stride": k, "staged_share": 0.1, "cpu_threads": 16, "predicted_s": 0.6,
                         "measured_s": upd[j] + fbs[j + 1], "steps": 1, "stage": 1})
    best = min(recorded, key=lambda c: c["measured_s"])
    res = {"online": {"explorations": [{"start_step": start, "kept": {"stride": best["stride"]},
                                        "candidates": recorded}]}}
    (d / "result.json").write_text(json.dumps(res))
    return {"run_id": run_id, "batch_id": "B1", "model": "3B", "key": "dos-interleaved", "stride": "auto",
            "results_dir": str(tmp_path), "steps_file": f"{run_id}/steps.csv", "iter_s": 0.9, "step_s": 0.6}


def _fixed(plan, iter_s, step_s, rep):
    key, stride = ("dos-cpu", None) if plan == "cpu" else ("dos-interleaved", plan)
    return {"run_id": f"{plan}-{rep}", "batch_id": "B1", "model": "3B", "key": key, "stride": stride,
            "results_dir": "", "steps_file": "", "iter_s": iter_s, "step_s": step_s}


def test_replay_scores_by_period_and_by_update(tmp_path):
    # k=5's step had a quick forward+backward after it (0.15 against 0.25): it wins by period,
    # k=3 by update phase; the batch's fixed k=3 is its best, k=5 was never run fixed
    run = _auto_run(tmp_path, "a1", [(2, 0.70, 0.25), (None, 0.68, 0.25), (3, 0.60, 0.25), (5, 0.62, 0.15)])
    fixed = [_fixed(p, i, s, r) for p, i, s in (("cpu", 0.95, 0.7), (2, 0.92, 0.7), (3, 0.82, 0.6))
             for r in range(3)]
    rows = pd.DataFrame([run] + fixed)
    cand = exploration_replay(rows)
    assert cand["aligned"].all() and cand["plan"].tolist() == ["2", "cpu", "3", "5"]
    assert cand.set_index("plan").loc["3", "update_s"] == pytest.approx(0.60)
    ch = replay_choices(rows).iloc[0]
    assert (ch["kept"], ch["by_period"], ch["by_update"], ch["best_fixed"]) == ("5", "5", "3", "3")
    assert ch["by_update_iter_s"] == pytest.approx(0.82) and ch["by_period_iter_s"] != ch["by_period_iter_s"]


def test_replay_leaves_out_an_exploration_it_cannot_align(tmp_path):
    run = _auto_run(tmp_path, "a2", [(2, 0.70, 0.25), (None, 0.50, 0.40), (3, 0.60, 0.25)], shift=1)
    rows = pd.DataFrame([run, _fixed(3, 0.8, 0.6, 0)])
    assert not exploration_replay(rows)["aligned"].all()
    assert replay_choices(rows).empty
    with pytest.raises(ValueError):
        exploration_replay(pd.DataFrame())
