# The two commands of the README's contract: `make demo` and `make test`.
# Both create .venv when missing and install what they need; both are idempotent.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.graphkit-installed

.PHONY: demo test docs test-native test-plain-torch test-floors lint typecheck bench bench-envs bench-peers bench-finetune-env bench-finetune bench-lora zoo-table web web-deps clean

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
	$(NATIVE)/bin/python -m pip install --quiet -e ".[dev,cpu,peft]"
	touch $(NATIVE_STAMP)

# The torch bridge (OnnxModule, DDP) on plain onnxruntime, where torch's wheel is (CPython
# 3.11): graphkit's dependencies with its `cpu` extra (plain onnxruntime), and torch; and
# torch's opset-23 exports trained at opset 23 (the native backend's ceiling there).
PLAIN_TORCH       := .venv-plain-torch
PLAIN_TORCH_STAMP := $(PLAIN_TORCH)/.installed

$(PLAIN_TORCH_STAMP): pyproject.toml
	$(PYTHON) -m venv $(PLAIN_TORCH)
	$(PLAIN_TORCH)/bin/python -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); \
	print("\n".join(d["project"]["dependencies"] + d["project"]["optional-dependencies"]["cpu"]))' \
	> $(PLAIN_TORCH)/requirements.txt
	$(PLAIN_TORCH)/bin/python -m pip install --quiet -r $(PLAIN_TORCH)/requirements.txt \
	torch==2.13.0 pytest hypothesis scikit-learn skl2onnx
	$(PLAIN_TORCH)/bin/python -m pip install --quiet --no-deps -e .
	touch $(PLAIN_TORCH_STAMP)

# The floors: graphkit-onnx[cpu] with the lowest release of each dependency that
# pyproject.toml allows (.ci/floors.txt), on the oldest CPython it supports, runs a short
# part of the suite (about a minute, the install included), so that a floor that stops
# holding fails here rather than for a user. Without CPython 3.10 it says so and skips.
FLOORS_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3.10) \
	$(shell command -v python3.10 2>/dev/null))
FLOORS       := .venv-floors
FLOORS_STAMP := $(FLOORS)/.graphkit-installed
FLOORS_TESTS := tests/test_install.py tests/test_fused.py tests/test_counter.py \
	tests/test_decay_factors.py tests/test_training_info.py tests/test_portable_trainer.py \
	tests/test_gradient.py

# made anew each time, so that it holds exactly the floors
$(FLOORS_STAMP): pyproject.toml .ci/floors.txt
	rm -rf $(FLOORS)
	$(FLOORS_PYTHON) -m venv $(FLOORS)
	$(FLOORS)/bin/python -m pip install --quiet -c .ci/floors.txt -e ".[cpu]" pytest hypothesis
	touch $(FLOORS_STAMP)

# The web export's browser tests and benchmark: onnxruntime-web and playwright-core from
# web/package-lock.json (npm ci, again whenever the lockfile changes), and Debian's chromium,
# which playwright-core drives (it never downloads a browser of its own). Without npm, or
# without root or sudo to install chromium, it says so and goes on: those tests then skip,
# naming what is missing (tests/browser.py's browser_missing). CHROMIUM=/path overrides.
WEB_STAMP := web/node_modules/.graphkit-installed
CHROMIUM  ?= /usr/bin/chromium
APT_CHROMIUM := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium

$(WEB_STAMP): web/package.json web/package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --prefix web --no-audit --no-fund && touch $(WEB_STAMP); \
	else echo "web-deps: npm not found: install Node.js 18+ and npm; the browser tests skip"; fi

web-deps: $(WEB_STAMP)
	@if [ -x "$(CHROMIUM)" ]; then exit 0; \
	elif [ "$$(id -u)" = 0 ]; then SUDO=; \
	elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "web-deps: no $(CHROMIUM), and neither root nor sudo to run: $(APT_CHROMIUM);" \
		"the browser tests skip"; exit 0; fi; \
	$$SUDO env $(APT_CHROMIUM) || { $$SUDO apt-get update -q && $$SUDO env $(APT_CHROMIUM); } \
	|| echo "web-deps: installing Debian's chromium failed; the browser tests skip"

# The demo page: the default job's untrained model and rows exported to web/demo/, then
# web/ served on http://127.0.0.1:8000/ (Ctrl-C stops it); the page trains in the browser.
WEB_PORT ?= 8000
web: $(STAMP) web-deps
	$(BIN)/graphkit-train export --web web/demo --epochs 0 --output out/web-demo --quiet
	@echo "open http://127.0.0.1:$(WEB_PORT)/ (Ctrl-C stops the server)"
	$(BIN)/python -m http.server $(WEB_PORT) --bind 127.0.0.1 --directory web

# Reinstall when the dependency list changes. The training build of onnxruntime, so that
# both backends run and check each other; torch==2.13.0 by name, the CPU wheel (no extra
# names torch: on Linux, PyPI's torch pulls CUDA), and with it the references the LoRA and
# language-model tests compare with (PEFT, transformers: both need torch, so no extra
# names them either). `graphkit` is the distribution's name
# before graphkit-onnx: an environment made before the rename drops it.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip uninstall --quiet --yes graphkit 2>/dev/null || true
	$(BIN)/python -m pip install --quiet -e ".[dev,ort-training,docs]" torch==2.13.0 \
	peft==0.21.2 transformers==4.57.6
	touch $(STAMP)

# pytest-xdist workers for the two whole-suite runs (the machine's two cores; 1 runs the
# suite in one process, as it ran before: measured 7:03 one process, 5:20 on two)
PYTEST_WORKERS ?= 2

demo: $(STAMP)
	$(BIN)/graphkit-train --output out/demo

# the later parts' environments, installed two at a time once the main run is over (pip
# keeps about one core busy: plain-torch 38 s and native 42 s one after the other)
LATER_STAMPS = $(PLAIN_TORCH_STAMP) $(if $(NEWEST_PYTHON),$(NATIVE_STAMP)) \
	$(if $(FLOORS_PYTHON),$(FLOORS_STAMP))

test: $(STAMP) $(PLAIN_STAMP) web-deps
	$(MAKE) --no-print-directory typecheck
	$(MAKE) --no-print-directory docs
	GRAPHKIT_PLAIN_ORT_PYTHON=$(PLAIN)/bin/python $(BIN)/python -m pytest tests -n $(PYTEST_WORKERS)
	$(MAKE) --no-print-directory -j2 $(LATER_STAMPS)
	$(MAKE) --no-print-directory test-plain-torch
	$(MAKE) --no-print-directory test-native
	$(MAKE) --no-print-directory test-floors

test-floors:
ifeq ($(FLOORS_PYTHON),)
	@echo "test-floors: no CPython 3.10 found (pyenv or PATH): the dependency floors are not checked"
else
	$(MAKE) --no-print-directory $(FLOORS_STAMP)
	$(FLOORS)/bin/python -m pip check
	$(FLOORS)/bin/python -m pytest $(FLOORS_TESTS)
endif

test-plain-torch: $(PLAIN_TORCH_STAMP)
	$(PLAIN_TORCH)/bin/python -c 'import onnxruntime as o, graphkit.backends as b; \
	assert not hasattr(o.capi._pybind_state, "TrainingAgent") and b.canonical(None) == "native"'
	$(PLAIN_TORCH)/bin/python -m pytest tests/test_forward_backward.py tests/test_distributed.py \
	tests/test_expand_functions.py -k "hybrid or onnx_module_inside_distributed_data_parallel \
	or opset_23"

test-native:
ifeq ($(NEWEST_PYTHON),)
	@echo "test-native: no CPython 3.13 or later found (pyenv or PATH): the native-only half is skipped"
else
	$(MAKE) --no-print-directory $(NATIVE_STAMP)
	GRAPHKIT_PLAIN_ORT_PYTHON=$(NATIVE)/bin/python GRAPHKIT_WEB_TESTS=0 \
	$(NATIVE)/bin/python -m pytest tests -n $(PYTEST_WORKERS) $(NATIVE_SKIPS)
endif

# what the native half leaves to the main run: scikit-learn's estimator checks, the
# optimizer names and the notebooks check conventions no onnxruntime version changes
# (about 95 s of its 370 s of tests), and make test keeps under 15 minutes
NATIVE_SKIPS := --ignore=tests/test_sklearn_protocol.py --ignore=tests/test_names.py \
	--ignore=tests/test_notebooks.py

# The documentation site (mkdocs.yml, docs/) into site/. --strict fails on any warning: a
# broken link or anchor, a missing include, a module mkdocstrings cannot read.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

lint: $(STAMP)
	$(BIN)/ruff check .

# mypy on graphkit and graphkit_train, configured in pyproject.toml's [tool.mypy]
typecheck: $(STAMP)
	$(BIN)/mypy

# regenerate the support table of docs/zoo.md from the model zoo (tests/zoo)
zoo-table: $(STAMP)
	$(BIN)/python -m tests.zoo.run

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py
	$(BIN)/python benchmarks/forward_backward.py
	$(BIN)/python benchmarks/distributed.py

# The peers of benchmarks/peers.py, each in an environment of its own (never a dependency
# of graphkit): JAX + optax, and torch (eager, torch.compile) + onnx2torch. The driver runs
# in .venv and starts every contender in a process of its own, in its environment.
BENCH_JAX         := .venv-bench-jax
BENCH_JAX_STAMP   := $(BENCH_JAX)/.installed
BENCH_TORCH       := .venv-bench-torch
BENCH_TORCH_STAMP := $(BENCH_TORCH)/.installed

$(BENCH_JAX_STAMP):
	$(PYTHON) -m venv $(BENCH_JAX)
	$(BENCH_JAX)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_JAX)/bin/python -m pip install --quiet jax==0.10.2 jaxlib==0.10.2 optax==0.2.8 numpy
	touch $(BENCH_JAX_STAMP)

# torch==2.13.0 is the CPU wheel on this machine's disk (an unpinned torch pulls a CUDA
# build); onnx2torch's torchvision import is stubbed inside its contender's process.
$(BENCH_TORCH_STAMP):
	$(PYTHON) -m venv $(BENCH_TORCH)
	$(BENCH_TORCH)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_TORCH)/bin/python -m pip install --quiet torch==2.13.0 onnx2torch==1.5.15 onnx numpy
	touch $(BENCH_TORCH_STAMP)

bench-envs: $(BENCH_JAX_STAMP) $(BENCH_TORCH_STAMP)

bench-peers: $(STAMP) bench-envs
	$(BIN)/python benchmarks/peers.py

# transformers for benchmarks/finetune.py's Llama rows (the export and the torch contender),
# and peft for benchmarks/lora.py's torch contender;
# torch==2.13.0 by name: the CPU wheel (an unpinned torch pulls CUDA)
BENCH_FINETUNE       := .venv-bench-finetune
BENCH_FINETUNE_STAMP := $(BENCH_FINETUNE)/.installed

$(BENCH_FINETUNE_STAMP):
	$(PYTHON) -m venv $(BENCH_FINETUNE)
	$(BENCH_FINETUNE)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_FINETUNE)/bin/python -m pip install --quiet torch==2.13.0 transformers==4.57.6 \
		peft==0.21.2 onnx numpy psutil
	touch $(BENCH_FINETUNE_STAMP)

bench-finetune-env: $(BENCH_FINETUNE_STAMP)

# one process per contender, run alone on the machine (peak memory of gigabytes)
bench-finetune: $(STAMP) bench-finetune-env
	$(BIN)/python benchmarks/finetune.py

# LoRA against PyTorch + PEFT, one process per contender, alone on the machine too
bench-lora: $(STAMP) bench-finetune-env
	$(BIN)/python benchmarks/lora.py

clean:
	rm -rf $(VENV) $(PLAIN) $(PLAIN_TORCH) $(NATIVE) $(FLOORS) $(BENCH_JAX) $(BENCH_TORCH) $(BENCH_FINETUNE) web/node_modules \
	.pytest_cache .ruff_cache .mypy_cache .hypothesis site
