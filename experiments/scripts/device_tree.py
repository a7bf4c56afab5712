"""What a device call sends, and a slimmer checkout for calls that carry wheels.

The device copies the working tree (tracked and untracked-not-ignored files, plus `carry`) and
refuses a call over 64 MiB. What it counts matches a tar archive of those files (512 B of header
per file, contents padded to 512 B): session 35's `.whl` calls passed at 54.2 + 8.0 MiB, session
36's first was refused at 56.2 + 8.0 and passed at 56.2 without the wheels. ~6,000 tracked files
put ~5 MiB of headers on top of the bytes, and the runs' own folders (traces, samples, logs) are
most of the rest; a device call needs none of them (sweeps write under /tmp and pack).

    python experiments/scripts/device_tree.py size [--carry .whl ...]   # MiB, PASS or MISS vs 64
    python experiments/scripts/device_tree.py slim   # sparse checkout: runs' folders left out
    python experiments/scripts/device_tree.py full   # everything back (git sparse-checkout disable)

Whether the device's copy leaves out what `slim` took off the disk is untried (session 36 had no
device time left): a refused call costs nothing, so try `size`'s verdict there first.
`slim` leaves every file git tracks in git (skip-worktree only: nothing is deleted from history
or the index); `full` puts them back on disk. Between the two, `make run` and the notebooks lack
the runs' traces: go back to `full` before them and before committing records that a device call
brought back (git refuses to add paths outside the sparse patterns).
"""
import argparse
import os
import subprocess
import sys

LIMIT_MIB = 64
SLIM = ["/*", "!/experiments/results/*/*/"]  # runs.csv and the logs beside it stay


def _git(repo, *args, text=True):
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=text).stdout


def tar_bytes(size: int) -> int:
    return 512 + (size + 511) // 512 * 512


def travelling(repo: str, carry=()) -> list:
    """Paths (relative to repo) that a call sends: on-disk tracked files, untracked files that git
    does not ignore, and every file under the carried paths."""
    out = _git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard", text=False)
    paths = [p.decode() for p in out.split(b"\0") if p]
    seen = set(paths)
    for c in carry:
        top = os.path.join(repo, c)
        files = [top] if os.path.isfile(top) else [os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs]
        for rel in (os.path.relpath(f, repo) for f in files):
            if rel not in seen:
                seen.add(rel)
                paths.append(rel)
    return paths


def travel_mib(repo: str, carry=()) -> float:
    total = 0
    for p in travelling(repo, carry):
        full = os.path.join(repo, p)
        if os.path.isfile(full) and not os.path.islink(full):  # skip-worktree files are absent
            total += tar_bytes(os.path.getsize(full))
    return total / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["size", "slim", "full"])
    ap.add_argument("--carry", nargs="*", default=[])
    ap.add_argument("--repo", default=".")
    a = ap.parse_args(argv)
    repo = _git(a.repo, "rev-parse", "--show-toplevel").strip()
    if a.what == "slim":
        _git(repo, "sparse-checkout", "set", "--no-cone", *SLIM)
    elif a.what == "full":
        _git(repo, "sparse-checkout", "disable")
    mib = travel_mib(repo, a.carry)
    verdict = "PASS" if mib <= LIMIT_MIB else "MISS"
    print(f"travels {mib:.1f} MiB with carry {a.carry or '[]'} (limit {LIMIT_MIB} MiB): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
