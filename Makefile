# The only two commands a fresh machine needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is installed only when absent, never reinstalled: a torch the system Python already has is
# used as it is (the venv then sees the system's packages: a GPU machine's preinstalled CUDA build);
# otherwise the CPU build where there is no GPU (torch==2.13.0 is the CPU wheel on our machines) and
# the pinned default (CUDA) build where there is one. Both pins lie inside pyproject.toml's range
# (tests/test_torch_range.py checks).
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch==2.11.0
# make gpu-check: the Python with CUDA torch (the venv's when it imports torch, else the system's) and
# the part to run: default (the most telling figures, within 5 minutes on one H100, each step under its own
# cap) or a named part within 8 minutes: launches, sweeps, compile, ladders, lora, fp8 (benchmarks/gpu_check.py --plan lists them);
# GPU_CHECK_ARGS: more of its flags (--out FILE, --profile NAME|FILE)
GPU_PYTHON ?= $(shell $(BIN)/python -c "import torch" 2>/dev/null && echo $(BIN)/python || echo $(PYTHON))
PART ?= default
GPU_CHECK_ARGS ?=

.PHONY: demo test install clean gpu-check

$(BIN)/python:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV); \
	fi

$(VENV)/.installed: $(BIN)/python pyproject.toml
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(BIN)/pip install -q "$(TORCH_GPU)"; \
	  else \
	    $(BIN)/pip install -q "$(TORCH_CPU)"; \
	  fi; \
	fi
	$(BIN)/pip install -q -e ".[test,viz,deepspeed,hf,fp8]"
	@touch $@

install: $(VENV)/.installed

# resume=true: a second `make demo` continues (or just reports) the first one's run instead of
# being refused for writing a fresh run over its checkpoints; an interrupted demo picks up where it stopped.
# Then a sample of what it learned, and its curves in runs/quickstart/curves.png.
demo: install
	$(BIN)/parallel4d launch configs/quickstart.yaml --set train.resume=true
	$(BIN)/parallel4d plot runs/quickstart
	@echo "--- a sample of the quickstart model (parallel4d generate runs/quickstart --prompt 'def '):"
	@$(BIN)/parallel4d generate runs/quickstart --prompt "def " --max-new-tokens 200 --seed 0

test: install
	$(BIN)/python -m pytest -q --durations=15 tests

# On a machine with a GPU and torch installed: the GPU-marked tests and the GPU benchmarks with the planner's
# predictions beside them, into one benchmarks/results/gpu_check[_PART].json (benchmarks/gpu_check.py).
# Installs nothing (no venv step: the machine may have no package index; carry wheels, docs/benchmarks.md).
# Without a GPU: prints what it would run.
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py --part $(PART) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs *.egg-info
