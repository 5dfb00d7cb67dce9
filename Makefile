# Two entry points for a fresh machine:  make run  (the embedded job)  and  make test.
# make test-fast runs the unit tests only, for everyday work.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Every package is installed through the pins of constraints/cpu.txt: a fresh clone gets what CI
# tested. torch==2.13.0 from PyPI is its CUDA build on Linux x86_64 (several GB with its NVIDIA
# libraries; it runs on the CPU too). TORCH_INDEX: an index for torch alone, e.g. PyTorch's CPU
# one (README, "Set up and run"); empty: PyPI, as pip is set up.
# A GPU cluster installs the GPU stack through constraints/gpu.txt instead (docs/getting-started.md).
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
CONSTRAINTS ?= constraints/cpu.txt
PIP_VERSION := 26.3

.PHONY: install run test test-fast lint bench clean-runs

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	@bash .ci/check_machine.sh install
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "pip==$(PIP_VERSION)"
	$(PY) -m pip install -q -c $(CONSTRAINTS) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $@

# SGLang's sources, NOT installed (it needs CUDA): tests read its request fields and flags from the wheel.
SGLANG_WHEEL_STAMP := $(VENV)/wheels/.sglang-0.5.23
$(SGLANG_WHEEL_STAMP): | $(VENV)/.installed
	$(PY) -m pip download -q --no-deps --dest $(VENV)/wheels sglang==0.5.23
	touch $@

# make run RUN_DIR=runs/exp2: another run dir (runs/embedded by default; the same one again resumes it).
RUN_DIR ?=
run: install
	$(PY) jobs/submit.py $(if $(RUN_DIR),--run-dir $(RUN_DIR))
	$(PY) tools/plot_metrics.py $(or $(RUN_DIR),runs/embedded)

# Two workers: the Slurm tests on one, the other modules on the other (tests/conftest.py says why);
# every test's time and each module's total listed at the end (docs/development.md keeps the slowest).
test: install $(SGLANG_WHEEL_STAMP)
	@bash .ci/check_machine.sh test
	bash .ci/install_slurm.sh
	$(PY) -m pytest -q -n 2 --no-loadscope-reorder --durations=0

# Everyday work: the unit tests (no Ray, no Slurm, no engine servers), under two minutes.
test-fast: install $(SGLANG_WHEEL_STAMP)
	$(PY) -m pytest -q tests/unit

# Every benchmark of tools/bench/ (minutes each; not a test), each ratio held against the spread
# recorded in docs/benchmarks.json: run it before closing a change to a hot path (the weight push,
# the loop, generation, checkpoints, the engine server). make bench BENCH="weight_sync loop_overhead"
BENCH ?=
bench: install
	$(PY) -m rlhpc.devtools.bench $(if $(BENCH),--only $(BENCH))

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
