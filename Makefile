# `make train` and `make test` work from a fresh clone: they create .venv from a bare
# Python >= 3.11 (override with PYTHON=python3.12), install zerojax with the pinned versions
# of constraints.txt, and run. PYTHON only creates .venv; everything then runs from .venv
# (scripts/bench/launch_local.sh takes ZEROJAX_PYTHON to run zerojax with another interpreter).
PYTHON ?= python3
unexport PYTHON  # make exports command-line variables to recipes; the tests' tools must not see it
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: train test docs install clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "zerojax needs Python >= 3.11, found " + sys.version.split()[0])'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

train: install
	$(BIN)/zerojax train $(ARGS)

test: install
	$(BIN)/python -m pytest $(ARGS)

# The docs/ site (mkdocs.yml) on http://127.0.0.1:8000, rebuilt as pages change; ARGS="-a 0.0.0.0:8000"
# serves it to other machines. tests/test_docs.py builds it with --strict, as CI does.
docs: install
	$(BIN)/python -m mkdocs serve $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
