"""Issue 16, honest evidence: the record schema grows append-only, the sweep protocol (batch,
repeats, headline sweeps from a clean tree, superseding rows), ratios within one batch only, and
every check's PASS / MISS verdict against its target (and its refusal of empty input).

No run executes here (synthetic rows through the real writer and reader); no timing assertion."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from dos.lab import checks, results
from dos.lab import sweep as sw
from dos.lab.bench import records
from dos.lab.bench.spec import ConfigError, RunSpec

OLD_COLUMNS = records.COLUMNS[:51]  # the schema before issue 16


# ---------------------------------------------------------------- records: append-only schema

def _old_file(path, n=2):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(OLD_COLUMNS)
        for i in range(n):
            w.writerow([{"run_id": f"old{i}", "status": "ok", "system": "torch-cpu"}.get(c, "") for c in OLD_COLUMNS])
    return path.read_bytes()


def test_appending_to_an_old_file_keeps_its_lines_and_records_the_new_columns(tmp_path):
    path = tmp_path / "runs.csv"
    before = _old_file(path)
    records.append_row(path, {"run_id": "new", "status": "ok", "system": "dos", "batch_id": "b1",
                              "state_dtype": "fp32", "repeat": 2, "supersedes": "old0"})
    after = path.read_bytes()
    assert after.startswith(before)  # nothing rewritten: the header and old lines are as they were
    rows = records.read_rows(path)
    assert [r["run_id"] for r in rows] == ["old0", "old1", "new"]
    assert all(list(r) == list(records.COLUMNS) for r in rows)
    assert rows[0]["batch_id"] == "" and rows[0]["state_dtype"] == ""  # old rows: empty new columns
    assert (rows[2]["batch_id"], rows[2]["state_dtype"], rows[2]["repeat"], rows[2]["supersedes"]) == (
        "b1", "fp32", "2", "old0")


def test_a_file_of_another_schema_keeps_its_columns(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("run_id,status,impl\nk1,ok,dos\n")
    records.append_row(path, {"run_id": "k2", "status": "ok", "batch_id": "x"})
    assert path.read_text() == "run_id,status,impl\nk1,ok,dos\nk2,ok,\n"
    assert [r["run_id"] for r in records.read_rows(path)] == ["k1", "k2"]


def test_boot_id_and_git_sha():
    assert isinstance(records.boot_id(), str)
    assert records.git_sha()  # a sha, '-dirty' or 'unknown'; never empty


# ---------------------------------------------------------------- the sweep protocol

def test_repeat_is_round_robin_with_distinct_run_ids():
    sweep = sw.parse({"defaults": {"model": "tiny", "device": "cpu"}, "repeat": 3,
                      "runs": [{"system": "torch-cpu"}, {"system": "dos", "placement": "cpu"}]}, "r")
    assert [(s.system, s.repeat) for s in sweep.runs] == [
        ("torch-cpu", 1), ("dos", 1), ("torch-cpu", 2), ("dos", 2), ("torch-cpu", 3), ("dos", 3)]
    assert len({s.run_id() for s in sweep.runs}) == 6
    three = [{"system": "torch-cpu"}, {"system": "dos", "placement": "cpu"}, {"system": "dos", "placement": "gpu"}]
    rot = sw.parse({"defaults": {"model": "tiny", "device": "cpu"}, "repeat": 3, "order": "rotate", "runs": three}, "o")
    assert [(s.placement or s.system, s.repeat) for s in rot.runs] == [
        ("torch-cpu", 1), ("cpu", 1), ("gpu", 1), ("cpu", 2), ("gpu", 2), ("torch-cpu", 2),
        ("gpu", 3), ("torch-cpu", 3), ("cpu", 3)]  # each run once at every position
    assert {s.run_id() for s in rot.runs} == {s.run_id() for s in sw.parse(
        {"defaults": {"model": "tiny", "device": "cpu"}, "repeat": 3, "runs": three}, "o").runs}  # same runs
    with pytest.raises(ConfigError, match="order must be one of"):
        sw.parse({"order": "random", "runs": [{"system": "torch-cpu"}]})
    single = sw.parse({"defaults": {"model": "tiny", "device": "cpu"}, "runs": [{"system": "torch-cpu"}]}, "s")
    assert single.runs[0].repeat is None and single.runs[0].run_id() == RunSpec(
        system="torch-cpu", model="tiny", device="cpu").run_id()  # old ids unchanged
    with pytest.raises(ConfigError, match="repeat must be an int >= 1"):
        sw.parse({"repeat": 0, "runs": [{"system": "torch-cpu"}]})
    with pytest.raises(ConfigError, match="supersede_reason"):
        sw.parse({"supersedes": ["abc"], "runs": [{"system": "torch-cpu"}]})


def test_headline_sweep_refuses_a_dirty_tree(tmp_path, monkeypatch):
    sweep = sw.parse({"headline": True, "runs": [{"system": "torch-cpu", "device": "cpu"}]}, "h")
    monkeypatch.delenv("DOS_ALLOW_DIRTY", raising=False)
    monkeypatch.setenv("DOS_GIT_SHA", "abc123-dirty")
    with pytest.raises(sw.DirtyTree, match="headline sweep"):
        sw.run(sweep, tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()  # nothing ran
    sw.check_clean(sweep, allow_dirty=True)  # --allow-dirty
    monkeypatch.setenv("DOS_ALLOW_DIRTY", "1")
    sw.check_clean(sweep)
    monkeypatch.delenv("DOS_ALLOW_DIRTY")
    monkeypatch.setenv("DOS_GIT_SHA", "abc123")
    sw.check_clean(sweep)  # clean
    sw.check_clean(sw.parse({"runs": [{"system": "torch-cpu"}]}, "n"))  # not a headline sweep
    monkeypatch.setenv("DOS_GIT_SHA", "abc123-dirty")
    r = subprocess.run([sys.executable, "-m", "dos", "sweep", "experiments/sweeps/headline-3b.yaml",
                        "--out", str(tmp_path / "h3")], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "headline sweep" in r.stderr and not (tmp_path / "h3").exists()


def test_rows_carry_the_protocol_columns(tmp_path, monkeypatch):
    """Skipped rows (no run needed) written by one sweep call share its batch_id and carry the
    boot id, state precision and repeat; a second call is another batch."""
    monkeypatch.setenv("DOS_GIT_SHA", "abc123")
    sweep = sw.parse({"defaults": {"device": "cpu"}, "host_memory_gib": 0.01, "repeat": 2,
                      "runs": [{"system": "dos", "placement": "cpu", "model": "1.3B"},
                               {"system": "torch-cpu", "model": "1.3B"}]}, "p")
    sw.run(sweep, tmp_path, progress=False, batch_id="batch-A")
    rows = records.read_rows(tmp_path / "runs.csv")
    assert [r["repeat"] for r in rows] == ["1", "1", "2", "2"] and {r["batch_id"] for r in rows} == {"batch-A"}
    assert {r["state_dtype"] for r in rows} == {"fp32"} and rows[0]["boot_id"] == records.boot_id()
    assert rows[0]["gpu_uuid"] == ""  # the CPU device
    assert sw.new_batch_id() != sw.new_batch_id()


def test_state_dtype_of_each_system():
    assert RunSpec(system="dos", placement="cpu").state_dtype() == "fp32"
    assert RunSpec(system="torch-gpu").state_dtype() == "fp32"
    assert RunSpec(system="deepspeed-zero2-offload").state_dtype() == "fp32"
    assert RunSpec(system="deepspeed-zero2-offload-bf16").state_dtype() == "bf16"
    assert RunSpec(system="torchao-cpu-offload").state_dtype() == "bf16"
    assert RunSpec(system="torchao-cpu-offload", dtype="fp32").state_dtype() == "fp32"


# ---------------------------------------------------------------- synthetic rows

def _row(out, system, iter_s, *, model="3B", batch="B1", ts="2026-12-01T10:00:00+00:00", repeat=None,
         supersedes=None, status="ok", **kw):
    spec_kw = {k: v for k, v in kw.items() if k in RunSpec.__dataclass_fields__}
    spec = RunSpec(system=system, model=model, device=kw.pop("device", "cuda"), repeat=repeat, **spec_kw)
    res = {"status": status, "iter_s": iter_s, "fwd_s": kw.get("fwd_s", 0.1), "bwd_s": kw.get("bwd_s", 0.2),
           "step_s": kw.get("step_s", iter_s / 2), "gpu_name": "H200", "gpu_uuid": "GPU-1", "files": {},
           "peak_gpu_gib": kw.get("peak_gpu_gib", 10.0), "plan": kw.get("plan")}
    row = sw.make_row(spec, "t", res, 125.0, batch, supersedes or (), "re-measured" if supersedes else "")
    row["timestamp"] = ts
    records.append_row(out / "runs.csv", row)
    return spec.run_id()


def _batch(out, medians, batch="B1", model="3B", runs=3):
    """`runs` rows of each system at its median (spread +-10%)."""
    for i in range(runs):
        for key, (system, extra, m) in medians.items():
            _row(out, system, m * (0.9, 1.0, 1.1)[i % 3], model=model, batch=batch, repeat=i + 1,
                 ts=f"2026-12-01T10:{i:02d}:{len(key):02d}+00:00", **extra)


MEDIANS = {"dos-interleaved": ("dos", {"placement": "interleaved"}, 0.9),
           "dos-cpu": ("dos", {"placement": "cpu"}, 1.2),
           "deepspeed-zero2-offload": ("deepspeed-zero2-offload", {}, 2.4),
           "deepspeed-zero3-offload": ("deepspeed-zero3-offload", {}, 3.0),
           "deepspeed-zero2-offload-bf16": ("deepspeed-zero2-offload-bf16", {}, 2.0),
           "torchao-cpu-offload": ("torchao-cpu-offload", {}, 1.0)}


def test_summary_ratios_within_one_batch_and_the_fastest_baseline_of_equal_precision(tmp_path):
    _batch(tmp_path, MEDIANS, "B1")
    _batch(tmp_path, {"deepspeed-zero2-offload": MEDIANS["deepspeed-zero2-offload"]}, "B2")
    df = results.rows(tmp_path)
    summ = results.summary(df)
    z2 = summ[summ["key"].eq("deepspeed-zero2-offload")].set_index("batch_id")
    assert (z2.loc["B1", "median"], z2.loc["B1", "min"], z2.loc["B1", "max"], z2.loc["B1", "runs"]) == \
        pytest.approx((2.4, 2.16, 2.64, 3))
    b1 = summ[summ["batch_id"].eq("B1")]
    assert results.ratio(b1, "dos-interleaved", "deepspeed-zero2-offload") == pytest.approx(0.375)
    with pytest.raises(ValueError, match="not within one batch"):
        results.ratio(pd.concat([b1[b1["key"].eq("dos-interleaved")], z2.reset_index().iloc[[1]]]),
                      "dos-interleaved", "deepspeed-zero2-offload")
    h = results.headline_ratios(df).set_index("key")
    # fp32 dos against the fastest fp32 baseline (ZeRO-2 offload), not torchao's or DeepSpeed's bf16 mode
    assert h.loc["dos-interleaved", "baseline"] == "deepspeed-zero2-offload"
    assert h.loc["dos-interleaved", "baseline_label"] == "DeepSpeed ZeRO-2 + CPU optimizer offload"
    assert h.loc["dos-interleaved", "vs_baseline"] == pytest.approx(0.375)
    assert h.loc["dos-interleaved", "range_s"] == "0.810-0.990"
    table = results.batch_table(df)
    assert "| B1 | 3B | dos interleaved | fp32 | 3 | 0.900 | 0.810-0.990 | 0.38x DeepSpeed ZeRO-2 + CPU optimizer offload" in table
    # torchao (bf16 state) is the fastest bf16 baseline: it says so, and the others of its precision compare to it
    assert "| B1 | 3B | torchao CPUOffloadOptimizer | bf16 | 3 | 1.000 | 0.900-1.100 | (the fastest bf16 offload baseline) |" in table
    assert "| B1 | 3B | DeepSpeed ZeRO-2 + CPU optimizer offload, bf16 master and states | bf16 | 3 | 2.000 | 1.800-2.200 | 2.00x torchao CPUOffloadOptimizer |" in table
    assert "| B1 | 3B | DeepSpeed ZeRO-2 + CPU optimizer offload | fp32 | 3 | 2.400 | 2.160-2.640 | (the fastest fp32 offload baseline) |" in table


def test_headline_check_pass_miss_and_empty(tmp_path):
    _batch(tmp_path, MEDIANS)
    chk = checks.headline_check(results.rows(tmp_path), models=("3B",))
    assert chk.verdict == "PASS" and list(chk["verdict"]) == ["PASS"]
    chk = checks.headline_check(results.rows(tmp_path))  # the criterion holds at 3B and ~5B: 5B has no batch
    assert chk.verdict == "MISS" and list(chk["model"]) == ["3B", "5B"] and list(chk["verdict"]) == ["PASS", "MISS"]
    assert chk["batch_id"].iloc[1] == "(none recorded)"
    slow = {**MEDIANS, "dos-interleaved": ("dos", {"placement": "interleaved"}, 1.2)}
    _batch(tmp_path / "slow", slow)
    assert checks.headline_check(results.rows(tmp_path / "slow"), models=("3B",)).verdict == "MISS"
    _batch(tmp_path / "few", MEDIANS, runs=2)  # fewer than 3 runs: no evidence
    assert checks.headline_check(results.rows(tmp_path / "few"), models=("3B",)).verdict == "MISS"
    with pytest.raises(ValueError, match="empty input"):
        checks.headline_check(results.rows(tmp_path / "none"))


def test_headline_check_grades_dos_interleaved_overlapped_with_backward(tmp_path):
    """The headline sweeps run dos interleaved with its CPU lane started during backward
    (overlap_backward, key dos-interleaved-overlap): criterion 2 grades that row; a batch with no
    fp32 offload baseline yields no comparable row, a MISS."""
    over = {k: v for k, v in MEDIANS.items() if k != "dos-interleaved"}
    over["dos-interleaved-overlap"] = ("dos", {"placement": "interleaved", "overlap_backward": True}, 0.7)
    _batch(tmp_path, over)
    chk = checks.headline_check(results.rows(tmp_path), models=("3B",))
    assert list(chk["key"]) == ["dos-interleaved-overlap"] and chk.verdict == "PASS"
    assert chk["vs_baseline"].iloc[0] == pytest.approx(0.7 / 2.4)
    alone = {k: over[k] for k in ("dos-interleaved-overlap", "torchao-cpu-offload")}  # bf16 baseline only
    _batch(tmp_path / "alone", alone)
    chk = checks.headline_check(results.rows(tmp_path / "alone"), models=("3B",))
    assert list(chk["batch_id"]) == ["(none recorded)"] and chk.verdict == "MISS"


def test_results_table_shows_headline_batches_or_names_the_sweeps_to_run(tmp_path):
    """figures/results.md (and the README) carry the headline batches' table (medians, ranges,
    ratios within the batch), and until one is recorded, the sweeps that would record it; the
    panels of figure 15 show one batch each (the latest)."""
    from dos.lab import figures

    (tmp_path / "scaling").mkdir()
    _row(tmp_path / "scaling", "dos", 1.0, placement="cpu")
    assert "none recorded yet: `experiments/sweeps/headline-1.3b.yaml`" in figures.results_table(tmp_path)
    _batch(tmp_path / "headline-3b", MEDIANS, "B-old")
    _batch(tmp_path / "headline-3b", {"dos-cpu": MEDIANS["dos-cpu"]}, "B-new")
    _row(tmp_path / "headline-3b", "torch-gpu", 0.2, batch="B-new", ts="2026-12-01T11:00:00+00:00")  # last
    table = figures.results_table(tmp_path)
    assert "none recorded yet" not in table
    assert "| B-old | 3B | dos interleaved | fp32 | 3 | 0.900 | 0.810-0.990 | 0.38x DeepSpeed ZeRO-2 + CPU optimizer offload |" in table
    assert "| B-new | 3B | dos all-CPU | fp32 | 3 | 1.200 |" in table  # no baseline in its batch: no ratio
    assert "fewer than" not in table  # 3 runs on each side: a headline ratio
    _batch(tmp_path / "headline-3b", {k: MEDIANS[k] for k in ("dos-cpu", "deepspeed-zero2-offload")}, "B-two", runs=2)
    table = figures.results_table(tmp_path)
    assert "| B-two | 3B | dos all-CPU | fp32 | 2 | 1.140 | 1.080-1.200 | 0.50x DeepSpeed ZeRO-2 + CPU optimizer " \
        "offload (fewer than 3 runs) |" in table
    from dos.lab import plots_headline
    df = results.rows([tmp_path / "headline-3b"])
    assert set(plots_headline.latest_batch(df)["batch_id"]) == {"B-new"}
    fig = plots_headline.headline_figure(df, str(tmp_path / "fig"), sweeps=("headline-1.3b", "headline-3b"))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0] == "headline-1.3b"  # no records: the panel names the sweep to run
    assert titles[1].startswith("3B, batch B-new") and "no fp32 offload baseline" in titles[1]
    assert (tmp_path / "fig" / "15-headline.png").exists()


def test_superseded_rows_are_ignored_by_readers(tmp_path):
    old = _row(tmp_path, "dos", 2.0, placement="cpu", warmup=2, ts="2026-12-01T09:00:00+00:00")
    _row(tmp_path, "dos", 1.0, placement="cpu", warmup=5, supersedes=[old], ts="2026-12-01T10:00:00+00:00")
    lines = (tmp_path / "runs.csv").read_text().splitlines()
    assert len(lines) == 3  # both rows stay in the file
    df = results.rows(tmp_path)
    assert list(df["iter_s"]) == [1.0] and df["supersede_reason"].iloc[0] == "re-measured"
    # a row re-measuring its own configuration later does not hide itself
    _row(tmp_path, "dos", 1.5, placement="cpu", warmup=2, supersedes=[old], ts="2026-12-01T11:00:00+00:00")
    assert sorted(results.rows(tmp_path)["iter_s"]) == [1.0, 1.5]


# ---------------------------------------------------------------- every check: PASS, MISS, empty

def _verdicts(chk):
    assert isinstance(chk, checks.CheckTable) and {"target", "verdict"} <= set(chk.columns)
    text = repr(chk)
    assert text.startswith(f"verdict: {chk.verdict}") and chk._repr_html_().startswith("<p><b>verdict:")
    return list(chk["verdict"])


def _stride_rows(tmp_path, errors, auto_s=1.0):
    for k, e in zip((1, 2, 3), errors):
        _row(tmp_path, "dos", 2.0, placement="interleaved", stride=k, step_s=1.0 + 0.1 * k,
             plan={"stride": k, "cpu_threads": 4}, ts=f"2026-12-01T10:00:0{k}+00:00")
    _row(tmp_path, "dos", 2.0, placement="interleaved", step_s=auto_s * 1.1, plan={"stride": 1, "cpu_threads": 4})
    df = results.rows(tmp_path)
    err = {1: errors[0], 2: errors[1], 3: errors[2]}
    pred = [s * (1 + err.get(k if k == k else 0, 0)) if st != "auto" else s
            for s, k, st in zip(df["step_s"], pd.to_numeric(df["stride"], errors="coerce"), df["stride"])]
    return df.assign(predicted_s=pred)


def test_stride_check_pass_miss_empty(tmp_path):
    assert _verdicts(checks.stride_check(_stride_rows(tmp_path / "a", (0.01, 0.02, 0.05)))) == ["PASS"]
    chk = checks.stride_check(_stride_rows(tmp_path / "b", (0.01, 0.02, 0.30)))  # worst error 30%
    assert _verdicts(chk) == ["MISS"] and chk.verdict == "MISS"
    with pytest.raises(ValueError, match="empty input"):
        checks.stride_check(pd.DataFrame())


def test_microbatch_check_pass_miss_empty(tmp_path):
    for mb in (1, 2):
        _row(tmp_path, "torch-gpu", 1.0 * mb, micro_batch=mb)
    _row(tmp_path, "dos", 2.2, placement="cpu", micro_batch=2)  # +10%
    _row(tmp_path, "dos", 2.6, placement="interleaved", micro_batch=2)  # +30%
    chk = checks.microbatch_check(results.rows(tmp_path)).set_index("key")
    assert _verdicts(chk) == ["PASS", "MISS"] and chk.loc["dos-cpu", "verdict"] == "PASS"
    assert chk.verdict == "MISS"
    with pytest.raises(ValueError, match="empty input"):
        checks.microbatch_check(results.rows(tmp_path / "none"))


def test_convergence_check_pass_miss_empty():
    base = [3.0 - 0.01 * i + (0.05 if i % 2 else -0.05) for i in range(60)]
    steps = pd.DataFrame({"key": ["torch-gpu"] * 60 + ["dos-cpu"] * 60 + ["dos-gpu"] * 60,
                          "step": list(range(60)) * 3,
                          "loss": base + [x * 1.0001 for x in base] + [x * 1.02 for x in base]})
    chk = checks.convergence_check(steps)
    assert chk[chk["key"].eq("dos-cpu")]["verdict"].eq("PASS").all()
    assert chk[chk["key"].eq("dos-gpu")]["verdict"].eq("MISS").all() and chk.verdict == "MISS"
    _verdicts(chk)
    assert checks.convergence_check(steps[steps["key"].ne("dos-gpu")]).verdict == "PASS"
    assert checks.convergence_check(steps[steps["key"].ne("torch-gpu")]).verdict == "MISS"  # no baseline
    with pytest.raises(ValueError, match="empty input"):
        checks.convergence_check(pd.DataFrame(columns=["key", "step", "loss"]))


def test_reference_check_pass_miss_empty(tmp_path):
    _row(tmp_path, "deepspeed-zero-offload", 1.91 * 1.05, model="1.3B")  # +5% of DESIGN.md §8
    _row(tmp_path, "deepspeed-superoffload", 3.21 * 0.6, model="1.3B")  # -40%
    chk = checks.reference_check(results.rows(tmp_path)).set_index("system")
    assert chk.loc["deepspeed-zero-offload", "verdict"] == "PASS"
    assert chk.loc["deepspeed-superoffload", "verdict"] == "MISS" and chk.verdict == "MISS"
    _verdicts(chk)
    with pytest.raises(ValueError, match="empty input"):
        checks.reference_check(results.rows(tmp_path / "none"))


def test_capped_check_pass_miss_empty(tmp_path):
    cap = {"gpu_mem_cap_gib": 40.0, "model": "7B"}
    _row(tmp_path, "deepspeed-twinflow", 6.0, ratio=0.9, ts="2026-12-01T10:00:00+00:00", **cap)
    _row(tmp_path, "dos", 2.0, placement="interleaved", gpu_fraction="auto", ts="2026-12-01T10:05:00+00:00", **cap)
    _row(tmp_path, "dos", 2.0, placement="interleaved", ts="2026-12-01T11:00:00+00:00", **cap)  # another call
    df = results.rows(tmp_path)
    assert _verdicts(checks.capped_check(df)) == ["PASS"]  # 0.33x in one call
    later = checks.capped_check(df, key="dos-interleaved")
    assert not later["same_call"].iloc[0] and _verdicts(later) == ["MISS"]  # a ratio across calls
    slow = df.assign(iter_s=df["iter_s"].where(df["system"].ne("dos"), 5.0))
    assert checks.capped_check(slow).verdict == "MISS"  # 0.83x
    none = checks.capped_check(df[df["system"].eq("dos")])
    assert none.empty and none.verdict == "MISS" and "no comparable rows" in repr(none)
    with pytest.raises(ValueError, match="empty input"):
        checks.capped_check(df.iloc[:0])


def test_check_tables_keep_their_verdict_through_round_and_concat(tmp_path):
    steps = pd.DataFrame({"key": ["torch-gpu"] * 4 + ["dos-cpu"] * 4, "step": list(range(4)) * 2,
                          "loss": [3.0, 2.9, 2.95, 2.8] * 2})
    chk = checks.convergence_check(steps)
    assert isinstance(chk.round(3), checks.CheckTable) and chk.round(3).verdict == "PASS"
    both = pd.concat([chk, chk])
    assert isinstance(both, checks.CheckTable) and both.verdict == "PASS"
    assert json.loads(both.to_json(orient="records"))[0]["verdict"] == "PASS"
