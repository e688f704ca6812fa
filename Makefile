# make install: .venv/ with everything (torch CPU build pinned first); make test: pytest + ruff; make demo: the main job.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast lint docs demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,hub,ray,track,agents,serve]"
	touch $(STAMP)

lint: install
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

test: install lint
	$(PY) -m pytest

# The edit loop: every test that builds or trains no model (about a minute on 2 cores).
test-fast: install
	$(PY) -m pytest -m "not slow"

# Regenerate the README's fault table from the fault tests (make test only checks it).
docs: install
	SAO_WRITE_DOCS=1 $(PY) -m pytest -m faults

# The whole controlled experiment on the CPU stand-in, on the calculator agent (multi-turn episodes, tool
# calls, observation tokens): base evals, both arms, compare, report (~2 min on 2 cores).
demo: install
	$(VENV)/bin/sao selftest
	rm -rf runs/demo
	$(VENV)/bin/sao recipe --preset tiny --env tiny-calc --out runs/demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis runs
