# `make demo`: install, build a corpus, tokenizer and dataset, train a small model and generate from it.
# `make test`: install, lint (ruff check, ruff format --check) and run the test suite.
#
# Everything is installed into a virtual environment, .venv/ (created on first use with
# $(BASE_PYTHON) -m venv), so a system Python that refuses pip installs (PEP 668,
# "externally-managed-environment") is never touched. With a virtual environment already active
# (VIRTUAL_ENV set) that one is used instead; `make PYTHON=/path/to/python ...` picks any interpreter.
#
# torch is installed first, only when the interpreter has none: the CPU build where no
# nvidia-smi is on PATH, the default (CUDA) build where one is. Choose by hand with
# TORCH_VARIANT=cpu|cuda, or point TORCH_INDEX_URL at any index (empty: pip's default index).
BASE_PYTHON ?= python3
VENV ?= .venv
# PYTHON only from make's command line: a PYTHON in the environment (some tools, node-gyp among
# them, want one) must not send pip to the system interpreter.
ifneq ($(origin PYTHON),command line)
ifdef VIRTUAL_ENV
PYTHON := $(VIRTUAL_ENV)/bin/python
else
PYTHON := $(VENV)/bin/python
endif
endif
DEMO_DIR ?= demo_output

TORCH_VERSION ?= 2.13.0
TORCH_VARIANT ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
ifeq ($(TORCH_VARIANT),cpu)
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
else ifeq ($(TORCH_VARIANT),cuda)
TORCH_INDEX_URL ?=
else
$(error TORCH_VARIANT=$(TORCH_VARIANT) is not one of cpu, cuda; pass TORCH_VARIANT=cpu or TORCH_VARIANT=cuda)
endif
# The build's own index is asked for torch alone (--no-deps: one page, short timeouts, so an index
# that does not answer costs seconds, not minutes of retries); the second pip then takes torch's
# dependencies from pip's default index, or torch itself where the first one failed.
TORCH_PIP_TIMEOUT ?= 10
ifneq ($(strip $(TORCH_INDEX_URL)),)
INSTALL_TORCH = { $(PYTHON) -m pip install --no-deps --timeout $(TORCH_PIP_TIMEOUT) --retries 1 \
	  --index-url $(TORCH_INDEX_URL) torch==$(TORCH_VERSION) \
	  || echo "note: $(TORCH_INDEX_URL) did not serve torch==$(TORCH_VERSION); trying pip's default index (on Linux x86_64 that is a CUDA build of several GB)"; } \
	&& $(PYTHON) -m pip install torch==$(TORCH_VERSION)
else
INSTALL_TORCH = $(PYTHON) -m pip install torch==$(TORCH_VERSION)
endif

.PHONY: install demo test test-fast lint

# The virtual environment, unless PYTHON points elsewhere. A failed `venv` (Debian without the
# python3-venv package) leaves a half-made folder: remove it, so the next run tries again.
$(VENV)/bin/python:
	@echo "$(BASE_PYTHON) -m venv $(VENV)"
	@$(BASE_PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	  echo "error: could not create the virtual environment $(VENV) with $(BASE_PYTHON) -m venv; install Python's venv module (Debian/Ubuntu: apt-get install python3-venv) or activate a virtual environment first." >&2; \
	  exit 1; }

# The package is installed editable, so Python changes need no reinstall; a stamp per interpreter
# remembers the install, and only a change to what pip builds from (setup.py, pyproject.toml, the
# C++ sources) or a new interpreter runs pip again. `make install FORCE_INSTALL=1` always does.
INSTALL_STAMP := build/installed-$(shell printf '%s' '$(abspath $(PYTHON))' | cksum | cut -d' ' -f1)
INSTALL_INPUTS := setup.py pyproject.toml MANIFEST.in $(wildcard csrc/*/*.cpp csrc/*/*.h) \
	$(if $(filter $(VENV)/bin/python,$(PYTHON)),$(VENV)/bin/python)
ifdef FORCE_INSTALL
.PHONY: $(INSTALL_STAMP)
endif

$(INSTALL_STAMP): $(INSTALL_INPUTS)
	@$(PYTHON) -c "import torch" 2>/dev/null || { echo "== installing torch $(TORCH_VERSION), $(TORCH_VARIANT) build"; $(INSTALL_TORCH); }
	@echo "== installing megatron-moe and its dependencies; compiling its C++ ops takes about half a minute"
	$(PYTHON) -m pip install -e ".[test]"
	@mkdir -p build && touch $@

# A stamp whose install was removed since (pip uninstall, a deleted .venv) is not trusted.
install:
	@$(PYTHON) -I -c "import megatron.ops.op_builder" 2>/dev/null || rm -f $(INSTALL_STAMP)
	@$(MAKE) -s --no-print-directory $(INSTALL_STAMP)

demo: install
	DEMO_DIR=$(DEMO_DIR) PYTHON=$(PYTHON) bash examples_deepspeed/pretrain_gpt_demo.sh

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

test: lint
	$(PYTHON) -m pytest -q tests

# the unit tier only: no process groups, trainers or subprocesses (under a minute on 2 cores)
test-fast: install
	$(PYTHON) -m pytest -q -m unit tests
