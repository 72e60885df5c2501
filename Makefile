# Whisperwire: `make run` and `make test` set everything up on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8765
MODEL ?= tiny.en
PYTEST_ARGS ?=

.PHONY: system-libs install run test lint browser bench bench-engine bench-decoder bench-streaming bench-capacity clean

install: $(STAMP)

# lightning-whisper-mlx goes in a second, --no-deps step: its metadata pins torch,
# tiktoken==0.3.3, numba, scipy and huggingface-hub, none of which we run (README explains).
$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-libs
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps 'lightning-whisper-mlx==0.0.10'
	touch $(STAMP)

# OpenBLAS from cmeel-openblas links libgfortran.so.5, which Debian ships as libgfortran5.
system-libs:
	@ldconfig -p | grep -q 'libgfortran.so.5 ' || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgfortran5 >/dev/null; \
	  else echo "WARNING: libgfortran5 missing (sudo apt-get install libgfortran5); CPU decoding will be ~20x slower"; fi; }

run: $(STAMP)
	$(VENV)/bin/whisperwire-server --host $(HOST) --port $(PORT) --model $(MODEL)

# Debian's Chromium for the browser-page tests; never a browser download through Playwright.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing: sudo apt-get install chromium (browser tests will be skipped)"; fi; }

test: $(STAMP) browser
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check server client tests bench
	$(VENV)/bin/ruff format --check server client tests bench
	$(VENV)/bin/mypy

bench-engine: $(STAMP)
	$(PY) -m bench.engine

bench-decoder: $(STAMP)
	$(PY) -m bench.decoder

bench-streaming: $(STAMP)
	$(PY) -m bench.streaming

bench-capacity: $(STAMP)
	$(PY) -m bench.capacity

bench: bench-engine bench-decoder bench-streaming bench-capacity

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
