# Two commands on a fresh machine:  make run  (the main job)   make test  (the test suite)
# Offline GPU node: `make wheelhouse` where PyPI is reachable, carry wheelhouse/ along, `make setup` there.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WHEELHOUSE ?= wheelhouse
# gpu-node: CPython 3.12 manylinux x86_64, only what the offline GPU image lacks (~25 MiB);
# full: the same platform, everything but torch; here: this machine (to try the offline install)
WHEELHOUSE_FOR ?= gpu-node
# EXTRAS unset: tools/setup.sh picks them (online: + lab; offline: + torchao, no jupyterlab)
export PY VENV WHEELHOUSE EXTRAS

.PHONY: setup run test test-gpu lab clean wheelhouse

# tools/setup.sh reuses a torch that $(PY) already has (pinned to it), else installs the CPU build
# pinned in constraints.txt; with $(WHEELHOUSE)/ present it installs offline from there.
$(VENV)/.installed: pyproject.toml constraints.txt $(wildcard $(WHEELHOUSE)/requirements.txt)
	sh tools/setup.sh
	touch $@

setup: $(VENV)/.installed

wheelhouse:
	$(PY) tools/wheelhouse.py --for $(WHEELHOUSE_FOR) --out $(WHEELHOUSE) $(if $(EXTRAS),--extras $(EXTRAS))
	du -sh $(WHEELHOUSE)

# Regenerates every figure from the recorded rows (no GPU needed); RERUN=1 reruns the sweeps first.
# ARGS passes on: make run ARGS="--only 8 --where model=1.3B"
run: setup
	$(BIN)/python -m dos run $(ARGS)

test: setup
	$(BIN)/python -m pytest -q

lab: setup
	$(BIN)/jupyter lab notebooks/ $(if $(filter 0,$(shell id -u)),--allow-root)

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

clean:
	rm -rf $(VENV) build *.egg-info
