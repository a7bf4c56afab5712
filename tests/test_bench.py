"""Harness pieces on the CPU: presets, data, specs, records, timing, sampler, systems, preflight."""
import csv
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from dos.lab.bench import models, records, systems, timing
from dos.lab.bench.spec import ConfigError, RunSpec
from dos.lab.nvml import COLUMNS as SAMPLE_COLUMNS
from dos.lab.nvml import Sampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- models and data

@pytest.mark.parametrize("name,billions", [("1.3B", 1.35), ("3B", 3.37), ("5B", 4.60), ("7B", 6.74), ("13B", 13.0),
                                           ("20B", 20.33), ("30B", 30.14)])
def test_preset_sizes_match_design(name, billions):
    assert models.PRESETS[name].n_params() / 1e9 == pytest.approx(billions, abs=0.02)


def test_tiny_model_counts_and_trains_in_bf16():
    p = models.preset("tiny")
    m = models.build_model(p, torch.device("cpu"), seq_len=32)
    assert sum(t.numel() for t in m.parameters()) == p.n_params()
    assert {t.dtype for t in m.parameters()} == {torch.bfloat16}
    assert m.training and m.config.tie_word_embeddings is False
    x = models.synthetic_batches(1, 2, 32, p.vocab, seed=0)[0]
    loss = m(input_ids=x, labels=x).loss
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_preset_overrides_and_errors():
    assert models.preset("1.3B", {"vocab": 256}).vocab == 256
    with pytest.raises(ValueError, match="unknown model preset"):
        models.preset("2B")
    with pytest.raises(ValueError, match="unknown model override"):
        models.preset("tiny", {"width": 3})


def test_stdlib_corpus_is_deterministic_bytes():
    blob = models.stdlib_corpus(max_bytes=1 << 20)
    assert len(blob) == 1 << 20 and blob == models.stdlib_corpus(max_bytes=1 << 20)
    a = models.corpus_batches(blob, 3, 2, 64, seed=1)
    b = models.corpus_batches(blob, 3, 2, 64, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[0].shape == (2, 64) and a[0].dtype == torch.long and int(a[0].max()) < 256
    assert b"def " in blob  # it is Python source


# ---------------------------------------------------------------- specs

def test_run_id_is_stable_and_discriminating():
    a = RunSpec(system="dos", placement="interleaved", stride=2)
    assert a.run_id() == RunSpec(system="dos", placement="interleaved", stride=2).run_id()
    assert a.run_id() != RunSpec(system="dos", placement="interleaved", stride=3).run_id()
    assert RunSpec(system="dos", placement="interleaved").stride == "auto"
    assert RunSpec(system="deepspeed-zero-offload").ratio == 1.0
    assert RunSpec(system="deepspeed-twinflow", ratio=0.5).sub_group_size == 100_000_000


@pytest.mark.parametrize("fields,match", [
    ({"system": "zero-infinity"}, "unknown system 'zero-infinity'; known systems: dos"),
    ({"system": "dos"}, "dos needs placement"),
    ({"system": "dos", "placement": "cpu", "stride": 2}, "impossible configuration: stride"),
    ({"system": "dos", "placement": "cpu", "gpu_fraction": 0.5}, "impossible configuration"),
    ({"system": "dos", "placement": "static", "gpu_fraction": 1.5}, "gpu_fraction must be in"),
    ({"system": "deepspeed-twinflow"}, "needs a ratio in"),
    ({"system": "deepspeed-zero-offload", "ratio": 0.5}, "use deepspeed-twinflow"),
    ({"system": "torch-gpu", "device": "cpu"}, "impossible configuration: torch-gpu needs a CUDA"),
    ({"system": "torch-cpu", "ratio": 0.5}, "ratio does not apply"),
    ({"system": "dos", "placement": "gpu", "seq_len": 0}, "seq_len must be >= 1"),
    ({"system": "torch-cpu", "gpus": 2}, "runs on one GPU only"),
    ({"system": "dos", "placement": "cpu", "gpus": 2, "overlap_backward": True}, "not available with FSDP2"),
    ({"system": "dos", "placement": "gpu", "model": "2B"}, "unknown model preset"),
    ({"system": "dos", "placement": "gpu", "colour": 1}, "unknown run key"),
    ({"system": "dos", "placement": "cpu", "overlap_backward": 1}, "overlap_backward must be true or false"),
    ({"system": "dos", "placement": "cpu", "overlap_backward": True, "max_grad_norm": 1.0},
     "overlap_backward needs max_grad_norm unset"),
    ({"system": "torch-cpu", "overlap_backward": True}, "overlap_backward does not apply"),
])
def test_spec_errors_are_clear(fields, match):
    with pytest.raises(ConfigError, match=match):
        RunSpec.from_dict(fields)


# ---------------------------------------------------------------- records

def test_append_row_header_torn_line_and_schema(tmp_path):
    path = tmp_path / "runs.csv"
    records.append_row(path, {"run_id": "a", "status": "ok", "plan": {"x": [1, 2]}, "error": "l1\nl2"})
    with open(path, "ab") as f:  # a writer killed mid-line
        f.write(b"b,swe")
    assert [r["run_id"] for r in records.read_rows(path)] == ["a"]
    records.append_row(path, {"run_id": "c", "status": "skipped", "error": 'has, "quotes"'})
    rows = records.read_rows(path)
    assert [r["run_id"] for r in rows] == ["a", "c"]
    assert json.loads(rows[0]["plan"]) == {"x": [1, 2]} and rows[0]["error"] == "l1 | l2"
    assert rows[1]["error"] == 'has, "quotes"'
    assert path.read_text().count("\n") == 3 and list(rows[0]) == list(records.COLUMNS)
    with pytest.raises(KeyError):
        records.append_row(path, {"run_id": "d", "status": "ok", "colour": 1})
    with pytest.raises(ValueError):
        records.append_row(path, {"run_id": "d", "status": "fine"})


def test_environment_has_provenance(tmp_path):
    env = json.loads(records.write_env(tmp_path).read_text())
    assert env["versions"]["torch"] and env["cpu"]["logical_cores"] >= 1
    assert env["host_memory"]["total_gib"] > 0 and "nvml" in env["gpu"]


# ---------------------------------------------------------------- timing and sampler

class _Fake:
    def __init__(self):
        self.n = 0

    def forward(self, batch):
        time.sleep(0.002)
        return torch.tensor(float(batch.sum()))

    def backward(self, loss):
        time.sleep(0.004)

    def step(self):
        self.n += 1
        time.sleep(0.001 if self.n != 3 else 0.05)  # one slow step: medians ignore it


def test_timing_protocol_medians_and_markers():
    clock = timing.Clock()
    batches = [torch.full((1, 4), float(i)) for i in range(3)]
    times = timing.run_steps(_Fake(), batches, warmup=2, steps=5, device=torch.device("cpu"), clock=clock)
    assert [t.measured for t in times] == [False] * 2 + [True] * 5
    s = timing.summarize(times, tokens_per_step=4)
    assert s["step_s"] < 0.02 and s["iter_s_max"] >= 0.05 > s["iter_s"]
    assert s["bwd_s"] > s["fwd_s"] and s["tokens_per_s"] == pytest.approx(4 / s["iter_s"])
    assert s["loss_first"] == 0.0 and s["loss_last"] == 0.0  # batch 6 % 3 == 0
    phases = [(m[0], m[1]) for m in clock.markers]
    assert phases[:3] == [("fwd", 0), ("bwd", 0), ("step", 0)] and len(phases) == 21
    assert all(a <= b for _, _, a, b in clock.markers)


def test_timing_records_the_host_side_of_each_phase():
    """Per phase: issue time up to the synchronization, the main thread's CPU time over it (a
    sleeping phase's is below its issue time: the thread waited), context switches, GC pauses
    (a collection in backward, none elsewhere); the probe's gc callback is removed afterwards."""
    import gc

    class Collecting(_Fake):
        def backward(self, loss):
            junk = [[i] for i in range(1000)]
            junk.append(junk)  # a cycle: only the collector frees it
            del junk
            gc.collect()

    before, was = list(gc.callbacks), gc.isenabled()
    gc.disable()  # no automatic collection in another phase: only backward's gc.collect()
    try:
        times = timing.run_steps(Collecting(), [torch.ones(1, 4)], warmup=0, steps=3,
                                 device=torch.device("cpu"), clock=timing.Clock())
    finally:
        if was:
            gc.enable()
    assert gc.callbacks == before
    for t in times:
        assert 0 <= t.fwd_issue_s <= t.fwd_s and 0 <= t.bwd_issue_s <= t.bwd_s
        assert 0 <= t.step_issue_s <= t.step_s
        assert t.fwd_cpu_s <= t.fwd_issue_s  # sleeping: the thread's CPU time falls behind
        assert t.bwd_gc_s > 0 and t.fwd_gc_s == 0 and t.step_gc_s == 0
        if sys.platform == "linux":
            assert min(t.fwd_nivcsw, t.bwd_nivcsw, t.step_nivcsw) >= 0
    rows = timing.step_rows(times)
    assert {"fwd_issue_s", "bwd_cpu_s", "step_nivcsw", "bwd_gc_s"} <= set(rows[0])


def test_sampler_without_nvml_records_host_and_absent(tmp_path):
    t0 = time.perf_counter()
    s = Sampler(t0, hz=100, gpu_index=0)  # no NVML library / driver on CI machines
    with s:
        time.sleep(0.5)
    summary = s.summary()
    if summary["nvml"] == "ok":
        pytest.skip("this machine has NVML")
    assert summary["nvml"].startswith("absent")
    assert summary["sample_hz"] > 50 and summary["peak_host_sampled_gib"] > 0
    # the host's CPU: percentages of all its CPUs, "other" excluding this process's own work
    assert 0 <= summary["host_cpu_steal_pct"] <= 100 and 0 <= summary["host_cpu_other_pct"] <= 100
    s.write(tmp_path / "samples.csv")
    rows = list(csv.reader(open(tmp_path / "samples.csv")))
    assert tuple(rows[0]) == SAMPLE_COLUMNS and len(rows) > 25 and rows[1][1] == ""
    assert SAMPLE_COLUMNS[8:11] == ("host_cpu_busy_pct", "host_cpu_steal_pct", "host_cpu_other_pct")
    assert any(r[8] != "" for r in rows[1:])
    # the GPU's clocks: the columns are there, empty without NVML, and so is their summary
    assert SAMPLE_COLUMNS[11:] == ("gpu_sm_mhz", "gpu_power_w", "gpu_clock_events")
    assert all(r[11:] == ["", "", ""] for r in rows[1:])
    assert summary["gpu_sm_mhz_median"] is None and summary["gpu_clock_events"] is None
    s.write(tmp_path / "samples.csv.gz")  # as a run stores it: compressed, the same text
    assert records.read_text(tmp_path / "samples.csv.gz") == (tmp_path / "samples.csv").read_text()
    first = (tmp_path / "samples.csv.gz").read_bytes()
    s.write(tmp_path / "samples.csv.gz")
    assert (tmp_path / "samples.csv.gz").read_bytes() == first  # reproducible bytes (no date inside)


def test_host_cpu_tells_the_runs_own_work_from_the_hosts():
    """HostCpu: while this process spins one CPU, busy rises by about one CPU's share and
    `other` (busy minus this process's CPU) stays below it; a fake /proc/stat gives exact numbers."""
    import types

    from dos.lab import nvml

    ticks = iter([(100.0, 800.0, 10.0), (160.0, 820.0, 30.0)])  # (user+system, idle, steal) seconds

    def fake_times():
        u, i, st = next(ticks)
        return types.SimpleNamespace(user=u, nice=0.0, system=0.0, idle=i, iowait=0.0, irq=0.0, softirq=0.0,
                                     steal=st)

    real = nvml.psutil.cpu_times
    nvml.psutil.cpu_times = fake_times
    try:
        h = nvml.HostCpu(cpu_s=5.0)
        busy, steal, other = h.sample(cpu_s=35.0)  # of 100 CPU-seconds: 60 busy (30 ours), 20 idle, 20 stolen
    finally:
        nvml.psutil.cpu_times = real
    assert (busy, steal, other) == pytest.approx((60.0, 20.0, 30.0))
    h = nvml.HostCpu(nvml._tree_usage(nvml.psutil.Process())[1])
    time.sleep(0.05)
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:  # this process: one CPU busy
        pass
    busy, steal, other = h.sample(nvml._tree_usage(nvml.psutil.Process())[1])
    ncpu = nvml.psutil.cpu_count()
    assert busy >= 0.5 * 100 / ncpu and other < busy


# ---------------------------------------------------------------- systems

def _train(spec, steps=3):
    torch.manual_seed(0)
    p = models.preset(spec.model)
    model = models.build_model(p, torch.device("cpu"), spec.seq_len)
    system = systems.build(spec, model, torch.device("cpu"))
    data, _ = models.batches("stdlib", steps, spec.micro_batch, spec.seq_len, p.vocab, 0)
    times = timing.run_steps(system, data, 0, steps, torch.device("cpu"), timing.Clock())
    return system, [t.loss for t in times]


def test_torch_baseline_keeps_fp32_masters():
    spec = RunSpec(system="torch-cpu", device="cpu", seq_len=32, micro_batch=2, lr=1e-2)
    system, losses = _train(spec)
    assert system.mixed and all(m.dtype == torch.float32 for m in system.masters)
    assert all(torch.equal(p.data, m.to(torch.bfloat16)) for p, m in zip(system.params, system.masters))
    assert losses[-1] < losses[0]


def test_dos_system_describes_plan_and_lanes():
    pytest.importorskip("dos.engine")
    spec = RunSpec(system="dos", placement="interleaved", stride=2, subgroup_numel=16384, device="cpu",
                   seq_len=32, micro_batch=2, lr=1e-2)
    system, losses = _train(spec)
    d = system.describe()
    assert d["plan"]["placement"] == "interleaved" and d["plan"]["n_subgroups"] > 1
    assert 13 < d["host_bytes_per_param"] < 16 and d["cpu_impl"]
    assert d["config"]["upload_thread"] is False  # dos.uploads: off unless DOS_UPLOAD_THREAD=1
    assert isinstance(system.timeline(), list)
    assert losses[-1] < losses[0]


def test_deepspeed_configs_follow_design():
    zo = systems.deepspeed_config(RunSpec(system="deepspeed-zero-offload", micro_batch=2))
    assert zo["zero_optimization"] == {"stage": 3, "sub_group_size": 100_000_000, "offload_optimizer": {
        "device": "cpu", "pin_memory": True, "ratio": 1.0}}
    assert zo["bf16"] == {"enabled": True} and zo["optimizer"]["type"] == "AdamW"
    assert zo["train_micro_batch_size_per_gpu"] == 2
    tf = systems.deepspeed_config(RunSpec(system="deepspeed-twinflow", ratio=0.5))
    assert tf["zero_optimization"]["offload_optimizer"]["ratio"] == 0.5
    so = systems.deepspeed_config(RunSpec(system="deepspeed-superoffload"))
    assert so["zero_optimization"]["offload_optimizer"]["super_offload"] is True
    z3 = systems.deepspeed_config(RunSpec(system="deepspeed-zero3"))
    assert "offload_optimizer" not in z3["zero_optimization"]


def test_deepspeed_issue16_baselines_are_configured_as_an_expert_would():
    z2 = systems.deepspeed_config(RunSpec(system="deepspeed-zero2-offload"))["zero_optimization"]
    assert z2["stage"] == 2 and z2["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z2["overlap_comm"] and z2["contiguous_gradients"] and z2["reduce_bucket_size"] == 200_000_000
    assert "sub_group_size" not in z2 and z2["allgather_bucket_size"] == 200_000_000
    bf = systems.deepspeed_config(RunSpec(system="deepspeed-zero2-offload-bf16"))
    assert bf["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert bf["zero_optimization"]["stage"] == 2
    z3 = systems.deepspeed_config(RunSpec(system="deepspeed-zero3-offload"))["zero_optimization"]
    assert z3["stage"] == 3 and z3["offload_optimizer"]["ratio"] == 1.0
    assert z3["stage3_param_persistence_threshold"] > models.PRESETS["5B"].vocab * models.PRESETS["5B"].hidden
    tuned = systems.deepspeed_config(RunSpec(system="deepspeed-zero2-offload", ds_zero={"reduce_bucket_size": 5e8}))
    assert tuned["zero_optimization"]["reduce_bucket_size"] == 5e8
    with pytest.raises(ConfigError, match="needs dtype 'bf16'"):
        RunSpec(system="deepspeed-zero2-offload-bf16", dtype="fp32")
    with pytest.raises(ConfigError, match="sub_group_size does not apply"):
        RunSpec(system="deepspeed-zero2-offload", sub_group_size=10)
    with pytest.raises(ConfigError, match="ds_zero does not apply"):
        RunSpec(system="torch-cpu", ds_zero={"stage": 2})
    assert RunSpec(system="deepspeed-zero2-offload").ratio == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("system,state", [("deepspeed-zero2-offload", "fp32"),
                                          ("deepspeed-zero2-offload-bf16", "bf16"),
                                          ("deepspeed-zero3-offload", "fp32")])
def test_deepspeed_issue16_baselines_run_on_the_cpu(system, state, tmp_path):
    """DeepSpeed's CPU accelerator (gloo): each baseline trains the tiny model and records the
    optimizer-state precision it kept (the CPU Adam's moments, read after the steps)."""
    extra = ["sub_group_size=20000"] if system == "deepspeed-zero3-offload" else []
    r = _cli("bench", f"system={system}", "device=cpu", "seq_len=32", "micro_batch=2", "warmup=1",
             "steps=2", "nvml_hz=20", *extra, "--out", str(tmp_path), env={**os.environ, "DS_ACCELERATOR": "cpu"},
             timeout=1200)
    assert r.returncode == 0, r.stderr
    (row,) = records.read_rows(tmp_path / "runs.csv")
    assert row["status"] == "ok", row["error"]
    assert row["state_dtype"] == state and row["cpu_impl"] == "DeepSpeedCPUAdam" and row["batch_id"]


def test_oom_classification():
    from dos.lab.bench.run import is_oom

    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom(RuntimeError("shape mismatch"))


# ---------------------------------------------------------------- CLI

def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dos", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=kw.pop("timeout", 300), **kw)


def test_cli_bench_errors():
    r = _cli("bench", "system=nope")
    assert r.returncode == 2 and "unknown system 'nope'" in r.stderr


@pytest.mark.slow
def test_cli_bench_one_run(tmp_path):
    r = _cli("bench", "system=torch-cpu", "device=cpu", "seq_len=32", "micro_batch=2", "warmup=1",
             "steps=2", "nvml_hz=20", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = records.read_rows(tmp_path / "runs.csv")
    assert len(rows) == 1 and rows[0]["status"] == "ok" and float(rows[0]["iter_s"]) > 0
    assert "status=ok" in r.stdout and (tmp_path / rows[0]["steps_file"]).exists()


class _FakeNvml:
    """Just enough of pynvml for the sampler's GPU path (no GPU on CI)."""

    NVML_FI_DEV_PCIE_COUNT_TX_BYTES, NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 188, 189
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1

    class NVMLError(Exception):
        pass

    def __init__(self, counters: bool):
        self.counters, self.t0, self.shut = counters, time.perf_counter(), False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByUUID(self, uuid):
        raise self.NVMLError("not found")

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("M", (), {"used": 3 << 30})()

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("U", (), {"gpu": 87, "memory": 12})()

    def nvmlDeviceGetFieldValues(self, h, ids):
        if not self.counters:
            return [type("F", (), {"nvmlReturn": 3})() for _ in ids]
        n = int((time.perf_counter() - self.t0) * 1e9)  # 1 GB/s D2H, 2 GB/s H2D
        vals = [n, 2 * n]
        return [type("F", (), {"nvmlReturn": 0, "value": type("V", (), {"ullVal": v})()})() for v in vals]

    def nvmlDeviceGetPcieThroughput(self, h, which):
        time.sleep(0.02)
        return 5000 if which == 0 else 7000  # KB/s

    NVML_CLOCK_SM = 1

    def nvmlDeviceGetClockInfo(self, h, which):
        assert which == self.NVML_CLOCK_SM
        return 1980 if (time.perf_counter() - self.t0) < 0.2 else 1500

    def nvmlDeviceGetPowerUsage(self, h):
        return 650_000  # mW

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        if not self.counters:  # a VM that refuses the reading: None, asked once
            self.refused = getattr(self, "refused", 0) + 1
            raise self.NVMLError("not supported")
        return 0 if (time.perf_counter() - self.t0) < 0.2 else 0x4 | 0x20


@pytest.mark.parametrize("counters", [True, False])
def test_sampler_gpu_path_with_fake_nvml(monkeypatch, tmp_path, counters):
    fake = _FakeNvml(counters)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = Sampler(time.perf_counter(), hz=100, gpu_uuid="GPU-x")
    with s:
        time.sleep(0.4)
    summary = s.summary()
    assert summary["nvml"] == "ok" and fake.shut
    assert summary["pcie_source"] == ("counters" if counters else "throughput-20ms")
    assert summary["sample_hz"] > 50 and summary["peak_gpu_nvml_gib"] == 3.0
    last = s.rows[-1]
    assert last[2] == 87 and last[3] == 12
    if counters:
        assert last[4] == pytest.approx(1000, rel=0.2) and last[5] == pytest.approx(2000, rel=0.2)
    else:
        assert (last[4], last[5]) == (5.0, 7.0)
    s.write(tmp_path / "s.csv")
    assert len((tmp_path / "s.csv").read_text().splitlines()) == len(s.rows) + 1
    # the GPU's clocks, power and the reasons its clocks were held down (fake: a power cap and a
    # thermal slowdown from 0.2 s on)
    assert summary["gpu_sm_mhz_min"] == 1500 and summary["gpu_sm_mhz_median"] in (1500, 1980)
    assert summary["gpu_power_w_mean"] == 650.0 and last[11:13] == (1500, 650.0)
    if counters:
        events = summary["gpu_clock_events"]
        assert set(events) == {"sw_power_cap", "sw_thermal"} and 0.2 < events["sw_power_cap"] < 0.8
        assert last[13] == 0x24
    else:
        assert summary["gpu_clock_events"] is None and last[13] is None and fake.refused == 1


def test_clock_event_names():
    from dos.lab.nvml import clock_event_names

    assert clock_event_names(0) == [] and clock_event_names(0x1) == ["gpu_idle"]
    assert clock_event_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal"]
    assert clock_event_names(0x8 | 0x10000) == ["hw_slowdown", "0x10000"]


# ---------------------------------------------------------------- several GPUs (torchrun)

def test_merge_ranks_takes_worst_status_max_gpu_and_host_total():
    from dos.lab.bench.run import merge_ranks

    r0 = {"status": "ok", "error": None, "iter_s": 1.0, "tokens_per_s": 4096.0, "peak_gpu_gib": 3.0,
          "peak_gpu_reserved_gib": 4.0, "peak_gpu_nvml_gib": None, "peak_host_gib": 2.0, "rank": 0}
    r1 = {**r0, "iter_s": 1.1, "peak_gpu_gib": 5.0, "peak_host_gib": 3.0, "rank": 1}
    out = merge_ranks([r0, r1], 0, 4.5)
    assert out["status"] == "ok" and out["iter_s"] == 1.0 and out["tokens_per_s"] == 4096.0
    assert out["peak_gpu_gib"] == 5.0 and out["peak_host_gib"] == 5.0 and out["peak_host_ranks_sum_gib"] == 5.0
    assert out["rank_iter_s"] == [1.0, 1.1] and "rank" not in out
    assert merge_ranks([r0, r1], 0, 6.0)["peak_host_gib"] == 6.0  # the sampled process tree
    oom = merge_ranks([r0, {**r1, "status": "oom", "error": "CUDA out of memory"}], 1, 0.0)
    assert oom["status"] == "oom" and oom["error"].startswith("rank 1: CUDA out of memory")
    assert merge_ranks([r0, None], 1, 0.0)["status"] == "error"
    lost = merge_ranks([None, r1], 1, 0.0)
    assert lost["status"] == "error" and "rank(s) [0]" in lost["error"]


def _bench_two_ranks(tmp_path, *args, env=None, timeout=300):
    r = _cli("bench", *args, "model=tiny", "device=cpu", "gpus=2", "steps=2", "warmup=1", "nvml_hz=20",
             "--out", str(tmp_path), env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = records.read_rows(tmp_path / "runs.csv")
    assert row["status"] == "ok", row["error"]
    assert int(row["gpus"]) == 2 and float(row["tokens_per_s"]) > 0
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "result.json").exists()]
    res = json.loads((run_dir / "result.json").read_text())
    assert res["rank_status"] == ["ok", "ok"] and (run_dir / "rank1" / "steps.csv").exists()
    # tokens/s counts both ranks' tokens: micro_batch x seq_len x 2 per (rank 0's) iteration
    spec = json.loads((run_dir / "spec.json").read_text())
    assert res["tokens_per_s"] == pytest.approx(spec["micro_batch"] * spec["seq_len"] * 2 / res["iter_s"])
    return row, res


@pytest.mark.slow
def test_cli_bench_dos_fsdp2_on_two_gloo_ranks(tmp_path):
    """gpus=2 on the CPU: torchrun starts 2 gloo ranks, each shards the tiny Llama with FSDP2
    (bf16 compute, fp32 reduction) and runs dos interleaved; rank 0's timing makes the one row."""
    row, res = _bench_two_ranks(tmp_path, "system=dos", "placement=interleaved", "stride=2")
    assert res["config"]["fsdp2"] == {"world_size": 2, "units": "decoder layers + root",
                                      "mp_policy": "bf16 params, fp32 reduce"}
    assert int(row["n_params"]) == models.preset("tiny").n_params()  # the whole model, not a shard


@pytest.mark.slow
def test_cli_bench_deepspeed_on_two_gloo_ranks(tmp_path):
    """DeepSpeed's CPU accelerator with 2 gloo ranks (ZeRO-3 + offload). The first run on a machine
    JIT-builds DeepSpeed's shm comm op (minutes on 2 cores); later runs take ~20 s."""
    row, res = _bench_two_ranks(tmp_path, "system=deepspeed-zero3-offload", "sub_group_size=20000",
                                "seq_len=32", "micro_batch=2", env={**os.environ, "DS_ACCELERATOR": "cpu"},
                                timeout=1200)
    assert row["cpu_impl"] == "DeepSpeedCPUAdam"


def test_stale_extension_build_locks_are_cleared(tmp_path):
    """A build killed mid-way leaves a lock every later build waits on forever; a fresh one (a
    build under way) is left alone."""
    import os
    import time

    from dos.lab.bench.systems import clear_stale_extension_locks

    old, new = tmp_path / "py311_cpu" / "cpu_adam" / "lock", tmp_path / "py311_cpu" / "fused_adam" / "lock"
    for p in (old, new):
        p.parent.mkdir(parents=True)
        p.touch()
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    with pytest.warns(UserWarning, match="stale torch-extension build lock"):
        gone = clear_stale_extension_locks(str(tmp_path))
    assert gone == [str(old)] and not old.exists() and new.exists()


def test_cpu_schedule_reaches_the_kernel_and_the_record(tmp_path):
    """cpu_schedule (an in-situ A/B of the CPU kernel's thread schedule): the run's process uses
    it and the row's cpu_impl names it; anything but dynamic/static is refused."""
    r = _cli("bench", "system=dos", "placement=cpu", "cpu_schedule=static", "device=cpu", "seq_len=32",
             "micro_batch=2", "warmup=1", "steps=1", "nvml_hz=20", "--out", str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stderr
    (row,) = records.read_rows(tmp_path / "runs.csv")
    assert row["status"] == "ok", row["error"]
    assert row["cpu_impl"].startswith("dos-csrc-") and row["cpu_impl"].endswith("-static")
    with pytest.raises(ConfigError, match="cpu_schedule"):
        RunSpec(system="dos", placement="cpu", cpu_schedule="guided")
    with pytest.raises(ConfigError, match="cpu_schedule does not apply"):
        RunSpec(system="torch-cpu", cpu_schedule="static")


def test_numa_gib_sums_each_nodes_pages_at_their_page_size():
    """host_pages records where the arena's pages are (NUMA node), to tell a run that streamed from
    a remote node apart from other noise: 2 MiB huge pages and 4 KiB pages each counted at their size."""
    from dos.lab.bench.run import numa_gib

    text = ("7f00 default anon=3 dirty=3 N0=512 N1=1024 kernelpagesize_kB=2048\n"
            "7f10 default file=/lib/x.so mapped=262144 N0=262144 kernelpagesize_kB=4\n"
            "7f20 default anon=1\n")
    assert numa_gib(text) == {"N0": 2.0, "N1": 2.0}
    assert numa_gib("") == {}


def test_kernel_bench_times_every_state_format(tmp_path, monkeypatch):
    """`python -m dos.lab.bench.kernel` rows for dos's CPU kernel on fp32, bf16 and int8 moments
    (issue 17: the CPU lane per format, apart from the engine), each with its byte count."""
    from dos.lab.bench import kernel

    monkeypatch.setattr(kernel, "deepspeed_impls", lambda *a: [])  # its JIT build: a minute here
    rows = kernel.run([1], 6000, "kernel-probe", 1, tmp_path)
    by = {r["impl"]: r for r in rows}
    for name, nbytes in (("dos", 28), ("dos-bf16", 20), ("dos-int8", 16), ("dos-bf16-noweight", 18),
                          ("dos-bf16-split", 18)):
        assert by[name]["status"] == "ok" and by[name]["bytes_per_param"] == nbytes, by[name]
        assert by[name]["median_s"] > 0
    with open(tmp_path / "kernel-probe" / "runs.csv") as f:
        assert {"dos-bf16", "dos-int8"} <= {r["impl"] for r in csv.DictReader(f)}


def test_kernel_bench_runs_only_the_named_implementations(tmp_path, monkeypatch):
    """`--impls`: rows for those and the STREAM references only, and no other implementation is
    built (DeepSpeed's JIT build would fail this test)."""
    from dos.lab.bench import kernel

    def no_deepspeed(*a):
        raise AssertionError("DeepSpeed built though not named")
    monkeypatch.setattr(kernel, "deepspeed_impls", no_deepspeed)
    rows = kernel.run([1], 6000, "kernel-only", 1, tmp_path, only=["dos", "dos-bf16-split"],
                      batch_id="b-1")
    impls = {r["impl"] for r in rows}
    assert {r["batch_id"] for r in rows} == {"b-1"} and all("boot_id" in r for r in rows)
    assert impls == {"dos", "dos-bf16-split", "stream-copy", "stream-triad", "stream-add-inplace"}
    assert all(r["status"] == "ok" for r in rows)
    with pytest.raises(SystemExit):  # an unknown name is refused by the command line
        kernel.main(["--sweep", "x", "--impls", "dos-fp8"])


def test_batch_columns_place_a_script_row_in_its_batch(monkeypatch):
    from dos.lab.bench import records

    monkeypatch.setenv("BATCH_ID", "b-1")
    monkeypatch.setenv("DOS_GIT_SHA", "abc123")
    cols = records.batch_columns()
    assert list(cols) == ["timestamp", "git_sha", "batch_id", "gpu_uuid", "boot_id"]
    assert cols["batch_id"] == "b-1" and cols["git_sha"] == "abc123"
    assert cols["boot_id"] == records.boot_id()
    if not torch.cuda.is_available():
        assert cols["gpu_uuid"] == "" == records.gpu_uuid()
    else:
        assert cols["gpu_uuid"].startswith("GPU-")


def test_script_rows_append_under_one_header(tmp_path):
    from dos.lab.bench import records

    out = tmp_path / "runs.csv"
    records.append_script_rows(out, [{"a": 1, "b": 2}, {"a": 3, "b": 4}])
    records.append_script_rows(out, [{"a": 5, "b": 6}])  # a later call adds rows, no second header
    assert out.read_text().splitlines() == ["a,b", "1,2", "3,4", "5,6"]
    with pytest.raises(ValueError, match="write a new file"):  # never a row under another schema
        records.append_script_rows(out, [{"a": 7, "c": 8}])
    with pytest.raises(ValueError, match="same columns"):
        records.append_script_rows(tmp_path / "x.csv", [{"a": 1}, {"b": 2}])
    with pytest.raises(ValueError, match="no rows"):
        records.append_script_rows(tmp_path / "y.csv", [])
    assert out.read_text().splitlines()[-1] == "5,6" and not (tmp_path / "x.csv").exists()


def test_init_profile_leaves_waits_on_other_threads_out():
    """A pool's wait ranked first in every dos row's init_profile and pushed the engine's parts
    out of the list: waits are not work."""
    import time as _time
    from concurrent.futures import ThreadPoolExecutor

    from dos.lab.bench import run

    def work():
        t = _time.perf_counter()
        while _time.perf_counter() - t < 0.05:
            pass

    def waits_on_a_pool():
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda _: _time.sleep(0.1), range(2)))

    res = {}
    with run._profiled(res, "p"):
        work()
        waits_on_a_pool()
    labels = list(res["p"])
    assert any("(work)" in k for k in labels) and any("(waits_on_a_pool)" in k for k in labels)
    assert not any(run._is_wait(k) for k in labels)
    assert not any(k.startswith(("threading.py:", "_base.py:")) for k in labels)
