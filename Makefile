# Two entry points on a fresh clone: `make demo` and `make test`. Each creates .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Triton (about 1 GB installed) is for the tests and benchmarks of kdb.triton, not the demo.
TRITON := $(VENV)/.triton

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[opencl,pack,postgres,test]'
	touch $(STAMP)

$(TRITON): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[triton]'
	touch $(TRITON)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kdb demo

test: $(STAMP) $(TRITON)
	bash tools/ensure_postgres.sh
	PYTHON=$(BIN)/python bash tools/ensure_opencl.sh
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP) $(TRITON)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build dist *.egg-info
