# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs raylora into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raylora-installed

.PHONY: demo test install clean

install: $(STAMP)

# torch==2.13.0 is the CPU build on CPU-only machines; installing it before raylora keeps
# pip from resolving `torch` to the multi-GB CUDA build. With a GPU (nvidia-smi present),
# pip resolves torch from the project's dependency as usual (see README "GPU install").
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raylora demo --dir runs/demo

test: $(STAMP)
	$(PY) -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
