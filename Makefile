# Two commands on a fresh machine:  make run  (the main job)   make test  (the test suite)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= test,bench,notebooks,deepspeed

.PHONY: setup run test test-gpu lab clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)

# Everything installs through constraints.txt, which pins torch==2.13.0 (a CPU build here);
# an unpinned torch (deepspeed asks for one) would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml constraints.txt | $(BIN)/activate
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

# Regenerates every figure from the recorded rows (no GPU needed); RERUN=1 reruns the sweeps first.
run: setup
	$(BIN)/python -m dos run

test: setup
	$(BIN)/python -m pytest -q

lab: setup
	$(BIN)/jupyter lab notebooks/

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info
