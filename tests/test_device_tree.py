"""experiments/scripts/device_tree.py: what a device call sends, and `slim` / `full` leave git whole."""
import importlib.util
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("device_tree", os.path.join(ROOT, "experiments/scripts/device_tree.py"))
dt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dt)

ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
       "GIT_COMMITTER_EMAIL": "t@t"}


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=ENV).stdout


def write(path, n):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * n)


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "r"
    r.mkdir()
    git(r, "init", "-q")
    write(r / "dos" / "a.py", 100)
    write(r / "experiments" / "results" / "s" / "runs.csv", 700)
    write(r / "experiments" / "results" / "s" / "run1" / "lanes.json.gz", 5000)
    write(r / "experiments" / "results" / "s" / "run1" / "log.txt", 1)
    (r / ".gitignore").write_text(".whl/\n")
    git(r, "add", "-A")
    git(r, "commit", "-qm", "x")
    write(r / ".whl" / "w.whl", 2000)  # ignored: travels only when carried
    write(r / "notes.txt", 10)  # untracked, not ignored: travels
    return r


def test_tar_bytes():
    assert dt.tar_bytes(0) == 512
    assert dt.tar_bytes(1) == 1024
    assert dt.tar_bytes(512) == 1024
    assert dt.tar_bytes(513) == 1536


def test_counts_tracked_untracked_and_carried(repo):
    want = sum(dt.tar_bytes(n) for n in (100, 700, 5000, 1, len(".whl/\n"), 10))
    assert dt.travel_mib(str(repo)) * 2**20 == want
    assert dt.travel_mib(str(repo), [".whl"]) * 2**20 == want + dt.tar_bytes(2000)
    assert dt.travel_mib(str(repo), [".whl/w.whl"]) * 2**20 == want + dt.tar_bytes(2000)


def test_slim_leaves_the_runs_folders_out_and_full_puts_them_back(repo, capsys):
    before = dt.travel_mib(str(repo))
    dt.main(["slim", "--repo", str(repo)])
    assert not (repo / "experiments/results/s/run1").exists()
    assert (repo / "experiments/results/s/runs.csv").exists()
    assert (repo / "dos/a.py").exists()
    assert dt.travel_mib(str(repo)) * 2**20 == before * 2**20 - dt.tar_bytes(5000) - dt.tar_bytes(1)
    assert "experiments/results/s/run1/lanes.json.gz" in git(repo, "ls-files")  # still tracked
    assert git(repo, "status", "--porcelain") == "?? notes.txt\n"  # nothing deleted as far as git sees
    dt.main(["full", "--repo", str(repo)])
    assert (repo / "experiments/results/s/run1/lanes.json.gz").read_bytes() == b"x" * 5000
    assert dt.travel_mib(str(repo)) == before
    assert "PASS" in capsys.readouterr().out


def test_over_the_limit_is_a_miss(repo, monkeypatch, capsys):
    monkeypatch.setattr(dt, "LIMIT_MIB", 0.001)
    assert dt.main(["size", "--repo", str(repo)]) == 1
    assert "MISS" in capsys.readouterr().out
