# The two commands of the README's contract: `make demo` and `make test`.
# Both create .venv when missing and install what they need; both are idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.graphkit-installed

.PHONY: demo test lint bench zoo-table clean

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

# Reinstall when the dependency list changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev,torch]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/graphkit-train --output out/demo

test: $(STAMP) $(PLAIN_STAMP)
	GRAPHKIT_PLAIN_ORT_PYTHON=$(PLAIN)/bin/python $(BIN)/python -m pytest tests

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
	rm -rf $(VENV) $(PLAIN) .pytest_cache .ruff_cache .hypothesis
