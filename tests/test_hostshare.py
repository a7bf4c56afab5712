"""The ranks of one host share it (docs/DESIGN.md §3.4): calibration with every local rank
running at once (`dos.hostshare`, `dos.calibrate`), per-rank rates combined into the host's
profile keyed by the rank count, and a 1-rank profile derated when no N-rank one exists."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dos import calibrate, hostshare
from dos import perfmodel as pm

import dist_helpers
from helpers import fake_cuda_attrs

ROOT = Path(__file__).resolve().parents[1]
H200 = pm.DESIGN_H200
TINY = calibrate.Sizes(cpu_numel=2**20, subgroup_numel=2**18, gpu_numel=2**19, copy_bytes=2**19,
                       copies=2, min_s=0.01)


def _rank(c: pm.Calibration, f: float, warn=()) -> pm.Calibration:
    """`c` with every rate scaled by f (a fake measurement of one rank)."""
    kw = {n: (tuple(x * f for x in getattr(c, n)) if isinstance(getattr(c, n), tuple) else getattr(c, n) * f)
          for n in hostshare.RATES + hostshare.SCALARS if getattr(c, n) is not None}
    return dataclasses.replace(c, cpu_rate_spread=(0.01 * f,) * len(c.cpu_threads), warnings=tuple(warn), **kw)


def test_combine_takes_the_slowest_rank_and_keeps_each():
    a, b = _rank(H200, 1.0), _rank(H200, 0.5, ["noisy"])
    b = dataclasses.replace(b, gpu_rate=H200.gpu_rate * 2)  # rank 1's GPU the faster one
    c = hostshare.combine([a, b], [4, 5])
    assert c.local_ranks == 2 and c.key.endswith("__2ranks") and c.key.startswith(H200.key)
    assert c.cpu_rate == b.cpu_rate and c.h2d_bw_cpu == b.h2d_bw_cpu and c.host_mem_bw == b.host_mem_bw
    assert c.gpu_rate == H200.gpu_rate  # per field: the slower rank
    assert c.cpu_rate_spread == a.cpu_rate_spread and c.warnings == ("rank 5: noisy",)  # the widest
    assert [r["rank"] for r in c.per_rank] == [4, 5]
    assert c.per_rank[1]["cpu_rate"] == list(b.cpu_rate) and c.per_rank[1]["gpu_rate"] == b.gpu_rate
    assert pm.Calibration.from_json(c.to_json()) == c
    assert "2 sharing this host" in calibrate.table(c) and "rank 5: CPU AdamW" in calibrate.table(c)
    cpu_only = dataclasses.replace(a, gpu_rate=None)
    assert hostshare.combine([cpu_only, b]).gpu_rate is None  # a rate one rank lacks: none
    with pytest.raises(ValueError, match="thread counts"):
        hostshare.combine([a, dataclasses.replace(b, cpu_threads=(1, 2, 4, 8, 12), cpu_rate=b.cpu_rate,
                                                  cpu_rate_spread=None)])


def test_a_one_rank_profile_keeps_its_key_and_format():
    assert H200.local_ranks == 1 and "ranks" not in H200.key
    assert "local_ranks" not in json.loads(H200.to_json())  # the format of before
    assert pm.Calibration.from_json(H200.to_json()) == H200
    with pytest.raises(ValueError):
        dataclasses.replace(H200, local_ranks=0)


def test_derate_splits_the_shared_resources():
    d = hostshare.derate(H200, 2)
    assert hostshare.derate(H200, 1) is H200 and hostshare.derate(d, 2) is d
    assert d.source == "derated" and d.local_ranks == 2 and "torchrun --nproc-per-node 2" in d.warnings[-1]
    assert d.cpu_threads == (1, 2, 4, 6, 8)  # 16 cores / 2 ranks (default_threads(8))
    for t in d.cpu_threads:  # 2 ranks x t threads = one process at 2t threads, split in two
        assert d.cpu(t) == pytest.approx(H200.cpu(2 * t) / 2)
        assert d.cpu(t, dma=True) == pytest.approx(H200.cpu(2 * t, dma=True) / 2)
        assert d.h2d_cpu(t) == pytest.approx(H200.h2d_cpu(2 * t) / 2)
    assert d.h2d_duplex_bw == H200.h2d_duplex_bw / 2 and d.gpu_rate == H200.gpu_rate
    assert (d.host_mem_bw or 0) == pytest.approx((H200.host_mem_bw or 0) / 2)
    with pytest.raises(ValueError):
        hostshare.derate(dataclasses.replace(d, source="measured"), 4)
    # the planner then plans a rank with half the cores and half the copy bandwidth: slower
    numels = (2**24,) * 8
    one = pm.choose(numels, H200, free_gpu_bytes=0, max_threads=16)[1].total_s
    two = pm.choose(numels, d, free_gpu_bytes=0, max_threads=8)[1].total_s
    assert two > one


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setattr(calibrate, "cache_dir", lambda: tmp_path / "cache")
    return tmp_path / "cache"


def test_load_picks_the_profile_of_the_rank_count(cache, monkeypatch):
    from dos.config import EngineConfig
    from dos.partition import partition
    from dos.planner import Planner

    monkeypatch.delenv("DOS_NO_CALIBRATION", raising=False)
    me = dataclasses.replace(H200, gpu_name=calibrate.gpu_name(), cpu_model=calibrate.cpu_model(),
                             torch_version=torch.__version__)
    assert calibrate.load_or_none(2) is None
    calibrate.save(me, calibrate.cache_path())
    assert calibrate.load_or_none() == me
    derated = calibrate.load_or_none(2)
    assert derated.source == "derated" and derated.local_ranks == 2
    assert derated.cpu_threads[-1] == max(1, calibrate.cores() // 2)
    layout = partition([[(2**22, "torch.bfloat16")]], 2**20)
    with pytest.warns(UserWarning, match="derated for 2 local ranks"):
        planner = Planner(EngineConfig(), layout, 2, torch.device("cuda"), local_ranks=2)
    rec = planner.calibration_record()
    assert rec["source"] == "derated" and rec["profile_local_ranks"] == 2 and "torchrun" in rec["note"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one rank: no warning, the profile as cached
        assert Planner(EngineConfig(), layout, 2, torch.device("cuda")).calibration == me
    two = hostshare.combine([_rank(me, 1.0), _rank(me, 0.9)])
    calibrate.save(two, calibrate.cache_path(2))
    assert calibrate.cache_path(2).name.endswith("__2ranks.json")
    assert calibrate.load_or_none(2) == two and calibrate.load_or_none(1) == me
    assert calibrate.load_or_none(3).cpu_threads[-1] == max(1, calibrate.cores() // 3)  # derated
    calibrate.cache_path(1).unlink()
    assert calibrate.load_or_none(1) is None  # a 2-rank profile never serves one rank
    assert Planner(EngineConfig(), layout, 2, torch.device("cuda"), local_ranks=2).calibration == two


# -- 2 processes (gloo): every rank measures at once ----------------------------------------------

def _fake_cuda():
    """The GPU half on the CPU (as tests/test_perfmodel.py's fake): its per-rank rates are real
    CPU copies, so the aggregation runs on measured numbers of every field."""
    calibrate.DEVICE, calibrate.PIN = "cpu", False
    for name, value in fake_cuda_attrs().items():
        setattr(torch.cuda, name, value)


def _calibrate_on_every_rank(tmp):
    _fake_cuda()
    calibrate.cache_dir = lambda: Path(tmp) / "cache"
    calibrate.default_sizes = lambda quick=False: TINY
    counted = []
    real = hostshare.Peers.barrier

    def barrier(self):
        counted.append(1)
        real(self)

    hostshare.Peers.barrier = barrier
    assert calibrate.main([]) == 0  # not --quick: the host's first rank caches it
    calib = calibrate.load_or_none(2)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, calib.to_json())
    assert calibrate.main(["--cached"]) == 0  # every rank finds it: nothing measured again
    return {"profile": calib.to_json(), "same_on_every_rank": len(set(every)) == 1,
            "barriers": len(counted), "files": sorted(p.name for p in (Path(tmp) / "cache").iterdir())}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_calibration_runs_on_every_local_rank_at_once(tmp_path):
    res = dist_helpers.spawn(_calibrate_on_every_rank, 2, tmp_path)
    c = pm.Calibration.from_json(res["profile"])
    assert c.local_ranks == 2 and c.source == "measured" and res["same_on_every_rank"]
    assert res["files"] == [f"{c.key}.json"] and c.key.endswith("__2ranks")  # only one file, one writer
    share = max(1, calibrate.cores() // 2)
    assert c.cpu_threads == tuple(calibrate.default_threads(share))  # each rank: its share of the cores
    assert [r["rank"] for r in c.per_rank] == [0, 1] and c.has_gpu and c.gpu_name == "FakeGPU"
    for name in ("cpu_rate", "cpu_rate_dma", "h2d_bw_cpu"):  # the slowest rank's, point by point
        assert list(getattr(c, name)) == [min(xs) for xs in zip(*(r[name] for r in c.per_rank))]
    for name in ("gpu_rate", "h2d_bw", "d2h_duplex_bw", "host_mem_bw"):
        assert getattr(c, name) == min(r[name] for r in c.per_rank)
    t = len(c.cpu_threads)  # a barrier before every point: CPU, GPU AdamW, 3 copy sets, contended
    assert res["barriers"] == calibrate.REPEATS * t + 1 + 3 + calibrate.REPEATS * t


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_python_m_dos_calibrate_under_torchrun(tmp_path):
    out = tmp_path / "p.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # --quick: never cached
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "dos", "calibrate", "--quick", "--threads", "1", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    c = pm.Calibration.from_json(out.read_text())
    assert c.local_ranks == 2 and len(c.per_rank) == 2 and c.cpu_threads == (1,)
    assert proc.stdout.count("dos calibration (measured") == 1  # the host's first rank prints
