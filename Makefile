# `make demo`: install, build a corpus, tokenizer and dataset, train a small model and generate from it.
# `make test`: install and run the test suite.
PYTHON ?= python3
DEMO_DIR ?= demo_output

.PHONY: install demo test

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install torch==2.13.0
	$(PYTHON) -m pip install --quiet -e ".[test]"

demo: install
	DEMO_DIR=$(DEMO_DIR) PYTHON=$(PYTHON) bash examples_deepspeed/pretrain_gpt_demo.sh

test: install
	$(PYTHON) -m pytest -q tests
