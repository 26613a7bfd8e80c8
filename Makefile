# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PJRT_DEVICE ?= CPU

.PHONY: demo test bench fuzz peer-tests clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q tests

# Differential fuzzing of the XLA path against eager PyTorch (about 1 s a scenario).
FUZZ_COUNT ?= 2000
fuzz: $(STAMP)
	$(PY) tests/xla_fuzz.py --count $(FUZZ_COUNT) --out fuzz-results.json

bench: $(STAMP)
	$(PY) bench/compile.py
	$(PY) bench/donation.py
	$(PY) bench/backward_memory.py
	$(PY) bench/ddp_memory.py
	$(PY) bench/spmd.py

# torch_xla's own dynamo tests (v2.9.0) under openxla and under donate_xla, compared; not part of
# `make test`. Needs a pytorch/xla git checkout or snapshot (PEER_XLA_SRC) and torchvision 0.24.
# Options: make peer-tests PEER_ARGS="--json peer.json --failures-only"
peer-tests: $(STAMP)
	$(PY) tools/peer_tests.py $(PEER_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
