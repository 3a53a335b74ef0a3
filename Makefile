# The two commands: `make demo` and `make test`. Everything else is a step they depend on.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv data demo test lint bench clean

# torch first, pinned: installing the project alone would let pip pick whatever torch build it resolves to.
venv: $(STAMP)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e ".[dev]"
	touch $@

# The only networked step: the bundled corpus (sha256-verified), tokenized once into the cache.
data: venv
	$(BIN)/hetero-node data fetch

demo: venv data
	$(BIN)/hetero-node demo

test: venv data
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The default benchmark scenario (needs root: network namespaces): hetero topology, small preset, all five methods,
# 3 rounds x H = 10; about 17 min on 2 cores, 7.5 of them ddp's (a dense all-reduce of ~15 s per step at 50 Mbit/s).
bench: venv data
	$(BIN)/hetero-node bench --topology hetero --preset small --rounds 3 --inner-steps 10 \
		--out bench/results/hetero

# Back to a fresh clone (the corpus cache under $$HETERO_NODE_CACHE is kept: it is not in the repository).
clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis protocol/_generated
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
