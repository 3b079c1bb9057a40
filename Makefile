# `make test` and `make demo` work from a fresh clone with nothing but Python 3.10+ installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch that lies on this machine's disk; never let an install pull another.
TORCH  := torch==2.13.0
DEPS   := $(VENV)/.deps-installed
BUILT  := $(VENV)/.fxstar-built
SOURCES := pyproject.toml CMakeLists.txt $(shell find csrc -type f 2>/dev/null)

.PHONY: test test-all demo bench lint build clean

test: $(BUILT)
	$(BIN)/python -m pytest

test-all: $(BUILT)
	$(BIN)/python -m pytest -m ''

demo: $(BUILT)
	$(BIN)/python benchmarks/adam.py --sizes 1M,16M --rounds 3

bench: $(BUILT)
	$(BIN)/python benchmarks/adam.py

lint: $(BUILT)
	$(BIN)/ruff check fxstar tests benchmarks examples
	$(BIN)/ruff format --check fxstar tests benchmarks examples

build: $(BUILT)

$(DEPS):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(TORCH)
	$(BIN)/pip install --quiet --disable-pip-version-check scikit-build-core pybind11 cmake ninja
	touch $@

# Editable install; the C++ core rebuilds incrementally in build/ when its sources change.
$(BUILT): $(DEPS) $(SOURCES)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-build-isolation -e '.[test]' $(TORCH)
	touch $@

clean:
	rm -rf build $(VENV) .pytest_cache .ruff_cache .hypothesis
