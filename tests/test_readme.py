"""The README's quick start runs as written on a machine without a GPU (it cannot rot)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- quickstart:begin -->\s*```python\n(.*?)```\s*<!-- quickstart:end -->", text, re.S)
    assert block, "README.md: no ```python block between the quickstart markers"
    return block.group(1)


def test_readme_quickstart_runs_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", quickstart()], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "loss after 20 steps" in proc.stdout
    assert (tmp_path / "dos-ckpt.pt").exists()
