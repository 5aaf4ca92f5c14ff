# Two commands set everything up on a fresh machine:
#   make train   create .venv if needed, install Forge, train presets/debug.toml on the embedded corpus
#   make test    create .venv if needed, install Forge with its test extras, check format and lint (ruff), run the test suite
# Both are idempotent: the install step is skipped while pyproject.toml is unchanged.

PYTHON ?= python3
VENV ?= .venv
# The CPU build that lies on this machine's disk. GPU users: see README "Installing torch".
TORCH_SPEC ?= torch==2.13.0
# loadgroup: the slurm tests (one xdist group) run in one worker, which starts the one test cluster.
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=40

BIN := $(VENV)/bin
STAMP := $(VENV)/.forge-installed

.PHONY: install train test clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is installed first and on its own, so the project's `torch>=2.13` never resolves to a CUDA wheel
# on a machine that only needs the CPU build; an already-installed torch (e.g. a CUDA build) is kept.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/forge train presets/debug.toml

# Format and lint first (ruff, configured in pyproject.toml), then the tests.
# One thread per process: the suite runs two pytest workers, and its multi-process tests more processes
# still, on a 2-core machine; more threads would only contend.
test: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
