"""Records are append-only (issue 16): every line of every `experiments/results/*/runs.csv` at the
commit where the issue started (BASE) is still in the working tree's file. A line counts as still
there when it is byte-identical, or, where columns were appended to the file since, identical in
its original columns (the BASE header's). Removing or editing a recorded line fails this test.

Needs the git history (a full clone); skips with the reason where BASE is absent (a shallow clone,
an export without .git)."""
from __future__ import annotations

import csv
import io
import subprocess
from collections import Counter
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = "8d3adc6"  # issue 16's first commit: "refine.py: online refinement ... out of perfmodel.py"
RESULTS = "experiments/results"


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _cells(line: str) -> List[str]:
    return next(csv.reader(io.StringIO(line)), [])


def _logical_lines(text: str) -> List[str]:
    """The file's rows as text (one physical line per row, as records.append_row writes them; a
    torn last line without its newline is not a row)."""
    lines = text.split("\n")
    return [ln for ln in lines[:-1] if ln.strip()] if text else []


def missing_lines(old_text: str, new_text: str) -> List[str]:
    """Lines of `old_text` that `new_text` no longer has (each occurrence counted): byte-identical,
    or equal in the old header's columns where the new file's lines are longer. The header itself
    must be kept or extended at its end."""
    old, new = _logical_lines(old_text), _logical_lines(new_text)
    if not old:
        return []
    if not new:
        return old
    old_header, new_header = _cells(old[0]), _cells(new[0])
    if new_header[: len(old_header)] != old_header:
        return [old[0]]
    width = len(old_header)
    exact = Counter(new[1:])
    prefix = Counter(tuple(_cells(ln)[:width]) for ln in new[1:])
    missing = []
    for ln in old[1:]:
        if exact[ln] > 0:
            exact[ln] -= 1
            prefix[tuple(_cells(ln)[:width])] -= 1
            continue
        key = tuple(_cells(ln)[:width])
        if prefix[key] > 0:
            prefix[key] -= 1
        else:
            missing.append(ln)
    return missing


def _base_files() -> List[str]:
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip("not a git checkout: the records' history cannot be checked")
    if _git("cat-file", "-e", f"{BASE}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {BASE} (issue 16's start) is not in this clone (shallow?): "
                    "fetch the full history (git fetch --unshallow) to check the records")
    out = _git("ls-tree", "-r", "--name-only", BASE, "--", RESULTS)
    assert out.returncode == 0, out.stderr
    return [p for p in out.stdout.split("\n") if p.endswith("/runs.csv")]


def test_every_recorded_line_at_the_base_commit_is_still_there():
    files = _base_files()
    assert files, f"no runs.csv under {RESULTS} at {BASE}"
    problems = {}
    for path in files:
        old = _git("show", f"{BASE}:{path}")
        assert old.returncode == 0, old.stderr
        current = ROOT / path
        if not current.exists():
            problems[path] = "file removed"
            continue
        gone = missing_lines(old.stdout, current.read_text())
        if gone:
            problems[path] = f"{len(gone)} line(s) removed or changed, e.g. {gone[0][:120]!r}"
    assert not problems, "records are append-only (issue 16): " + "; ".join(f"{k}: {v}" for k, v in problems.items())


HEADER = "run_id,status,iter_s\n"


def test_the_checker_catches_a_removed_line():
    old = HEADER + "a,ok,1.0\nb,ok,2.0\nb,ok,2.0\n"
    assert missing_lines(old, old) == []
    assert missing_lines(old, old + "c,ok,3.0\n") == []  # appended rows are fine
    assert missing_lines(old, HEADER + "a,ok,1.0\nb,ok,2.0\n") == ["b,ok,2.0"]  # one of two copies
    assert missing_lines(old, HEADER + "b,ok,2.0\nb,ok,2.0\nc,ok,3.0\n") == ["a,ok,1.0"]
    assert missing_lines(old, HEADER + "a,ok,1.5\nb,ok,2.0\nb,ok,2.0\n") == ["a,ok,1.0"]  # edited
    assert missing_lines(old, "") == old.strip().split("\n")  # emptied
    assert missing_lines(old, "run_id,iter_s\na,1.0\n") == ["run_id,status,iter_s"]  # header rewritten


def test_the_checker_accepts_appended_columns(tmp_path):
    old = HEADER + "a,ok,1.0\n"
    widened = "run_id,status,iter_s,batch_id\na,ok,1.0,\nc,ok,3.0,B1\n"
    assert missing_lines(old, widened) == []
    assert missing_lines(old, "run_id,status,iter_s,batch_id\na,ok,9.0,\n") == ["a,ok,1.0"]
    # on files: a line cut from a copy of a recorded file is caught
    src = ROOT / RESULTS / "h200-1.3b" / "runs.csv"
    if not src.exists():
        pytest.skip("no recorded h200-1.3b rows in this checkout")
    text = src.read_text()
    cut = tmp_path / "runs.csv"
    lines = text.split("\n")
    cut.write_text("\n".join(lines[:1] + lines[2:]))
    assert missing_lines(text, cut.read_text()) == [lines[1]]


# ---------------------------------------------------------------- the files rows name

FILE_COLUMNS = ("steps_file", "markers_file", "samples_file", "lanes_file", "log_file")


def test_every_file_a_row_names_is_stored():
    """Every file a recorded row names exists, as named or compressed beside it (`<name>.gz`,
    records.stored): traces stored compressed never orphan a row."""
    from dos.lab.bench import records

    missing, n = [], 0
    for f in sorted((ROOT / RESULTS).glob("*/runs.csv")):
        for r in records.read_rows(f):
            for c in FILE_COLUMNS:
                if r.get(c):
                    n += 1
                    if records.stored(f.parent / r[c]) is None:
                        missing.append(f"{f.parent.name}/{r[c]} ({r['run_id']}, {c})")
    assert n > 1000 and not missing, missing[:10]


def _blob_sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_trace_files_at_the_base_commit_keep_their_bytes():
    """A trace file recorded at BASE is still there, as it was or gzip-compressed beside its name
    (tools/compress_traces.py): its bytes, or gunzip's of the .gz, have BASE's git blob id."""
    import gzip

    tree = _git("ls-tree", "-r", BASE, "--", RESULTS)
    if tree.returncode != 0:
        pytest.skip(f"commit {BASE} is not in this clone (shallow?): {tree.stderr.strip()[:200]}")
    checked, changed = 0, []
    for line in tree.stdout.splitlines():
        meta, path = line.split("\t", 1)
        if not path.endswith(("/samples.csv", "/lanes.json")):
            continue
        sha = meta.split()[2]
        p = ROOT / path
        gz = p.with_name(p.name + ".gz")
        data = p.read_bytes() if p.exists() else gzip.decompress(gz.read_bytes()) if gz.exists() else None
        checked += 1
        if data is None or _blob_sha(data) != sha:
            changed.append(path)
    assert checked > 100 and not changed, changed[:10]
