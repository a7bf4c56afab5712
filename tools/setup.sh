#!/bin/sh
# `make setup`: the venv, dos editable with its extras. Two decisions, both printed:
# - a torch already importable by $PY (a GPU image's CUDA build) is reused, never replaced: the venv
#   sees it (--system-site-packages, and a .pth when $PY is itself a venv's python) and every install
#   is constrained to exactly that version; without one, constraints.txt pins the CPU build (2.13.0).
# - a wheelhouse (tools/wheelhouse.py, `make wheelhouse`) makes the install offline: --no-index
#   --no-deps $WHEELHOUSE/*.whl (no resolver run), and only what the environment lacks comes from it.
set -eu
PY=${PY:-python3}
VENV=${VENV:-.venv}
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
torch=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
offline=
[ -f "$WHEELHOUSE/requirements.txt" ] && offline=1
if [ -z "${EXTRAS:-}" ]; then
  if [ -n "$offline" ]; then EXTRAS=test,bench,notebooks,deepspeed,torchao; else EXTRAS=test,bench,notebooks,deepspeed,lab; fi
fi
if [ -n "$torch" ]; then
  echo "setup: reusing the torch $torch that $PY has (venv $VENV with --system-site-packages; torch pinned to it)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
  # $PY inside a venv (e.g. /opt/torch/.venv): its packages are not the system's, so a .pth adds them
  # after the venv's own (what the venv installs wins, the rest is seen).
  "$PY" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")' \
    > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_base_env.pth"
  echo "torch==$torch" > "$VENV/constraints.txt"
else
  echo "setup: no torch in $PY; installing torch from constraints.txt ($(grep '^torch' constraints.txt))"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  cp constraints.txt "$VENV/constraints.txt"
fi
if [ -n "$offline" ]; then
  echo "setup: offline, from $WHEELHOUSE/ (--no-index): its wheels, then dos without dependencies"
  # The wheelhouse holds exactly what the environment lacks (tools/wheelhouse.py). No resolver run:
  # pip cannot match a reused torch (seen through the .pth) against a pin with --no-index.
  "$VENV/bin/python" -m pip install -q --no-index --no-deps "$WHEELHOUSE"/*.whl
  "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
else
  echo "setup: from PyPI, extras $EXTRAS (about 1-2 min on a fresh machine; pip is quiet meanwhile)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c "$VENV/constraints.txt" -e ".[$EXTRAS]"
fi
"$VENV/bin/python" -c 'import torch, dos; print(f"setup: done: torch {torch.__version__} (CUDA: {torch.cuda.is_available()}), dos from {dos.__file__}")'
