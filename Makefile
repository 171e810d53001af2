# The two set-up-and-run commands of the README. Each installs what it needs on a fresh machine, once:
# torch when none is importable (a GPU box keeps its own), then pxn from this checkout with its test extra.
#
#   make test                                   # CI runs exactly this (bash .ci/run)
#   make test TORCH_PIP_OPTIONS="--index-url https://download.pytorch.org/whl/cpu"   # CPU-only torch wheel
#   make test PYTHON=/path/to/venv/bin/python   # any interpreter
#
# A Python that pip must not touch (Debian's /usr/bin/python3: "externally-managed-environment", PEP 668) gets
# a virtualenv in .venv first, with the system's packages visible (a system torch is reused, not downloaded).
SYSTEM_PYTHON ?= python3
EXTERNALLY_MANAGED := $(shell $(SYSTEM_PYTHON) -c "import os, sys, sysconfig; \
	print(int(sys.prefix == sys.base_prefix and \
	os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED'))))" 2>/dev/null)
ifeq ($(EXTERNALLY_MANAGED),1)
PYTHON ?= .venv/bin/python
else
PYTHON ?= $(SYSTEM_PYTHON)
endif
TORCH_VERSION ?= 2.13.0
TORCH_PIP_OPTIONS ?=

# pxn counts as installed when its distribution points at this checkout (editable), its dependencies and test
# extra are there, and, where a C compiler and Python's headers are found, its extension is built in this checkout
# (a `git clean -x` removes it and leaves the rest): then `make test` starts the tests at once instead of re-running
# pip (about 15 s). Metadata, find_spec and file tests only: importing torch alone would cost seconds.
INSTALLED_HERE = $(PYTHON) -c "import glob, json, os, shutil, sys, sysconfig as c; \
	import importlib.metadata as m, importlib.util as u; \
	urls = [json.loads(d.read_text('direct_url.json') or '{}').get('url') for d in m.distributions(name='pxn-relay')]; \
	can_build = shutil.which((c.get_config_var('CC') or 'cc').split()[0]) is not None and \
	os.path.exists(os.path.join(c.get_paths()['include'], 'Python.h')); \
	built = glob.glob('transport/_intpack*' + (c.get_config_var('EXT_SUFFIX') or '.so')); \
	sys.exit('file://' + os.path.realpath('.') not in urls or (can_build and not built) or \
	not all(u.find_spec(n) for n in ('torch', 'triton', 'numpy', 'pytest', 'etcd3gw', 'matplotlib')))" 2>/dev/null

.PHONY: install bench test venv
venv:
	@if [ "$(PYTHON)" = ".venv/bin/python" ] && [ ! -x .venv/bin/python ]; then \
		echo "$(SYSTEM_PYTHON) is externally managed: creating the virtualenv .venv"; \
		$(SYSTEM_PYTHON) -m venv --system-site-packages .venv || { \
			echo "make: cannot create .venv (Debian: apt-get install python3-venv), or pass PYTHON=..." >&2; \
			exit 2; }; \
	fi

install: venv
	@$(INSTALLED_HERE) || { \
		$(PYTHON) -c "import torch" 2>/dev/null || { \
			echo "make: installing torch==$(TORCH_VERSION) (no torch importable; a GPU build is several GB)..."; \
			$(PYTHON) -m pip install -q $(TORCH_PIP_OPTIONS) torch==$(TORCH_VERSION) || exit 1; }; \
		echo "make: installing pxn from this checkout with its test extra (pip install -e .[test])..."; \
		$(PYTHON) -m pip install -q -e ".[test]" || exit 1; \
		echo "make: pxn installed"; }

bench: install
	$(PYTHON) -m transport.cli bench

test: install
	$(PYTHON) -m pytest -q
