# The two commands of the README's contract: `make demo` and `make test`.
# Both create .venv when missing and install what they need; both are idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.graphkit-installed

.PHONY: demo test test-native lint bench zoo-table clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Plain onnxruntime (the latest release) in an environment of its own: it shares its
# import name with onnxruntime-training, so the two never meet. The suite runs graphkit's
# exported training there (tests/test_plain_onnxruntime.py).
PLAIN       := .venv-plain-ort
PLAIN_STAMP := $(PLAIN)/.installed

$(PLAIN_STAMP):
	$(PYTHON) -m venv $(PLAIN)
	$(PLAIN)/bin/python -m pip install --quiet onnxruntime numpy onnx
	touch $(PLAIN_STAMP)

# The native backend alone, on the newest CPython this machine has among 3.13 and later
# (no onnxruntime-training wheel exists there): plain onnxruntime, no torch. `make test`
# runs the suite there too; without such a Python it says so and skips that half.
NEWEST_PYTHON ?= $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.1[3-9]*/bin/python3.1[3-9]) \
	$(shell command -v python3.13 python3.14 2>/dev/null)))
NATIVE       := .venv-native
NATIVE_STAMP := $(NATIVE)/.graphkit-installed

$(NATIVE_STAMP): pyproject.toml
	$(NEWEST_PYTHON) -m venv $(NATIVE)
	$(NATIVE)/bin/python -m pip install --quiet --upgrade pip
	$(NATIVE)/bin/python -m pip install --quiet -e ".[dev]"
	touch $(NATIVE_STAMP)

# Reinstall when the dependency list changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev,torch]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/graphkit-train --output out/demo

test: $(STAMP) $(PLAIN_STAMP)
	GRAPHKIT_PLAIN_ORT_PYTHON=$(PLAIN)/bin/python $(BIN)/python -m pytest tests
	$(MAKE) --no-print-directory test-native

test-native:
ifeq ($(NEWEST_PYTHON),)
	@echo "test-native: no CPython 3.13 or later found (pyenv or PATH): the native-only half is skipped"
else
	$(MAKE) --no-print-directory $(NATIVE_STAMP)
	GRAPHKIT_PLAIN_ORT_PYTHON=$(NATIVE)/bin/python $(NATIVE)/bin/python -m pytest tests
endif

lint: $(STAMP)
	$(BIN)/ruff check .

# regenerate the README's support table from the model zoo (tests/zoo)
zoo-table: $(STAMP)
	$(BIN)/python -m tests.zoo.run

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py
	$(BIN)/python benchmarks/forward_backward.py
	$(BIN)/python benchmarks/distributed.py

clean:
	rm -rf $(VENV) $(PLAIN) $(NATIVE) .pytest_cache .ruff_cache .hypothesis
