"""Fill wheelhouse/ with every wheel `make setup` needs on a machine without internet.

    python tools/wheelhouse.py [--for gpu-node|full|here] [--extras test,bench,...] [--out wheelhouse]

--for gpu-node (the default): CPython 3.12, manylinux x86_64, and only what the offline GPU image
    lacks (tools/gpu-image-packages.txt: torch, transformers, pandas, matplotlib, pytest... are
    there; papermill, nbclient, ipykernel, nbval, deepspeed, torchao are not): a few MiB.
--for full: the same platform, every dependency of the extras but torch and its CUDA libraries
    (the machine must bring its own torch: `make setup` pins the one it finds).
--for here: this interpreter's platform, every dependency but torch (to test the offline install).

DeepSpeed ships an sdist only: it is built here as a pure-Python wheel (DS_BUILD_OPS=0; its ops
compile at run time on the GPU machine). The set is resolved with pip's own resolver
(`pip install --dry-run --report`) for the target platform, then downloaded --no-deps. The wheel
list lands in <out>/requirements.txt; `make setup` finds the folder and installs from it offline.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"] + [
    x for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                "manylinux2014_x86_64", "manylinux1_x86_64") for x in ("--platform", p)]
# torch and its CUDA libraries are never fetched: the target machine's own torch is pinned.
NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
EXTRA_PINS = {"deepspeed": "0.19.8"}
BUILD = ["setuptools>=77", "wheel", "packaging"]  # pyproject's build backend, for the offline editable install


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(extras) -> list:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for e in extras:
        reqs += project["optional-dependencies"][e]
    return reqs + BUILD


def pip(*args, env=None):
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, env=env)


def deepspeed_wheel(out: Path) -> None:
    if glob.glob(str(out / "deepspeed-*.whl")):
        return
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "-q", "--no-deps", "--no-binary", ":all:", "-d", tmp, f"deepspeed=={EXTRA_PINS['deepspeed']}")
        (sdist,) = glob.glob(f"{tmp}/deepspeed-*.tar.gz")
        pip("wheel", "-q", "--no-deps", "-w", str(out), sdist, env={**os.environ, "DS_BUILD_OPS": "0"})


def resolve(reqs, out: Path, target: str) -> dict:
    """name -> version of everything `reqs` needs on the target (pip's resolver, nothing installed)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        args = ["install", "-q", "--dry-run", "--ignore-installed", "--report", str(report),
                "--find-links", str(out)]
        if target != "here":
            args += PLATFORM + ["--target", str(Path(tmp) / "t")]
        pip(*args, *reqs)
        items = json.loads(report.read_text())["install"]
    return {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--for", dest="target", choices=("gpu-node", "full", "here"), default="gpu-node")
    ap.add_argument("--extras", default="test,bench,notebooks,deepspeed,torchao")
    ap.add_argument("--out", default="wheelhouse")
    a = ap.parse_args(argv)
    out = (ROOT / a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deepspeed_wheel(out)
    pins = resolve(requirements([e for e in a.extras.split(",") if e]), out, a.target)
    skip = set()
    if a.target == "gpu-node":
        image = (ROOT / "tools/gpu-image-packages.txt").read_text().split()
        skip = {norm(n) for n in image}
    build = {norm(re.split(r"[<>=]", b)[0]) for b in BUILD}  # the isolated build sees no image packages
    keep = {n: v for n, v in sorted(pins.items()) if not NEVER.match(n) and (n not in skip or n in build)}
    fetch = [f"{n}=={v}" for n, v in keep.items() if n != "deepspeed"]
    pip("download", "-q", "--no-deps", "-d", str(out), *(PLATFORM if a.target != "here" else ["--only-binary=:all:"]),
        *fetch)
    (out / "requirements.txt").write_text(
        f"# {a.target}: python tools/wheelhouse.py --for {a.target} --extras {a.extras}\n"
        + "".join(f"{n}=={v}\n" for n, v in keep.items()))
    size = sum(p.stat().st_size for p in out.iterdir()) / 2**20
    print(f"{out.name}/: {len(keep)} packages for {a.target} ({size:.1f} MiB); "
          f"left to the target machine: {', '.join(sorted(set(pins) - set(keep)))}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
