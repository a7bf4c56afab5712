"""Sweeps end to end on the CPU: the smoke sweep, kill-and-resume, and clear errors."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from dos.lab import child
from dos.lab import sweep as sw
from dos.lab.bench import records
from dos.lab.bench.spec import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "experiments", "sweeps", "smoke.yaml")
QUICK = {"model": "tiny", "device": "cpu", "seq_len": 32, "micro_batch": 2, "warmup": 1, "steps": 2,
         "nvml_hz": 20}


def _sweep(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dos", "sweep", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=kw.pop("timeout", 1500), **kw)


def _write(tmp_path, text, name="s.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- the smoke sweep

@pytest.mark.slow
def test_smoke_sweep_yields_valid_rows(tmp_path):
    out, pack = tmp_path / "smoke", tmp_path / "smoke.tar.gz"
    r = _sweep(SMOKE, "--out", str(out), "--pack", str(pack))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = records.read_rows(out / "runs.csv")
    expected = sw.load(SMOKE).runs
    assert [row["run_id"] for row in rows] == [s.run_id() for s in expected]
    for row in rows:
        assert row["status"] == "ok", (row["system"], row["placement"], row["error"])
        assert float(row["iter_s"]) > 0 and float(row["tokens_per_s"]) > 0
        assert abs(float(row["fwd_s"]) + float(row["bwd_s"]) + float(row["step_s"])
                   - float(row["iter_s"])) < 0.5 * float(row["iter_s"])
        assert float(row["peak_host_gib"]) > 0 and int(row["n_params"]) == 133440
        assert row["nvml"].startswith("absent") and row["device"] == "cpu"
        for key in ("steps_file", "markers_file", "samples_file", "log_file"):
            assert (out / row[key]).exists(), key
    by = {(row["system"], row["placement"]): row for row in rows}
    ds = by[("deepspeed-zero-offload", "")]
    assert ds["cpu_impl"] == "DeepSpeedCPUAdam" and ds["ratio"] == "1.0"
    # DeepSpeed's runs fork from the server that imported DeepSpeed too (dos.lab.zygote.FLAVOURS)
    started = {k: json.loads((out / r["log_file"]).with_name("result.json").read_text())["started_by"]
               for k, r in by.items()}
    assert started[("deepspeed-zero-offload", "")] == "fork:deepspeed", started
    assert started[("dos", "cpu")] == "fork", started
    assert '"offload_optimizer"' in ds["config"]
    for placement in ("cpu", "static", "interleaved", "gpu"):
        assert f'"placement":"{placement}"' in by[("dos", placement)]["plan"]
    # the traces are stored compressed (the bulk of the records: the device's 64 MiB transfer)
    assert all(by[k]["samples_file"].endswith("samples.csv.gz") for k in by)
    lanes = json.loads(records.read_text(out / by[("dos", "interleaved")]["lanes_file"]))
    assert len(lanes) == 3 and all(x["events"] and x["step_phase_start_s"] > 0 for x in lanes)
    assert {e["lane"] for x in lanes for e in x["events"]} >= {"cpu"}
    result = json.loads((out / by[("dos", "cpu")]["log_file"]).with_name("result.json").read_text())
    pages = result["host_pages"]
    assert set(pages) == {"after_init", "after_steps"} and pages["after_steps"]["rss_gib"] > 0
    # where the system's init went: the engine's constructor among the slowest calls, in seconds
    assert any("engine.py" in k and "__init__" in k for k in result["init_profile"])
    assert all(v >= 0 for v in result["init_profile"].values())
    assert result["gc_frozen_objects"] > 10000  # imports and init: out of the measured steps' GC
    log = (out / by[("dos", "cpu")]["log_file"]).read_text()  # where a run killed in flight was
    assert "] init_system" in log and "] step 0" in log
    assert (out / "env.json").exists()
    with tarfile.open(pack) as tar:
        names = tar.getnames()
    assert "smoke/runs.csv" in names and "smoke/env.json" in names
    # A second invocation finds everything done and appends nothing.
    r = _sweep(SMOKE, "--out", str(out), "--no-progress")
    assert r.returncode == 0 and len(records.read_rows(out / "runs.csv")) == len(rows)


# ---------------------------------------------------------------- kill and resume

def _children_of_dir(path: str):
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(path in part for part in (p.info["cmdline"] or [])):
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_sweep_resumes_without_lost_or_duplicated_rows(tmp_path, sig):
    runs = "\n".join(f"  - {{system: torch-cpu, seed: {i}}}" for i in range(4))
    text = "name: killme\ndefaults: " + str(QUICK).replace("'", "") + "\nruns:\n" + runs + "\n"
    path, out = _write(tmp_path, text), tmp_path / "out"
    expected = [s.run_id() for s in sw.load(path).runs]
    proc = subprocess.Popen([sys.executable, "-m", "dos", "sweep", path, "--out", str(out), "--no-progress"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:  # one row written and the next run in flight
        done = records.read_rows(out / "runs.csv")
        if len(done) == 4 or done and (out / expected[len(done)] / "spec.json").exists():
            break
        time.sleep(0.05)
    proc.send_signal(sig)
    rc = proc.wait()
    before = records.read_rows(out / "runs.csv")
    assert 1 <= len(before) < 4, "the sweep should have been killed mid-way"
    if sig == signal.SIGTERM:  # the sweep killed the run in flight (its process group) and exited
        assert rc == 128 + signal.SIGTERM and not _children_of_dir(str(out))
    for _ in range(100):  # the in-flight run dies with its parent (PR_SET_PDEATHSIG)
        if not _children_of_dir(str(out)):
            break
        time.sleep(0.1)
    assert not _children_of_dir(str(out))
    r = _sweep(path, "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    after = records.read_rows(out / "runs.csv")
    assert [row["run_id"] for row in after] == expected  # none lost, none duplicated, in order
    assert after[: len(before)] == before  # old rows untouched
    assert all(row["status"] == "ok" for row in after)
    assert "already 4" in _sweep(path, "--out", str(out), "--no-progress").stdout


def test_kill_group_waits_for_every_process_of_the_run():
    """A run's grandchildren (e.g. DeepSpeed's workers) do not die with it by themselves: the group
    is killed, and _kill_group returns only once none of them is alive (their memory is free)."""
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    for _ in range(100):
        if len([p for p in psutil.Process(proc.pid).children(recursive=True)]) == 2:
            break
        time.sleep(0.02)
    grandchildren = psutil.Process(proc.pid).children(recursive=True)
    assert len(grandchildren) == 2
    child._kill_group(proc)
    assert not child._group_alive(proc.pid)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in grandchildren)


def test_preflight_waits_while_host_memory_is_being_released(monkeypatch):
    import dos.lab.preflight as pf

    spec = sw.parse({"runs": [{"system": "dos", "placement": "cpu", "model": "1.3B"}]}, "w").runs[0]
    need = sw.host_bytes_estimate(spec)[0] / 2**30
    sweep = sw.parse({"runs": [{"system": "torch-cpu"}]}, "w")
    monkeypatch.setattr(pf, "SETTLE_POLL_S", 0.0)
    monkeypatch.delenv("DOS_HOST_MEMORY_GIB", raising=False)

    def reads(values, src="available host memory"):
        it = iter(values)
        seen = []
        monkeypatch.setattr(pf, "available_host_gib", lambda *_: (seen.append(1) or next(it), src))
        return seen

    seen = reads([0.5 * need, 0.8 * need, 1.1 * need])  # a dying run releasing its memory
    assert sw.settled_preflight(spec, sweep) is None and len(seen) == 3
    seen = reads([0.5 * need, 0.5 * need + 0.1, need * 2])  # settled too low: skipped, no long wait
    assert sw.settled_preflight(spec, sweep).startswith("host memory preflight") and len(seen) == 2
    seen = reads([0.5 * need] * 2, src="host_memory_gib in the sweep file")  # a stated size: no wait
    assert "host_memory_gib in the sweep file" in sw.settled_preflight(spec, sweep) and len(seen) == 1
    monkeypatch.setattr(pf, "SETTLE_MAX_S", 0.0)  # the wait is bounded
    seen = reads([0.5 * need, 0.8 * need])
    assert sw.settled_preflight(spec, sweep) and len(seen) == 1


@pytest.mark.slow
def test_skipped_runs_are_checked_again_on_resume(tmp_path):
    """A run skipped for want of host memory runs when resumed where it fits (its ok row then
    supersedes the skipped one); resumed where it still does not fit, no second row is added."""
    sweep = sw.parse({"defaults": QUICK, "host_memory_gib": 0.01, "runs": [{"system": "torch-cpu"}]}, "r")
    assert sw.run(sweep, tmp_path, progress=False) == {"already": 0, "skipped": 1}
    assert sw.run(sweep, tmp_path, progress=False) == {"already": 0, "skipped": 1}
    assert [r["status"] for r in records.read_rows(tmp_path / "runs.csv")] == ["skipped"]
    assert sw.run(sweep, tmp_path, progress=False, host_memory_gib=64) == {"already": 0, "ok": 1}
    assert sw.run(sweep, tmp_path, progress=False) == {"already": 1}
    assert [r["status"] for r in records.read_rows(tmp_path / "runs.csv")] == ["skipped", "ok"]
    from dos.lab import results

    assert list(results.rows([tmp_path], status=("ok", "skipped"))["status"]) == ["ok"]


# ---------------------------------------------------------------- clear errors

@pytest.mark.parametrize("text,match", [
    ("runs: [ {system: dos", "not valid YAML"),
    ("- just\n- a list\n", "a sweep is a mapping"),
    ("name: x\n", "'runs' must be a non-empty list"),
    ("runs: [{system: dos, placement: cpu}]\nrepeats: 3\n", "unknown top-level key(s) ['repeats']"),
    ("runs: [{system: dos, placement: cpu}]\ndefaults: [1]\n", "'defaults' must be a mapping"),
    ("runs: [{placement: cpu}]\n", "a run needs a 'system'"),
    ("runs: [{system: dos, placement: []}]\n", "an empty list expands to no run"),
])
def test_malformed_sweep_file(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=match.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        sw.load(path)


def test_malformed_sweep_file_cli(tmp_path):
    r = _sweep(_write(tmp_path, "runs: [ {system: dos"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not valid YAML" in r.stderr and "Traceback" not in r.stderr
    r = _sweep(str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and "no such sweep file" in r.stderr
    assert not (tmp_path / "o").exists()


def test_unknown_system(tmp_path):
    path = _write(tmp_path, "runs:\n  - {system: dos, placement: cpu}\n  - {system: zero-infinity}\n")
    r = _sweep(path, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "runs[1] (system=zero-infinity): unknown system 'zero-infinity'; known systems:" in r.stderr
    assert not (tmp_path / "o").exists()  # nothing ran


def test_impossible_configuration(tmp_path):
    path = _write(tmp_path, "runs:\n  - {system: dos, placement: [cpu, static], stride: 2}\n")
    r = _sweep(path, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "impossible configuration: stride applies to placement 'interleaved' only, not 'cpu'" in r.stderr
    path = _write(tmp_path, "defaults: {device: cpu}\nruns: [{system: deepspeed-superoffload}]\n")
    r = _sweep(path)
    assert r.returncode == 2 and "deepspeed-superoffload needs a CUDA GPU but device is 'cpu'" in r.stderr


def test_grid_expansion_dedup_and_where(tmp_path):
    path = _write(tmp_path, "defaults: {model: 1.3B}\ngrid: {micro_batch: [1, 2]}\nruns:\n"
                            "  - {system: dos, placement: interleaved, stride: [1, 2]}\n"
                            "  - {system: dos, placement: interleaved, stride: 1, micro_batch: 4}\n"
                            "  - {system: dos, placement: interleaved, stride: 1, micro_batch: 4}\n")
    runs = sw.load(path).runs
    assert [(s.micro_batch, s.stride) for s in runs] == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]
    assert [s.stride for s in sw.select(runs, {"micro_batch": 2})] == [1, 2]
    assert len(sw.select(runs, {"micro_batch": [1, "4"], "stride": 1})) == 2
    with pytest.raises(ConfigError, match="selects no run"):
        sw.select(runs, {"model": "3B"})


# ---------------------------------------------------------------- rows without a clean run

def test_preflight_skips_what_cannot_fit_and_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("DOS_HOST_MEMORY_GIB", raising=False)
    sweep = sw.parse({"defaults": {"device": "cpu"}, "host_memory_gib": 16,
                      "runs": [{"system": "dos", "placement": "cpu", "model": "30B"},
                               {"system": "torchao-cpu-offload", "device": "auto"},
                               {"system": "torch-gpu", "device": "cuda"}]}, "pre")
    counts = sw.run(sweep, tmp_path, progress=False)
    rows = records.read_rows(tmp_path / "runs.csv")
    assert counts["skipped"] == 3 and [r["status"] for r in rows] == ["skipped"] * 3
    assert rows[0]["error"].startswith("host memory preflight: needs ~")
    assert "16.0 GiB (host_memory_gib in the sweep file)" in rows[0]["error"]
    if not __import__("dos.lab.preflight").lab.preflight._cuda_available():
        assert "no CUDA device" in rows[1]["error"] and "no CUDA device" in rows[2]["error"]
    assert int(rows[0]["n_params"]) > 30e9 and not list(tmp_path.glob("*/log.txt"))
    # the env var overrides the file; the CLI flag overrides both
    monkeypatch.setenv("DOS_HOST_MEMORY_GIB", "4096")
    assert sw.available_host_gib(sweep) == (4096.0, "DOS_HOST_MEMORY_GIB")
    assert sw.available_host_gib(sweep, 8)[0] == 8.0
    assert sw.preflight(sweep.runs[0], 4096.0, "test") is None


@pytest.mark.slow
def test_timeout_and_crash_become_rows(tmp_path):
    # 5000 steps: far beyond 0.5 s, also when the run is a fork that imported nothing (dos.lab.zygote)
    sweep = sw.parse({"defaults": {**QUICK, "steps": 5000}, "timeout_s": 0.5, "runs": [{"system": "torch-cpu"}]}, "t")
    sw.run(sweep, tmp_path, progress=False)
    (row,) = records.read_rows(tmp_path / "runs.csv")
    assert row["status"] == "error" and row["error"].startswith("timeout")
    # a model the attention cannot reshape (hidden 64 over 3 heads) fails inside the child
    sweep = sw.parse({"defaults": QUICK, "runs": [{"system": "torch-cpu", "model_overrides": {"heads": 3}}]},
                     "t")
    sw.run(sweep, tmp_path, progress=False)
    row = records.read_rows(tmp_path / "runs.csv")[-1]
    assert row["status"] == "error" and row["error"] and row["iter_s"] == ""
    assert (tmp_path / row["log_file"]).exists() and (tmp_path / row["markers_file"]).exists()


def test_a_superseding_sweep_re_measures_once_not_at_every_resume(tmp_path):
    """supersedes: the named runs run again even where a row is there — once: a resumed sweep finds
    their last row naming them and leaves them (a perpetual re-run would add rows each call)."""
    doc = {"defaults": {"device": "cpu", "seq_len": 16, "micro_batch": 1, "warmup": 0, "steps": 1,
                        "nvml_hz": 5}, "runs": [{"system": "torch-cpu"}]}
    first = sw.parse(doc, "sup")
    sw.run(first, tmp_path, progress=False, allow_dirty=True)
    rid = first.runs[0].run_id()
    first_steps = (tmp_path / rid / "steps.csv").read_bytes()
    again = sw.parse(dict(doc, supersedes=[rid], supersede_reason="re-measured after a fix"), "sup")
    assert sw.run(again, tmp_path, progress=False, allow_dirty=True).get("ok") == 1
    assert sw.run(again, tmp_path, progress=False, allow_dirty=True) == {"already": 1}
    rows = records.read_rows(tmp_path / "runs.csv")
    assert len(rows) == 2 and rows[1]["supersedes"] == rid and not rows[0]["supersedes"]
    # each row names its own files: the superseded row's stay as they were (append-only, files too)
    assert rows[0]["steps_file"] == f"{rid}/steps.csv" and rows[1]["steps_file"] == f"{rid}.1/steps.csv"
    assert (tmp_path / rows[0]["steps_file"]).read_bytes() == first_steps
    assert (tmp_path / rows[1]["log_file"]).exists()


def test_dry_run_lists_the_runs_with_what_each_is_expected_to_take(tmp_path, capsys, monkeypatch):
    """`dos sweep --dry-run`: each missing run, its preflight decision and its expected seconds
    from the recorded walls (what a device lease must hold), then the total; nothing runs."""
    monkeypatch.setattr(sw, "RESULTS", tmp_path / "no-repository-records")
    doc = {"defaults": {"device": "cpu", "seq_len": 16, "micro_batch": 1, "warmup": 0, "steps": 1,
                        "nvml_hz": 5}, "runs": [{"system": "torch-cpu", "seed": [0, 1]}]}
    sweep = sw.parse(doc, "dry")
    tmp_path = tmp_path / "dry"
    assert sw.run(sweep, tmp_path, dry_run=True) == {"already": 0}
    out = capsys.readouterr().out
    assert "(no record of this system or shape)" in out and "expected: ~0.0 min for 2 runs" in out
    assert not (tmp_path / "runs.csv").exists()
    sw.run(sw.parse(dict(doc, runs=[{"system": "torch-cpu", "seed": 0}]), "dry"), tmp_path, progress=False,
           allow_dirty=True)
    wall = float(records.read_rows(tmp_path / "runs.csv")[0]["wall_s"])
    assert sw.run(sweep, tmp_path, dry_run=True) == {"already": 1}
    out = capsys.readouterr().out
    assert f"run  ~{wall + sw.RUN_OVERHEAD_S:.0f} s" in out
    assert f"expected: ~{(wall + sw.RUN_OVERHEAD_S) / 60:.1f} min for 1 runs" in out


def test_a_killed_runs_log_is_kept_when_its_folder_is_cleared(tmp_path):
    """A run killed in flight leaves a folder without a row; the resumed sweep starts it afresh,
    and keeps its log (the only trace of why it wrote no row) under killed/."""
    doc = {"defaults": {"device": "cpu", "seq_len": 16, "micro_batch": 1, "warmup": 0, "steps": 1,
                        "nvml_hz": 5}, "runs": [{"system": "torch-cpu"}]}
    sweep = sw.parse(doc, "killed")
    rid = sweep.runs[0].run_id()
    (tmp_path / rid).mkdir()
    (tmp_path / rid / "log.txt").write_text("stuck in step 0\n")
    assert sw.run(sweep, tmp_path, progress=False, allow_dirty=True).get("ok") == 1
    (kept,) = (tmp_path / "killed").iterdir()
    assert kept.name.startswith(rid + "-") and kept.read_text() == "stuck in step 0\n"
    assert "stuck" not in (tmp_path / rid / "log.txt").read_text()


def test_a_sweep_with_a_deadline_starts_no_run_it_expects_to_end_later(tmp_path, monkeypatch):
    """--stop-by-s (a device call's time left): a run whose configuration took longer than what
    is left, by the rows recorded, is deferred to the next call instead of being killed in flight;
    a configuration never recorded runs while a second is left (nothing to expect)."""
    doc = {"defaults": {"device": "cpu", "seq_len": 16, "micro_batch": 1, "warmup": 0, "steps": 1,
                        "nvml_hz": 5}, "runs": [{"system": "torch-cpu", "seed": 0}]}
    first = sw.parse(doc, "deadline")
    assert sw.run(first, tmp_path, progress=False, allow_dirty=True, stop_by_s=0.5) == {"already": 0, "deferred": 1}
    assert sw.run(first, tmp_path, progress=False, allow_dirty=True, stop_by_s=600).get("ok") == 1
    rows = records.read_rows(tmp_path / "runs.csv")
    more = sw.parse(dict(doc, runs=[{"system": "torch-cpu", "seed": [0, 1, 2]}]), "deadline")
    assert sw.expected_s(more.runs[1], rows) == pytest.approx(float(rows[0]["wall_s"]) + sw.RUN_OVERHEAD_S)
    counts = sw.run(more, tmp_path, progress=False, allow_dirty=True, stop_by_s=1.0)
    assert counts == {"already": 1, "deferred": 2}
    assert len(records.read_rows(tmp_path / "runs.csv")) == 1
    assert sw.run(more, tmp_path, progress=False, allow_dirty=True, stop_by_s=600).get("ok") == 2
    # a sweep's first round has no rows of its own: other sweeps' records of the system at that
    # model, else the longest run of any system there (deferred rather than killed in flight)
    rows = records.read_rows(tmp_path / "runs.csv")
    other = sw.parse(dict(doc, runs=[{"system": "torch-cpu", "seed": 7}, {"system": "dos", "placement": "cpu"}]), "o")
    walls = [float(r["wall_s"]) for r in rows]
    assert sw.expected_s(other.runs[0], [], rows) == pytest.approx(sorted(walls)[1] + sw.RUN_OVERHEAD_S)
    assert sw.expected_s(other.runs[1], [], rows) == pytest.approx(max(walls) + sw.RUN_OVERHEAD_S)
    assert sw.expected_s(other.runs[1], [], []) == 0.0
    # a model never recorded: the same system's run at the nearest size, scaled by parameter count
    from dos.lab.bench.models import preset

    bigger = sw.parse(dict(doc, runs=[{"system": "torch-cpu", "seed": 7, "model": "1.3B"},
                                      {"system": "dos", "placement": "cpu", "model": "1.3B"}]), "big")
    ratio = preset("1.3B").n_params() / float(rows[0]["n_params"])
    assert ratio > 1000 and {r["model"] for r in rows} == {"tiny"} and {r["system"] for r in rows} == {"torch-cpu"}
    assert sw.expected_s(bigger.runs[0], [], rows) == pytest.approx(
        sorted(walls)[1] * ratio + sw.RUN_OVERHEAD_S)
    # rows of another step count stand for this one's: init plus the rest per step
    long = [dict(r, steps=str(int(r["steps"]) * 10)) for r in rows]
    init = [float(r["init_s"]) for r in rows]
    per = sorted(i + (w - i) * (int(rows[0]["warmup"]) + int(rows[0]["steps"]))
                 / (int(long[0]["warmup"]) + int(long[0]["steps"])) for i, w in zip(init, walls))
    assert sw.expected_s(other.runs[0], [], long) == pytest.approx(per[1] + sw.RUN_OVERHEAD_S)
    assert sw.expected_s(bigger.runs[1], [], rows) == 0.0  # dos never recorded anywhere
    for name in ("a", "b"):  # two sweeps' results side by side
        (tmp_path / name).mkdir()
        shutil.copy(tmp_path / "runs.csv", tmp_path / name / "runs.csv")
    monkeypatch.setattr(sw, "RESULTS", tmp_path / "no-repository-records")
    assert len(sw.other_rows(tmp_path / "b")) == len(rows)  # a's rows, not b's own


def test_every_sweep_file_loads_and_is_named_after_itself():
    """A sweep file is read on a GPU machine whose time is scarce: a typo found there costs a
    device call. Every file here parses, expands to runs, and its name is its file's stem (the
    results directory and the checks go by the name)."""
    files = sorted((Path(ROOT) / "experiments" / "sweeps").glob("*.yaml"))
    assert len(files) > 20
    for f in files:
        s = sw.load(f)
        assert s.name == f.stem and s.runs, f.name


def test_continue_batch_refuses_a_batch_it_has_no_rows_of_or_from_another_boot(tmp_path, monkeypatch):
    """A device call copies the checkout afresh: where the previous call's results were not put
    back, a sweep told to continue a batch would run the batch's first runs again under its id
    (session 10). `continued_batch` accepts a batch only with rows of it from this boot."""
    with pytest.raises(ConfigError, match="holds no row of that batch"):
        sw.continued_batch(tmp_path, "B1")
    monkeypatch.setattr(records, "boot_id", lambda: "boot-a")
    row = {c: "" for c in records.COLUMNS}
    row.update(run_id="r1", status="ok", batch_id="B1", boot_id="boot-a")
    records.append_row(tmp_path / "runs.csv", row)
    assert sw.continued_batch(tmp_path, "B1") == "B1"
    with pytest.raises(ConfigError, match="holds no row of that batch"):
        sw.continued_batch(tmp_path, "B2")
    monkeypatch.setattr(records, "boot_id", lambda: "boot-b")  # the machine was restarted
    with pytest.raises(ConfigError, match="one machine without restart"):
        sw.continued_batch(tmp_path, "B1")
    r = _sweep(SMOKE, "--out", str(tmp_path / "empty"), "--continue-batch", "B1", "--no-progress")
    assert r.returncode == 2 and "holds no row of that batch" in r.stderr
    assert not (tmp_path / "empty" / "runs.csv").exists()


def test_runs_are_forks_of_an_importing_server_and_fall_back_to_exec(tmp_path, monkeypatch):
    """dos.lab.zygote: a run is a fork of a server that imported torch and transformers once, its
    output in the run's log; a child that cannot use CUDA after the fork
    (BAD_FORK) makes the sweep run that spec, and every later one, by exec."""
    from dos.lab import zygote

    monkeypatch.setattr(zygote, "_broken", False)
    monkeypatch.delenv("DOS_ZYGOTE", raising=False)
    assert zygote.enabled()
    spec = sw.parse({"defaults": QUICK, "runs": [{"system": "torch-cpu"}]}, "z").runs[0]
    res = sw.run_child(spec, tmp_path / "a", 300)
    assert res["status"] == "ok" and res["iter_s"] > 0
    log = (tmp_path / "a" / "log.txt").read_text()
    assert "] init_system" in log and "] step 0" in log  # the child's output went to the run's log
    real_start, real_run, started = zygote.start, zygote.ForkedRun, []

    class BadFork:
        pid, returncode = 2**22 + 7, None  # no such process group: _kill_group finds nothing

        def wait(self, timeout=None):
            return zygote.BAD_FORK

    def fake_start(argv, log_path, env, flavour=None):
        started.append(argv)
        return BadFork()

    monkeypatch.setattr(zygote, "start", fake_start)
    monkeypatch.setattr(zygote, "ForkedRun", BadFork)
    monkeypatch.setattr(zygote, "_server", None)
    res = sw.run_child(spec, tmp_path / "b", 300)  # fell back to `python -m dos.lab.bench.run`
    assert res["status"] == "ok" and len(started) == 1 and not zygote.enabled()
    sw.run_child(spec, tmp_path / "c", 300)
    assert len(started) == 1  # later runs by exec too
    # a run whose CUDA failed to start in the fork (a driver initialised by an import): by exec
    monkeypatch.setattr(zygote, "start", real_start)
    monkeypatch.setattr(zygote, "_broken", False)
    monkeypatch.setattr(zygote, "ForkedRun", real_run)
    assert zygote.broke_cuda("CUDA error: initialization error") and not zygote.broke_cuda("out of memory")
    real_wait, waited = real_run.wait, []

    def wait_then_break(self, timeout=None):
        rc = real_wait(self, timeout)
        (tmp_path / "d" / "result.json").write_text(json.dumps({"status": "error", "files": {},
                                                                "error": "CUDA error: initialization error"}))
        waited.append(rc)
        return rc

    monkeypatch.setattr(zygote, "ForkedRun", type("F", (real_run,), {"wait": wait_then_break}))
    res = sw.run_child(spec, tmp_path / "d", 300)
    assert waited and res["status"] == "ok" and not zygote.enabled()
    assert (tmp_path / "d" / "log.fork.txt").exists() and "] step 0" in (tmp_path / "d" / "log.txt").read_text()
    monkeypatch.setattr(zygote, "_broken", False)
    monkeypatch.setenv("DOS_ZYGOTE", "0")
    assert not zygote.enabled()


def test_fork_server_hides_imports_that_initialise_cuda(tmp_path):
    """dos.lab.zygote: while the server imports, the HIDDEN packages (torchao: its import asks the
    GPU's capability, and transformers imports it wherever it is installed) look absent; a run imports
    them normally after the fork. A server whose imports initialised CUDA anyway does not start and
    names the import (every fork would be a bad one)."""
    (tmp_path / "torchao").mkdir()
    (tmp_path / "torchao" / "__init__.py").write_text("OK = True\n")
    (tmp_path / "probe.py").write_text(
        "import importlib.util\nSPEC = importlib.util.find_spec('torchao')\n"
        "try:\n    import torchao\n    FOUND = True\nexcept ImportError:\n    FOUND = False\n")
    (tmp_path / "initcuda.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(sw.__file__).parents[2])])}

    def serve(preload):
        code = (f"import sys\nfrom dos.lab import zygote\nzygote.PRELOAD = {preload!r}\nrc = zygote.serve()\n"
                "import probe, torchao\n"
                "print('RESULT', rc, probe.SPEC, probe.FOUND, torchao.OK, file=sys.stderr)\n")
        return subprocess.run([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300)

    r = serve(["torch", "probe"])
    assert r.stdout.strip() == "ready" and "RESULT 0 None False True" in r.stderr, r.stderr[-2000:]
    r = serve(["torch", "initcuda", "probe"])
    assert r.stdout.strip() == "" and "importing initcuda initialised CUDA" in r.stderr, r.stderr[-2000:]
    assert "RESULT 1" in r.stderr


def test_flavour_servers_preload_their_modules_and_fall_back_to_the_plain_server(tmp_path):
    """dos.lab.zygote.FLAVOURS: a request with a flavour forks from a server (a fork of the plain
    one, started at its first request) that imported the flavour's modules with its environment;
    the run's environment gets that environment too and says how it started. A flavour whose
    imports initialise CUDA or start a thread does not start, nor does one that dies: its runs
    fork from the plain server, the server and the other flavours carry on."""
    (tmp_path / "probe.py").write_text("import os\nACC = os.environ.get('PROBE_ACC')\n")
    (tmp_path / "initcuda.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True\n")
    (tmp_path / "spawns.py").write_text("import threading, time\n"
                                        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    (tmp_path / "dies.py").write_text("import os\nos._exit(3)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(sw.__file__).parents[2])])}
    code = ("import json, os, sys\nfrom dos.lab import zygote\nfrom dos.lab.bench import run\n"
            "zygote.PRELOAD = ['torch']\n"
            "zygote.FLAVOURS = {'probe': ('probe',), 'cuda': ('initcuda',), 'thread': ('spawns',),"
            " 'dies': ('dies',)}\n"
            "def main(argv):\n"
            "    m = sys.modules.get('probe')\n"
            "    open(argv[0], 'w').write(json.dumps({'preloaded': m is not None, 'acc': m and m.ACC,"
            " 'env_acc': os.environ.get('PROBE_ACC'), 'by': os.environ['DOS_STARTED_BY'],"
            " 'ppid': os.getppid()}))\n"
            "    return 0\n"
            "run.main = main\nsys.exit(zygote.serve())\n")
    reqs = []
    for i, fl in enumerate([["probe", {"PROBE_ACC": "cpu"}], None, ["cuda", {}], ["thread", {}],
                            ["probe", {"PROBE_ACC": "cpu"}], ["dies", {}], ["nosuch", {}]]):
        req = {"argv": [str(tmp_path / f"r{i}.json")], "log": str(tmp_path / f"log{i}.txt"),
               "env": {"PATH": os.environ["PATH"]}}
        if fl:
            req["flavour"] = fl
        reqs.append(json.dumps(req))
    r = subprocess.run([sys.executable, "-c", code], env=env, input="\n".join(reqs) + "\n",
                       capture_output=True, text=True, timeout=300)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0] == "ready", r.stderr[-3000:]
    replies = [json.loads(x) for x in lines[1:]]
    assert [list(x) for x in replies] == [["pid"], ["rc"]] * len(reqs), r.stdout
    assert all(x["rc"] == 0 for x in replies[1::2]), (r.stdout, r.stderr[-3000:])
    got = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in range(len(reqs))]
    assert got[0] == {**got[0], "preloaded": True, "acc": "cpu", "env_acc": "cpu", "by": "fork:probe"}
    assert got[4]["by"] == "fork:probe" and got[4]["ppid"] == got[0]["ppid"]  # the same flavour server
    assert got[1] == {**got[1], "preloaded": False, "env_acc": None, "by": "fork"}
    server = got[1]["ppid"]
    assert got[0]["ppid"] != server
    for i in (2, 3, 5, 6):  # no flavour server: forks of the plain server, without the flavour's env
        assert got[i]["by"] == "fork" and got[i]["ppid"] == server and not got[i]["preloaded"], (i, got[i])
    assert "the probe server is ready" in r.stderr
    assert "the cuda server did not start (importing initcuda initialised CUDA)" in r.stderr
    assert "the thread server did not start (importing spawns started a thread)" in r.stderr
    assert "the dies server did not start (exited)" in r.stderr


def test_sweep_side_of_a_broken_flavour(monkeypatch):
    """A run forked from a flavour server that could not use CUDA disables that flavour only: its
    later runs ask the plain server, other runs are unaffected; DeepSpeed's one-process runs are the
    "deepspeed" flavour, with DS_ACCELERATOR=cpu on the CPU (what systems.prepare_env sets)."""
    from dos.lab import zygote
    from dos.lab.bench.spec import RunSpec

    monkeypatch.setattr(zygote, "_broken", False)
    monkeypatch.setattr(zygote, "_broken_flavours", set())
    assert zygote.flavour_of(RunSpec(system="deepspeed-zero2-offload", device="cpu")) == (
        "deepspeed", {"DS_ACCELERATOR": "cpu"})
    assert zygote.flavour_of(RunSpec(system="deepspeed-zero2-offload", device="cuda")) == ("deepspeed", {})
    assert zygote.flavour_of(RunSpec(system="dos", placement="cpu", device="cuda")) is None
    asked = []

    class FakeServer:
        def request(self, argv, log, env, flavour=None):
            asked.append(flavour)
            return 4242

        def close(self):
            asked.append("closed")

    monkeypatch.setattr(zygote, "_server", FakeServer())
    fl = ("deepspeed", {})
    run = zygote.start(["a"], "log", {}, fl)
    assert run.flavour == "deepspeed" and asked == [fl]
    zygote.disable("a forked run could not use CUDA", run)
    assert zygote.enabled() and zygote._broken_flavours == {"deepspeed"}
    assert zygote.start(["b"], "log", {}, fl).flavour is None and asked[-1] is None
    zygote.disable("the plain server broke", zygote.start(["c"], "log", {}))
    assert not zygote.enabled() and asked[-1] == "closed" and zygote._server is None


@pytest.mark.slow
def test_device_call_script_continues_a_batch_across_calls_and_refuses_one_it_lost(tmp_path):
    """experiments/scripts/h200_call.sh, as a device call runs it (here on the CPU): each call gets
    a fresh copy of the checkout, so a sweep's results live outside it and survive between calls;
    `BATCH_ID` + `BATCH_NEW=1` starts a batch, `BATCH_ID` alone continues it, and a call that finds
    no row of the batch refuses to start it over (session 10 ran a batch's first runs three times)."""
    repo = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(repo)], check=True)
    (repo / "experiments" / "sweeps" / "devcall.yaml").write_text(
        "name: devcall\ndefaults: {model: tiny, device: cpu, seq_len: 16, micro_batch: 1, warmup: 0, "
        "steps: 1, nvml_hz: 5}\nruns:\n  - {system: torch-cpu, seed: [0, 1]}\n")
    out, res = tmp_path / "out", tmp_path / "device-results"
    shutil.copy(Path(ROOT) / "experiments" / "scripts" / "h200_call.sh", repo / "experiments" / "scripts")
    env = {**os.environ, "OUT": str(out), "DOS_DEVICE_RESULTS": str(res), "BATCH_ID": "B-call",
           "H200_CALL_KEEP_PROCS": "1",  # its pkill of leftover runs is for the device alone
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}

    def call(where="", **extra):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        arg = "experiments/sweeps/devcall.yaml" + (f":{where}" if where else "")
        r = subprocess.run(["bash", "experiments/scripts/h200_call.sh", "300", "", "", arg], cwd=repo,
                           env={**env, **extra}, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        return (out / "sweeps.log").read_text()

    assert "ok 1" in call("seed=0", BATCH_NEW="1")
    shutil.rmtree(repo / "experiments" / "results" / "devcall")  # the next call's fresh checkout
    assert "already 1, ok 1" in call()
    rows = records.read_rows(res / "devcall" / "runs.csv")
    assert [r["batch_id"] for r in rows] == ["B-call", "B-call"]
    with tarfile.open(out / "devcall.tar.gz") as tar:  # the whole results dir comes back
        assert "devcall/runs.csv" in tar.getnames()
    # a new batch of the same sweep measures every run again, beside the older batch's rows
    # (session 11's first call skipped 9 runs of a new batch that an older batch had measured)
    assert "ok 2" in call(BATCH_ID="B-next", BATCH_NEW="1")
    rows = records.read_rows(res / "devcall" / "runs.csv")
    assert [r["batch_id"] for r in rows] == ["B-call"] * 2 + ["B-next"] * 2
    assert len({r["log_file"] for r in rows}) == 4  # the new batch's files beside the old ones
    # one call finishing one batch (#B-next: continued, nothing left) and starting another (#+B-two)
    (repo / "experiments" / "sweeps" / "devcall2.yaml").write_text(
        (repo / "experiments" / "sweeps" / "devcall.yaml").read_text().replace("devcall", "devcall2"))
    shutil.rmtree(out)
    out.mkdir()
    r = subprocess.run(["bash", "experiments/scripts/h200_call.sh", "300", "", "",
                        "experiments/sweeps/devcall.yaml#B-next", "experiments/sweeps/devcall2.yaml:seed=1#+B-two"],
                       cwd=repo, env={k: v for k, v in env.items() if k != "BATCH_ID"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (out / "sweeps.log").read_text()
    assert "already 2" in log and "batch B-next" in log and "ok 1" in log and "batch B-two" in log, log
    assert [x["batch_id"] for x in records.read_rows(res / "devcall2" / "runs.csv")] == ["B-two"]
    assert len(records.read_rows(res / "devcall" / "runs.csv")) == 4
    assert {p.name for p in out.iterdir()} >= {"devcall.tar.gz", "devcall2.tar.gz", "results.tar.gz"}
    shutil.rmtree(res)  # a fresh machine (and no results put back into the checkout)
    shutil.rmtree(repo / "experiments" / "results" / "devcall")
    log = call()
    assert "holds no row of that batch" in log and not (res / "devcall" / "runs.csv").exists()


@pytest.mark.slow
def test_device_daemon_runs_a_batch_on_between_calls_and_returns_its_files(tmp_path):
    """experiments/scripts/h200_daemon.sh (here on the CPU): `start` runs h200_call.sh in its own
    process session from a copy of the checkout and returns after WAIT_S with the sweep still
    running; the run goes on without a call; `wait` returns once it ended, with the packs, logs and
    results.tar.gz in $OUT. A second `start` while it runs is refused; `wait` without one says so."""
    repo = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{ROOT}", str(repo)], check=True)
    for name in ("h200_call.sh", "h200_daemon.sh"):
        shutil.copy(Path(ROOT) / "experiments" / "scripts" / name, repo / "experiments" / "scripts")
    (repo / "experiments" / "sweeps" / "devd.yaml").write_text(
        "name: devd\ndefaults: {model: tiny, device: cpu, seq_len: 16, micro_batch: 1, warmup: 0, "
        "steps: 1, nvml_hz: 5}\nruns:\n  - {system: torch-cpu, seed: [0, 1]}\n")
    out, d = tmp_path / "out", tmp_path / "daemon"
    env = {**os.environ, "OUT": str(out), "DOS_DEVICE_RESULTS": str(tmp_path / "device-results"),
           "DOS_DAEMON_DIR": str(d), "H200_CALL_KEEP_PROCS": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}

    def call(*args, rc=0):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        r = subprocess.run(["bash", "experiments/scripts/h200_daemon.sh", *args], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == rc, r.stdout + r.stderr
        return r.stdout + r.stderr

    assert "no daemon" in call("wait", "1", rc=1)
    assert "WAIT_S" in call("wait", "soon", rc=2)
    said = call("start", "0", "500", "", "", "experiments/sweeps/devd.yaml#+B-daemon")
    assert "daemon started" in said and "daemon running" in said, said
    assert "running already" in call("start", "0", "500", "", "", "experiments/sweeps/devd.yaml", rc=1)
    said = call("wait", "500")
    assert "daemon ended: rc=0" in said, said
    assert {"devd.tar.gz", "results.tar.gz", "sweeps.log", "machine.txt"} <= {p.name for p in out.iterdir()}
    with tarfile.open(out / "devd.tar.gz") as tar:
        tar.extractall(tmp_path / "back")
    rows = records.read_rows(tmp_path / "back" / "devd" / "runs.csv")
    assert [r["batch_id"] for r in rows] == ["B-daemon", "B-daemon"]
    assert not (repo / "experiments" / "results" / "devd").exists()  # it ran in its own copy


def test_zygote_caches_cpuinfo(monkeypatch, tmp_path):
    """The sweep server asks py-cpuinfo once (through dos.lab.bench.cpuinfo_cache); every later
    call (DeepSpeed's op builders, in each forked run) gets a copy of that answer without a
    subprocess."""
    import types

    from dos.lab import zygote

    calls = []
    fake = types.ModuleType("cpuinfo")
    fake.get_cpu_info = lambda: calls.append(1) or {"arch": "X86_64", "flags": ["avx512f"]}
    monkeypatch.setitem(sys.modules, "cpuinfo", fake)
    zygote._cache_cpuinfo(tmp_path / "a.json")
    assert len(calls) == 1
    a = fake.get_cpu_info()
    a["arch"] = "changed"  # a caller's edit does not reach the next caller
    assert fake.get_cpu_info() == {"arch": "X86_64", "flags": ["avx512f"]} and len(calls) == 1

    broken = types.ModuleType("cpuinfo")  # an answer that fails stays uncached (DeepSpeed's own fallback)
    def fails():
        raise RuntimeError("no cpuid")
    broken.get_cpu_info = fails
    monkeypatch.setitem(sys.modules, "cpuinfo", broken)
    zygote._cache_cpuinfo(tmp_path / "b.json")
    with pytest.raises(RuntimeError, match="no cpuid"):  # each caller sees the failure, as unpatched
        broken.get_cpu_info()
    assert not (tmp_path / "b.json").exists()


def test_expected_time_goes_by_the_latest_runs_of_a_configuration():
    """A configuration's older rows may be of slower code (planner-3b: runs by exec ~52 s, forked
    ~32 s): `expected_s` takes the median of the latest `RECENT` rows, by timestamp, not of all."""
    spec = sw.parse({"defaults": {"device": "cpu", "seq_len": 16, "micro_batch": 1, "warmup": 0,
                                  "steps": 1}, "runs": [{"system": "torch-cpu", "seed": 0}]}, "recent").runs[0]
    cfg = json.dumps({"run": spec.to_dict()})

    def row(ts, wall):
        return {"status": "ok", "wall_s": str(wall), "config": cfg, "timestamp": ts}

    old = [row(f"2026-12-01T00:00:0{i}", 52.0 + i) for i in range(5)]
    new = [row(f"2026-12-05T00:00:0{i}", 30.0 + i) for i in range(sw.RECENT)]
    assert sw.expected_s(spec, old + new) == pytest.approx(31.0 + sw.RUN_OVERHEAD_S)
    assert sw.expected_s(spec, new + old) == pytest.approx(31.0 + sw.RUN_OVERHEAD_S)  # by timestamp
    assert sw.expected_s(spec, old) == pytest.approx(55.0 + sw.RUN_OVERHEAD_S)


def test_label_names_an_overridden_preset_by_its_overrides():
    """a run of an own shape (a preset with model_overrides) is labelled by its overrides, not as the
    preset: planner-wide-4b's runs printed as '3B' in session 28's progress lines"""
    from dos.lab.bench.spec import RunSpec
    plain = RunSpec(system="dos", placement="cpu", model="3B")
    wide = RunSpec(system="dos", placement="cpu", model="3B",
                   model_overrides={"layers": 16, "hidden": 4608})
    assert " 3B s" in plain.label()
    assert " 3B+hidden=4608,layers=16 s" in wide.label()
