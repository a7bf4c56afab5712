"""dos.lab.bench.cpuinfo_cache: py-cpuinfo asked once per boot for a sweep's DeepSpeed runs."""
import json

import pytest

from dos.lab.bench import cpuinfo_cache

cpuinfo = pytest.importorskip("cpuinfo")


def test_the_first_answer_is_kept_in_memory_and_in_a_file_that_later_processes_read(tmp_path, monkeypatch):
    calls = []

    def probe():
        calls.append(1)
        return {"vendor_id_raw": "GenuineIntel", "flags": ["avx512f"], "n": len(calls)}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
    path = tmp_path / "cpuinfo.json"
    assert cpuinfo_cache.install(path)
    assert cpuinfo_cache.install(path)  # idempotent: not wrapped twice
    first = cpuinfo.get_cpu_info()
    first["flags"].append("edited by a caller")
    assert cpuinfo.get_cpu_info()["n"] == 1 and len(calls) == 1  # probed once
    assert json.loads(path.read_text()) == {"vendor_id_raw": "GenuineIntel", "flags": ["avx512f"], "n": 1}
    # a later run (a new process: the module's function unpatched) reads the file, probes nothing
    monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
    cpuinfo_cache.install(path)
    assert cpuinfo.get_cpu_info()["n"] == 1 and len(calls) == 1
    # an unreadable file: probed again, and written afresh
    path.write_text("{not json")
    monkeypatch.setattr(cpuinfo, "get_cpu_info", probe)
    cpuinfo_cache.install(path)
    assert cpuinfo.get_cpu_info()["n"] == 2 and json.loads(path.read_text())["n"] == 2


def test_the_cache_file_is_named_by_the_boot(monkeypatch):
    monkeypatch.setattr(cpuinfo_cache, "boot_id", lambda: "boot-a")
    a = cpuinfo_cache.cache_path()
    monkeypatch.setattr(cpuinfo_cache, "boot_id", lambda: "boot-b")
    assert a != cpuinfo_cache.cache_path() and "boot-a" in a.name
