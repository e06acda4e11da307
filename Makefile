# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs raylora into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LANES ?= 2
STAMP := $(VENV)/.raylora-installed

.PHONY: demo test bench install clean gpu-wheels

install: $(STAMP)

# On CPU-only machines torch is the CPU build, 2.13.0+cpu: PyPI's torch==2.13.0 for Linux is
# the multi-GB CUDA build, so the +cpu wheel comes from PyTorch's CPU index
# (TORCH_CPU_INDEX), unless pip's own configured sources (a wheelhouse, a mirror) have it,
# which are tried first. It is installed first *and* kept as
# a constraint: without the constraint pip's resolver may still swap it for the newest
# multi-GB CUDA build while resolving the rest. With a GPU (nvidia-smi present), pip
# resolves torch from the project's dependency as usual (see README "GPU install").
CPU_CONSTRAINTS := $(VENV)/cpu-constraints.txt
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# The versions CI last passed with (see its header); `make install LOCK=` resolves afresh.
LOCK ?= .ci/constraints.txt

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q -e '.[dev]'; \
	else \
		echo "torch==2.13.0" > $(CPU_CONSTRAINTS); \
		{ $(PY) -m pip install -q "torch==2.13.0+cpu" 2>/dev/null || \
		  $(PY) -m pip install -q --index-url $(TORCH_CPU_INDEX) "torch==2.13.0+cpu"; } && \
		$(PY) -m pip install -q -c $(CPU_CONSTRAINTS) $(if $(LOCK),-c $(LOCK)) -e '.[dev]'; \
	fi
	touch $(STAMP)

RAYLORA := $(VENV)/bin/raylora
DEMO := runs/demo

# Tiny random SD-1.x model + procedurally drawn shapes → 2 CPU workers (DDP) → adapter,
# sample image and loss curve under runs/demo/. A rerun trains afresh.
demo: $(STAMP)
	rm -rf $(DEMO)
	$(RAYLORA) tiny-model $(DEMO)/model
	$(RAYLORA) demo-data $(DEMO)/data
	$(RAYLORA) train jobs/configs/tiny-local.yaml
	$(RAYLORA) sample --model $(DEMO)/model --adapter $(DEMO)/output/adapter \
		--prompt "a red circle on a blue background" --out $(DEMO)/sample.png
	@echo
	@echo "demo outputs:"
	@echo "  adapter      $(DEMO)/output/adapter/  (pytorch_lora_weights.safetensors, README.md, raylora.json, manifest.json)"
	@echo "  sample image $(DEMO)/sample.png"
	@echo "  loss curve   $(DEMO)/output/loss.png"
	@echo "  step metrics $(DEMO)/output/metrics.jsonl"

# Two pytest processes side by side (tests/lanes.py says why); LANES=1 runs one plain pytest.
test: $(STAMP)
	LANES=$(LANES) $(PY) tests/lanes.py $(PYTEST_ARGS)

# Not part of `make test`: each script prints a table and appends it to bench/RESULTS.md.
bench: $(STAMP)
	$(PY) bench/ingest.py
	$(PY) bench/overhead.py
	$(PY) bench/cache.py
	$(PY) bench/epochs.py
	$(PY) bench/download.py
	$(PY) bench/plan.py
	if $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
		$(PY) bench/gpu_throughput.py; \
	else echo "bench: no CUDA device, skipping bench/gpu_throughput.py (try --smoke)"; fi

# For a lent GPU machine (python 3.12, a CUDA torch, no diffusers/peft/pydantic, no index):
# the wheels bench/gpu_session.sh installs there, at the versions CI last passed with, into
# .whl/ (git-ignored; the device tool's `carry: [".whl"]` takes it along).
GPU_WHEELS := diffusers peft pydantic pydantic_core annotated-types typing_extensions typing-inspection
gpu-wheels: $(STAMP)
	rm -rf .whl
	pins=$$(for p in $(GPU_WHEELS); do grep -E "^$$p==" .ci/constraints.txt \
		|| echo "MISSING:$$p"; done); \
	case "$$pins" in *MISSING:*) echo "gpu-wheels: not pinned in .ci/constraints.txt:" \
		$$(echo "$$pins" | grep MISSING) >&2; exit 1;; esac; \
	$(PY) -m pip download -q --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --no-deps -d .whl $$pins
	ls .whl

clean:
	rm -rf runs .pytest_cache
