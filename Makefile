# Two entry points on a fresh clone: `make demo` and `make test`. Each creates .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Triton (about 1 GB installed) is for the tests and benchmarks of kdb.triton, not the demo.
TRITON := $(VENV)/.triton
# torch for tests/test_torch.py: the CPU build (about 750 MB installed, a minute here); a
# torch from the registry without a pin pulls about 3 GB of NVIDIA libraries instead.
TORCH_PIN ?= torch==2.13.0
TORCH  := $(VENV)/.torch
# The tests run in 3 processes (pytest-xdist), each test file whole in one of them. Many tests
# wait (for a store worker to finish, a claim to expire) without using CPU; a third process
# fills those waits: on a quiet 2-core machine 8.7 min (914 CPU-s) against 10.0 (884) in 2 and
# 13 in one; beside a CPU hog 14.8 min, as it is then bound by CPU (2026-12-07). A hog in
# another session gets a core of its own whatever the count (the kernel's autogroups).
# PYTEST_JOBS=0: one.
PYTEST_JOBS ?= 3

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[opencl,pack,postgres,test]'
	touch $(STAMP)

$(TRITON): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[triton]'
	touch $(TRITON)

$(TORCH): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[torch]' '$(TORCH_PIN)'
	touch $(TORCH)

setup: $(STAMP)

# OPENCL: pip's PoCL, or where it does not know this CPU, an ICD folder naming one that does
# (tools/default_opencl.py; tests/conftest.py makes the same choice for the tests).
OPENCL = $$($(BIN)/python tools/default_opencl.py --install)

demo: $(STAMP)
	env $(OPENCL) $(BIN)/kdb demo

# BYTECODE: the tests start more than 1,000 Python processes that import kdb from this tree.
# Where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) each would compile
# kdb's modules again, 0.04-0.09 CPU-s a process, and _kdb_auto (KDB_AUTO's hook) 2.5 ms; an
# installed kdb has its bytecode, so the benchmarks measure with it too.
BYTECODE = $(BIN)/python -m compileall -q kdb _kdb_auto.py migrations tests benchmarks tools

test: $(STAMP) $(TRITON) $(TORCH)
	bash tools/ensure_postgres.sh
	bash tools/ensure_hip.sh
	PYTHON=$(BIN)/python bash tools/ensure_opencl.sh
	$(BYTECODE)
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) --dist loadfile --durations=15 $(PYTEST_ARGS)

bench: $(STAMP) $(TRITON) $(TORCH)
	$(BYTECODE)
	env $(OPENCL) $(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build dist *.egg-info
