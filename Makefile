# The two commands that matter (see README): `make serve` and `make test`.
# Each sets up what it needs on a fresh machine first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
DEMO_MODEL ?= demo-model
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup serve test test-unit bench clean

# Marker file: re-run setup only when the project's dependencies change.
$(VENV)/.setup-done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: on a CPU machine this is the local CPU wheel; any unpinned
	# requirement resolved later is then already satisfied (no CUDA download).
	$(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e '.[test,nixl]'
	touch $@

setup: $(VENV)/.setup-done

$(DEMO_MODEL)/config.json: | setup
	$(VENV)/bin/moed model init --arch qwen3_moe --preset tiny --out $(DEMO_MODEL)

serve: setup $(DEMO_MODEL)/config.json
	@echo "moed: serving $(DEMO_MODEL) on http://$(HOST):$(PORT) (Ctrl-C drains and stops). Once it logs 'ready', try:"
	@echo "  curl -N http://$(HOST):$(PORT)/v1/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"$(notdir $(DEMO_MODEL))\", \"prompt\": \"def fib(n):\", \"max_tokens\": 16, \"stream\": true}'"
	exec $(VENV)/bin/moed serve --config conf/moed.toml --model $(DEMO_MODEL) --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m pytest -q -ra tests

test-unit: setup
	$(PY) -m pytest -q -ra tests/unit

bench: setup
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) $(DEMO_MODEL) .pytest_cache
