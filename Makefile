# `make run` and `make test` set everything up themselves: a .venv with the pinned dependencies.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: run test test-all lint bench bench-serve clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/deltaserve serve --host 127.0.0.1 --port 8000 --enable-auto-tool-choice

test: $(STAMP)
	$(BIN)/ruff check deltaserve tests scripts benchmarks
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

lint: $(STAMP)
	$(BIN)/ruff check deltaserve tests scripts benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_engine.py

bench-serve: $(STAMP)
	$(BIN)/python benchmarks/bench_serve.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
