# The two set-up-and-run commands of the README. Each installs what it needs on a fresh machine:
# a CPU build of torch when no torch is importable (a GPU box keeps its own), then pxn with its test extra.
PYTHON ?= python3

.PHONY: install bench test
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	@$(PYTHON) -m pip install -q -e ".[test]"

bench: install
	$(PYTHON) -m transport.cli bench

test: install
	$(PYTHON) -m pytest -q
