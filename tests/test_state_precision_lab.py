"""Issue 17 in the lab: RunSpec.moments, the four checks (synthetic frames, both outcomes) and
figure 13's panels. CPU only, a few seconds."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dos.lab import checks
from dos.lab.bench.models import preset
from dos.lab.bench.records import read_rows
from dos.lab.bench.spec import ConfigError, RunSpec

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- RunSpec.moments

def test_moments_field_validated_labelled_and_dos_only():
    s = RunSpec(system="dos", placement="cpu", moments="bf16")
    assert s.state_dtype() == "bf16" and "moments=bf16" in s.label()
    assert RunSpec(system="dos", placement="cpu").state_dtype() == "fp32"
    assert s.run_id() != RunSpec(system="dos", placement="cpu").run_id()
    with pytest.raises(ConfigError, match="moments must be one of"):
        RunSpec(system="dos", placement="cpu", moments="fp16")
    with pytest.raises(ConfigError, match="moments does not apply"):
        RunSpec(system="torch-gpu", moments="bf16")
    with pytest.raises(ConfigError, match="moments does not apply"):
        RunSpec(system="deepspeed-zero2-offload-bf16", moments="bf16")


def test_old_run_ids_are_unchanged_by_the_new_field():
    """A recorded row's configuration (before `moments` existed) hashes to its recorded run_id."""
    rows = [r for r in read_rows(ROOT / "experiments/results/h200-1.3b/runs.csv") if r["system"] == "dos"]
    assert rows
    for r in rows:
        run = json.loads(r["config"])["run"]
        assert "moments" not in run
        assert RunSpec.from_dict(run).run_id() == r["run_id"]


def test_preflight_counts_the_moment_format():
    from dos.lab import sweep as sw

    need = {m: sw.host_bytes_estimate(RunSpec(system="dos", placement="cpu", model="13B", moments=m))[0]
            for m in ("fp32", "bf16", "int8")}
    assert need["fp32"] > need["bf16"] > need["int8"]


def test_preflight_counts_the_gradient_ring_and_the_resident_share(monkeypatch):
    """grad_ring: 2 B per non-resident parameter fewer; gpu_fraction "auto" on an H200 (139.8 GiB):
    20.3B bf16 moments with the ring fit a 124.8 GiB host (session 17's preflight skipped it at
    150.9 GiB: 85% of the GPU, 10 GiB of activations, the ring not counted)."""
    import types
    from dos.lab import preflight as pf

    def need(**kw):
        return pf.host_bytes_estimate(RunSpec(system="dos", placement="interleaved", model="20B", **kw))[0] / 2**30

    assert need(moments="bf16") - need(moments="bf16", grad_ring=4) == pytest.approx(2.0 * 20.33e9 / 2**30, rel=0.01)
    monkeypatch.setattr(pf, "_cuda_available", lambda: True)
    import torch
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=int(139.8 * 2**30)))
    auto = need(moments="bf16", grad_ring=4, gpu_fraction="auto", device="cuda")
    assert auto < 124.8 < need(moments="bf16", grad_ring=4, device="cuda")
    share = pf._auto_resident_share(RunSpec(system="dos", placement="interleaved", model="20B", moments="int8",
                                            gpu_fraction="auto", device="cuda"), 20_330_000_000)
    assert 0.40 < share < 0.52  # the engine made 48% resident (capacity/309fc558f5ee)


# ---------------------------------------------------------------- criterion 2

def _steps(bf16_shift: float, n: int = 120, band=(0.0, 0.002, -0.002)):
    rng = np.random.default_rng(0)
    curve = 3.0 * np.exp(-np.arange(n) / 40) + 1.0 + rng.normal(0, 0.01, n)
    out = []
    for i, off in enumerate(band):
        out.append(pd.DataFrame(dict(step=np.arange(n), loss=curve + off, run_id=f"t{i}", key="torch-gpu",
                                     system="torch-gpu", state_dtype="fp32", measured=True)))
    for dt, shift in (("fp32", 0.0), ("bf16", bf16_shift), ("int8", 0.05)):
        out.append(pd.DataFrame(dict(step=np.arange(n), loss=curve * (1 + shift), run_id=f"d{dt}",
                                     key="dos-interleaved", system="dos", state_dtype=dt, measured=True)))
    out.append(pd.DataFrame(dict(step=np.arange(n), loss=curve * 1.2, run_id="ds", key="deepspeed-zero2-offload-bf16",
                                 system="deepspeed-zero2-offload-bf16", state_dtype="bf16", measured=True)))
    return pd.concat(out, ignore_index=True)


@pytest.mark.parametrize("shift, verdict", [(0.0005, "PASS"), (0.008, "PASS"), (0.03, "MISS")])
def test_state_dtype_convergence_check(shift, verdict):
    chk = checks.state_dtype_convergence_check(_steps(shift)).set_index(["key", "state_dtype"])
    bf16 = chk.loc[("dos-interleaved", "bf16")]
    assert bf16["graded"] and bf16["baseline_runs"] == 3 and bf16["verdict"] == verdict
    assert chk.verdict == verdict  # int8 (5% off: MISS) and DeepSpeed are reported, not graded
    assert chk.loc[("dos-interleaved", "int8"), "verdict"] == "MISS"
    assert not chk.loc[("dos-interleaved", "int8"), "graded"]
    assert not chk.loc[("deepspeed-zero2-offload-bf16", "bf16"), "graded"]
    assert "not graded" in chk.summary()
    with pytest.raises(ValueError):
        checks.state_dtype_convergence_check(pd.DataFrame())


def test_state_dtype_convergence_check_holds_a_shorter_run_to_its_own_window():
    """DeepSpeed's run, cut to 80 of the others' 120 steps, on the same curve: inside the band over
    steps 30-79 (the band's own runs there), though its last-50 mean is far above theirs at 70-119."""
    s = _steps(0.0)
    s = s[~(s["run_id"].eq("ds") & (s["step"] >= 80))].copy()
    s.loc[s["run_id"].eq("ds"), "loss"] = s.loc[s["run_id"].eq("t0") & (s["step"] < 80), "loss"].to_numpy()
    s["batch_id"] = np.where(s["run_id"].eq("ds"), "b2", "b1")
    chk = checks.state_dtype_convergence_check(s).set_index(["key", "state_dtype"])
    ds = chk.loc[("deepspeed-zero2-offload-bf16", "bf16")]
    assert ds["last_steps"] == "30-79" and ds["in_band"] and ds["verdict"] == "PASS"
    assert ds["batches"] == "b1, b2" and chk.loc[("dos-interleaved", "bf16"), "batches"] == "b1"
    assert chk.loc[("dos-interleaved", "bf16"), "last_steps"] == "70-119"
    full = checks.final_losses(s)
    late = full[full["key"].eq("torch-gpu")]["final_mean"]
    assert full[full["run_id"].eq("ds")]["final_mean"].iloc[0] > late.max()  # the window matters


# ---------------------------------------------------------------- criterion 3

def _speed(bf16_step: float, ds_iter: float = 2.0, batch="b1", runs=3):
    out = []
    for rep in range(runs):
        j = 1 + 0.01 * rep
        for key in ("dos-cpu", "dos-auto"):
            for dt, step in (("fp32", 1.0), ("bf16", bf16_step), ("int8", 0.6)):
                out.append(dict(key=key, state_dtype=dt, step_s=step * j, iter_s=(0.4 + step) * j))
        out.append(dict(key="deepspeed-zero2-offload-bf16", state_dtype="bf16", step_s=1.0, iter_s=ds_iter * j))
        out.append(dict(key="torchao-cpu-offload", state_dtype="bf16", step_s=2.0, iter_s=3.0 * j))
    return pd.DataFrame(out).assign(status="ok", batch_id=batch, model="3B")


@pytest.mark.parametrize("bf16_step, ds_iter, verdict", [(0.7, 2.0, "PASS"), (0.8, 2.0, "MISS"), (0.7, 1.0, "MISS")])
def test_state_dtype_speed_check(bf16_step, ds_iter, verdict):
    chk = checks.state_dtype_speed_check(_speed(bf16_step, ds_iter))
    assert chk.verdict == verdict
    upd = chk[chk["metric"].eq("step_s") & chk["state_dtype"].eq("bf16")]
    assert upd["value"].tolist() == pytest.approx([1 / bf16_step] * 2)
    assert (upd["runs"] == 3).all() and (upd["range_s"] != "").all()
    assert not chk[chk["state_dtype"].eq("int8")]["graded"].any()
    # ratios only within one batch: fp32 and bf16 in different batches are not compared
    d = _speed(0.7)
    split = d.assign(batch_id=np.where(d["state_dtype"].eq("fp32"), "b0", "b1"))
    assert checks.state_dtype_speed_check(split)["metric"].eq("iter_s").all()
    # fewer than 3 runs: no PASS
    assert checks.state_dtype_speed_check(_speed(0.5, runs=2)).verdict == "MISS"
    with pytest.raises(ValueError):
        checks.state_dtype_speed_check(pd.DataFrame())


def test_state_dtype_speed_check_grades_bf16_split_where_a_batch_has_it():
    """bf16 moments in two formats: a batch with bf16-split rows grades them (bf16 reported)."""
    d = _speed(0.8)  # bf16 1.25x: a MISS alone
    extra = d[d["state_dtype"].eq("bf16")].assign(state_dtype="bf16-split", step_s=lambda x: x["step_s"] * 0.85,
                                                   iter_s=lambda x: x["iter_s"] * 0.9)
    chk = checks.state_dtype_speed_check(pd.concat([d, extra], ignore_index=True))
    upd = chk[chk["metric"].eq("step_s")].set_index(["key", "state_dtype"])
    assert upd.loc[("dos-cpu", "bf16-split"), "graded"] and not upd.loc[("dos-cpu", "bf16"), "graded"]
    assert upd.loc[("dos-cpu", "bf16-split"), "value"] == pytest.approx(1 / 0.68)
    assert upd.loc[("dos-cpu", "bf16"), "verdict"] == "MISS" and chk.verdict == "PASS"
    assert set(chk[chk["metric"].eq("iter_s")]["state_dtype"]) == {"bf16-split"}
    assert checks.state_dtype_speed_check(d).verdict == "MISS"  # without it: bf16 graded


def test_state_dtype_speed_criterion_grades_each_models_latest_complete_batch():
    """Criterion 3 as one verdict: per model the latest batch with every part (>= 3 runs each) is
    graded; an older complete batch is superseded, a later incomplete one reported beside it."""
    old = _speed(0.8, batch="b1").assign(timestamp="2026-12-01T10:00:00")            # complete, 1.25x MISS
    new = _speed(0.7, batch="b2").assign(timestamp="2026-12-02T10:00:00")            # complete, PASS
    part = _speed(0.9, batch="b3").assign(timestamp="2026-12-03T10:00:00")
    part = part[~part["key"].eq("torchao-cpu-offload")]                              # incomplete, later
    five = pd.concat([_speed(0.7, batch=f"c{i}", runs=r).assign(model="5B", timestamp=f"2026-12-0{i}T10")
                      for i, r in ((1, 3), (2, 2))], ignore_index=True)              # latest has 2 runs
    chk = checks.state_dtype_speed_criterion(pd.concat([old, new, part, five], ignore_index=True))
    graded = chk.graded
    assert set(graded[graded["model"].eq("3B")]["batch_id"]) == {"b2"}
    assert set(graded[graded["model"].eq("5B")]["batch_id"]) == {"c1"}
    assert chk.verdict == "PASS", chk.summary()
    role = chk.drop_duplicates("batch_id").set_index("batch_id")["role"]
    assert role["b1"].startswith("reported: superseded by the later complete batch b2")
    assert "incomplete" in role["b3"] and "torchao-cpu-offload" in role["b3"]
    assert "incomplete" in role["c2"]
    # the old complete batch alone: graded, and its miss is the verdict
    assert checks.state_dtype_speed_criterion(pd.concat([old, part], ignore_index=True),
                                              models=("3B",)).verdict == "MISS"
    # a model without a complete batch: a graded MISS row saying so
    lone = checks.state_dtype_speed_criterion(pd.concat([new, five[five["batch_id"].eq("c2")]], ignore_index=True))
    miss = lone[lone["model"].eq("5B") & lone["graded"]]
    assert len(miss) == 1 and miss["role"].iloc[0] == "graded: no complete batch" and lone.verdict == "MISS"
    with pytest.raises(ValueError):
        checks.state_dtype_speed_criterion(pd.DataFrame())


# ---------------------------------------------------------------- criterion 4

def _capacity(int8_status="ok", bf16_status="oom", fp32_steps=20):
    base = dict(system="dos", key="dos-auto", loss_last=5.0, iter_s=3.0, peak_gpu_gib=120.0, peak_host_gib=100.0,
                host_bytes_per_param=5.0, gpu_fraction=0.4, error="")
    rows = [dict(base, model="13B", state_dtype="fp32", status="ok", steps=fp32_steps, run_id="a"),
            dict(base, model="20B", state_dtype="bf16", status=bf16_status, steps=20, run_id="b",
                 loss_last=np.nan if bf16_status != "ok" else 5.0, error="OutOfMemoryError: CUDA out of memory"),
            dict(base, model="20B", state_dtype="int8", status=int8_status, steps=20, run_id="c"),
            dict(base, system="deepspeed-zero2-offload", key="deepspeed-zero2-offload", model="13B", state_dtype="fp32",
                 status="skipped", steps=20, run_id="d", loss_last=np.nan,
                 error="host memory preflight: needs ~270.7 GiB (22 B/param x 13.02B params + 4.0 GiB base)")]
    return pd.DataFrame(rows).assign(timestamp=[f"2026-12-0{i + 1}" for i in range(len(rows))])


def test_capacity_check():
    chk = checks.capacity_check(_capacity())
    assert chk.verdict == "PASS"  # 20B: int8 ran, bf16's OOM reported beside it
    r = chk.set_index(["model", "system", "state_dtype"])
    assert not r.loc[("20B", "dos", "bf16"), "graded"] and r.loc[("20B", "dos", "bf16"), "verdict"] == "MISS"
    assert r.loc[("13B", "deepspeed-zero2-offload", "fp32"), "host_need_gib"] == pytest.approx(270.7)
    assert not r.loc[("13B", "deepspeed-zero2-offload", "fp32"), "graded"]
    assert checks.capacity_check(_capacity(int8_status="oom")).verdict == "MISS"  # neither 20B format
    # skipped for want of the package: the need is the preflight's estimate from the recorded spec
    spec = RunSpec(system="deepspeed-zero2-offload-bf16", model="13B", device="cuda")
    ds = dict(_capacity().iloc[3], system=spec.system, key=spec.system, state_dtype="bf16", run_id="e",
              error="deepspeed is not installed", config=json.dumps({"run": spec.to_dict()}))
    r = checks.capacity_check(pd.concat([_capacity(), pd.DataFrame([ds])], ignore_index=True))
    r = r.set_index(["model", "system", "state_dtype"]).loc[("13B", spec.system, "bf16")]
    n = preset("13B").n_params()
    assert r["host_need_gib"] == pytest.approx((12.0 * n) / 2**30 + 4.0)
    assert "not installed; preflight estimate: 12 B/param" in r["why"]
    assert checks.capacity_check(_capacity(fp32_steps=10)).verdict == "MISS"  # too few steps
    with pytest.raises(ValueError):
        checks.capacity_check(pd.DataFrame())


# ---------------------------------------------------------------- criterion 5

def _bytes(bf16: float, int8: float):
    return pd.DataFrame([
        dict(system="dos", model="3B", state_dtype="fp32", host_bytes_per_param=14.0, resident_fraction=0.0),
        dict(system="dos", model="3B", state_dtype="bf16", host_bytes_per_param=bf16, resident_fraction=0.0),
        dict(system="dos", model="3B", state_dtype="int8", host_bytes_per_param=int8 / 2, resident_fraction=0.5),
        dict(system="dos", model="3B", state_dtype="bf16", host_bytes_per_param=0.0, resident_fraction=1.0),
    ]).assign(status="ok", key="dos-cpu", run_id=list("abcd"))


def test_host_bytes_check_reports_int8_scales_honestly():
    chk = checks.host_bytes_check(_bytes(10.0, 8.0039)).set_index("state_dtype")
    assert chk.loc["bf16", "verdict"] == "PASS" and chk.loc["int8", "verdict"] == "MISS"
    assert chk.loc["int8", "per_nonresident_param"] == pytest.approx(8.0039)  # per non-resident parameter
    assert "8/2048" in chk.loc["int8", "reason"] and not chk.loc["fp32", "graded"]
    assert chk.verdict == "MISS"
    ok = checks.host_bytes_check(_bytes(9.5, 7.9), targets={"bf16": 10.0, "int8": 8.0})
    assert ok.verdict == "PASS"
    padded = checks.host_bytes_check(_bytes(10.00002, 7.9)).set_index("state_dtype")
    assert padded.loc["bf16", "verdict"] == "MISS" and "padding" in padded.loc["bf16", "reason"]
    with pytest.raises(ValueError):
        checks.host_bytes_check(pd.DataFrame())


def test_host_bytes_check_grades_the_best_configuration_gradient_ring_included():
    """grad_ring rows are a configuration of their own: int8 with a ring (6.01 B) is graded and
    passes, the per-subgroup-slot rows (8.0039) are reported beside it; a ring that misses is a MISS."""
    ring = pd.DataFrame([dict(system="dos", model="3B", state_dtype="int8", host_bytes_per_param=6.01,
                              resident_fraction=0.0, spec_grad_ring=4, status="ok", key="dos-cpu", run_id="e")])
    chk = checks.host_bytes_check(pd.concat([_bytes(10.0, 8.0039), ring], ignore_index=True))
    by = chk.set_index(["state_dtype", "grad_ring"])
    assert by.loc[("int8", 4), "graded"] and by.loc[("int8", 4), "verdict"] == "PASS"
    assert not by.loc[("int8", 0), "graded"] and by.loc[("int8", 0), "verdict"] == "MISS"
    assert by.loc[("int8", 4), "nominal"] == pytest.approx(6.0 + 8 / 2048)
    assert chk.verdict == "PASS"
    bad = ring.assign(host_bytes_per_param=8.5)
    chk = checks.host_bytes_check(pd.concat([_bytes(10.0, 8.0039), bad], ignore_index=True))
    assert chk.verdict == "MISS"  # the best int8 configuration (8.0039, no ring) still misses


def test_host_bytes_check_grades_a_configuration_over_every_model_it_ran():
    """The H200 records: int8 without the ring at 1.3B and 3B (8.0039), with it at 20B only (6.04).
    The ring configuration is graded (its bytes are the format's, not the model's) and passes; a
    ring row that misses at any one model makes the configuration's worst row a miss, and the
    no-ring rows (the next best) are then graded."""
    def row(model, ring, b, rid):
        return dict(system="dos", model=model, state_dtype="int8", host_bytes_per_param=b, resident_fraction=0.0,
                    spec_grad_ring=ring, status="ok", key="dos", run_id=rid)
    plain = [row("1.3B", None, 8.0040, "a"), row("3B", None, 8.0039, "b")]
    chk = checks.host_bytes_check(pd.DataFrame(plain + [row("20B", 4, 6.04, "c")]))
    by = chk.set_index(["model", "grad_ring"])
    assert by.loc[("20B", 4), "graded"] and not by.loc[("3B", 0), "graded"] and not by.loc[("1.3B", 0), "graded"]
    assert chk.verdict == "PASS"
    chk = checks.host_bytes_check(pd.DataFrame(plain + [row("20B", 4, 6.04, "c"), row("3B", 4, 8.2, "d")]))
    by = chk.set_index(["model", "grad_ring"])
    assert by.loc[("3B", 0), "graded"] and by.loc[("1.3B", 0), "graded"] and not by.loc[("20B", 4), "graded"]
    assert chk.verdict == "MISS"


# ---------------------------------------------------------------- figure 13

def test_state_precision_figure_with_and_without_rows(tmp_path):
    pytest.importorskip("seaborn")
    from dos.lab import plots, results

    empty = results.rows([tmp_path / "none"])
    fig = plots.state_precision(pd.DataFrame(), empty, empty, empty)
    assert sum("no records yet" in t.get_text() for ax in fig.axes for t in ax.texts) == 3
    steps = _steps(0.001)
    where = dict(results_dir=str(tmp_path), gpu_name="NVIDIA H200", date="2026-12-05", smoke=False)
    speed = _speed(0.7).assign(n_params=3e9, **where)
    mem = _bytes(10.0, 8.0039).assign(n_params=3e9, **where)
    rows = pd.DataFrame([dict(model="1.3B", **where)])
    fig = plots.state_precision(steps, rows, speed, mem)
    assert len(fig.axes[0].lines) == 4 and len(fig.axes[2].patches) == 3
    plots.save(fig, tmp_path, "f")
    assert all((tmp_path / f"f.{e}").stat().st_size > 1000 for e in ("png", "svg"))
