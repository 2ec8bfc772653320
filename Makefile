# The two commands that matter (see README): `make serve` and `make test`.
# Each sets up what it needs on a fresh machine first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
# The trained demo model committed in the repository (models/stdlib-ds3-tiny/README.md);
# DEMO_MODEL=demo-model serves a random-weight one that `moed model init` builds (below).
DEMO_MODEL ?= models/stdlib-ds3-tiny
HOST ?= 127.0.0.1
PORT ?= 8000

# Where torch comes from. Empty: pip's configured indexes (PyPI serves the CUDA build on Linux;
# a machine whose pip config finds a local CPU wheel, like this project's, gets that one).
# A CPU machine with the PyTorch index: make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: setup setup-serve serve test test-unit bench clean

# Set-up steps print one line per phase; what pip (and the checkpoint writer) print goes to
# SETUP_LOG (pip's warnings fill minutes of screen otherwise). A failed step says so, names
# the log and prints its last lines. STEP runs one command that way.
SETUP_LOG ?= $(VENV)/setup.log
STEP = sh -c 'log=$$1; shift; "$$@" >>"$$log" 2>&1 && exit 0; rc=$$?; \
	echo "moed: failed (exit $$rc): $$*"; echo "moed: the last lines of $$log:"; \
	tail -n 25 "$$log"; exit $$rc' step $(SETUP_LOG)

# Marker files: re-run a step only when the project's dependencies change.
# torch first, pinned: every unpinned torch requirement resolved later (moed's own, nixl's) is
# then already satisfied, so pip never swaps in another build (no CUDA download on a CPU box).
$(VENV)/.torch-done:
	@echo "moed: [torch] torch==$(TORCH_VERSION) into $(VENV) (a few minutes the first time; pip's output: $(SETUP_LOG))"
	@mkdir -p $(VENV)
	@test -x $(PY) || $(STEP) $(PYTHON) -m venv $(VENV)
	@$(STEP) $(PIP) install -q --upgrade pip
	@$(STEP) $(PIP) install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@touch $@

# make serve: the runtime dependencies and the init extra (the demo checkpoint), nothing else.
$(VENV)/.setup-serve: pyproject.toml $(VENV)/.torch-done
	@echo "moed: [moed] moed and its runtime dependencies (pip install -e '.[init]'; output: $(SETUP_LOG))"
	@$(STEP) $(PIP) install -q -e '.[init]'
	@touch $@

# make test (and setup): the test and NIXL extras too.
$(VENV)/.setup-done: pyproject.toml $(VENV)/.torch-done
	@echo "moed: [moed] moed with the init, test and nixl extras (pip install -e '.[init,test,nixl]'; output: $(SETUP_LOG))"
	@$(STEP) $(PIP) install -q -e '.[init,test,nixl]'
	@touch $@

setup-serve: $(VENV)/.setup-serve
setup: $(VENV)/.setup-done

$(DEMO_MODEL)/config.json: | setup-serve
	@echo "moed: [demo model] a random-weight Qwen3-MoE checkpoint in $(DEMO_MODEL)/"
	@$(STEP) $(VENV)/bin/moed model init --arch qwen3_moe --preset tiny --out $(DEMO_MODEL)

serve: setup-serve $(DEMO_MODEL)/config.json
	@echo "moed: [serving] $(DEMO_MODEL) on http://$(HOST):$(PORT) (Ctrl-C drains and stops). Once it logs 'ready', try:"
	@echo "  curl -N http://$(HOST):$(PORT)/v1/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"$(notdir $(DEMO_MODEL))\", \"prompt\": \"def fib(n):\", \"max_tokens\": 16, \"stream\": true}'"
	exec $(VENV)/bin/moed serve --config conf/moed.toml --model $(DEMO_MODEL) --host $(HOST) --port $(PORT)

# The unit tests run in TEST_WORKERS processes (pytest-xdist, a file to a worker, in order), the
# integration tests one at a time: those start servers that use every core, the unit tests
# mostly one each (tests/conftest.py sets OMP_NUM_THREADS=1). On 2 cores the unit half takes
# ~3.5 min instead of ~5.5. Both halves run; either failing fails the target.
TEST_WORKERS ?= 2
PYTEST_UNIT = $(PY) -m pytest -q -ra --durations=10 --durations-min=5 -n $(TEST_WORKERS) --dist loadfile tests/unit

test: setup
	@rc=0; $(PYTEST_UNIT) || rc=$$?; \
	$(PY) -m pytest -q -ra --durations=20 --durations-min=10 tests --ignore=tests/unit || rc=$$?; \
	exit $$rc

test-unit: setup
	$(PYTEST_UNIT)

bench: setup
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) demo-model .pytest_cache

# One router + 2 prefill + 2 decode on 127.0.0.1 with conf/{router,prefill,decode}.toml
# (docs/cluster.md); Ctrl-C stops all five. CLUSTER_ARGS: e.g. --port-offset 1000.
.PHONY: cluster
cluster: setup
	exec $(PY) -m moed.dev.cluster --model $(DEMO_MODEL) $(CLUSTER_ARGS)
