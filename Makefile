# Two commands from a fresh clone: `make test` and `make demo`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch lies in /opt/wheels on the reference machines.
PIP_INSTALL := $(BIN)/python -m pip install -c constraints.txt $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
STAMP := $(VENV)/.kvshare-installed
PYTEST_ARGS ?=
# pytest-xdist workers, one OpenMP thread each (tests/conftest.py): most of the suite's time is
# single-threaded (Inductor compiles, subprocesses), so two workers fit two cores
TEST_WORKERS ?= 2

.PHONY: install test demo lock clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/kvshare story

# Re-pin constraints.txt to what the venv holds now (torch stays at the release, not +cpu).
lock: $(STAMP)
	{ echo "# Exact versions the install uses (make install / make test pass -c constraints.txt)."; \
	  echo "# Regenerate with 'make lock' after changing dependencies."; \
	  echo "torch==2.13.0"; \
	  $(BIN)/python -m pip freeze --exclude-editable | grep -v -E '^(torch|kvshare)=='; } > constraints.txt

clean:
	rm -rf $(VENV) build *.egg-info
