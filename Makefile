# Two entry points for a fresh machine:  make run  (the embedded job)  and  make test.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# A CPU build of torch serves the embedded default and the tests; on a GPU cluster install
# the CUDA build instead (e.g. make install TORCH=torch==2.13.0 with your site's index).
TORCH  ?= torch==2.13.0

.PHONY: install run test lint clean-runs

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

run: install
	$(PY) jobs/submit.py
	$(PY) tools/plot_metrics.py runs/embedded

test: install
	bash .ci/install_slurm.sh
	$(PY) -m pytest -q

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
