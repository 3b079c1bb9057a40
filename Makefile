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

# The main job: train the reference GPT through fxstar, then show the compiler's view of it.
demo: $(BUILT)
	$(BIN)/fxstar train --steps 200
	@mkdir -p build
	@echo "--- the same GPT family, parameters paged through 40% of their bytes ---"
	$(BIN)/fxstar train --steps 20 --width 512 --layers 4 --heads 8 --batch-size 2 \
		--seq-len 32 --device-memory 40% --timeline build/memory_timeline.png
	$(BIN)/fxstar plan fxstar.models.gpt:tiny
	$(BIN)/fxstar diff fxstar.models.gpt:tiny chunk_layout chunk_schedule --device-memory 1MiB \
		> build/demo_diff.txt
	@grep "^+" build/demo_diff.txt | head -n 30; echo "... (the whole diff: build/demo_diff.txt)"
	$(BIN)/python examples/custom_pass.py > build/demo_custom_pass.txt
	@tail -n 1 build/demo_custom_pass.txt

# Every benchmark at its default size, one after another (gpt_setup.py is a helper, not one);
# docs/results.md says how long that takes on 2 cores.
BENCHMARKS := $(filter-out benchmarks/gpt_setup.py,$(sort $(wildcard benchmarks/*.py)))

bench: $(BUILT)
	@set -e; for b in $(BENCHMARKS); do echo "=== $$b"; $(BIN)/python $$b; done

lint: $(BUILT)
	$(BIN)/ruff check fxstar tests benchmarks examples tools
	$(BIN)/ruff format --check fxstar tests benchmarks examples tools

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
