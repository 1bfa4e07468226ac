# The only two commands a fresh machine needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is installed only when absent: the CPU build where there is no GPU
# (torch==2.13.0 is the CPU wheel on our machines), the default build otherwise.
TORCH_CPU ?= torch==2.13.0
TORCH_GPU ?= torch

.PHONY: demo test install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(BIN)/pip install -q "$(TORCH_GPU)"; \
	  else \
	    $(BIN)/pip install -q "$(TORCH_CPU)"; \
	  fi; \
	fi
	$(BIN)/pip install -q -e ".[test,viz,deepspeed,hf]"
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

clean:
	rm -rf $(VENV) runs *.egg-info
