# The two front-door commands:
#   make demo   set up, then train the example Transformer LM on this machine
#   make test   set up, then lint, type-check and run the tests of the quick tier: every in-process test and
#               one end-to-end test per user path (marker `path`), within minutes; what CI runs
#   make test-all   the same with every test (the `full` tier too: each end-to-end, service, fault and
#               network test)
SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-all test-fast lint typecheck protos clean gpu-check gpu-wheels soak

# worker/dataplane/_ring.c: the install builds it (an editable install does not rebuild it by itself).
$(STAMP): pyproject.toml worker/dataplane/_ring.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is this machine's CPU wheel; never let pip reach for a CUDA build.
	$(BIN)/pip install -q torch==2.13.0 -e '.[service,test,data]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/gpipe-coordinator run examples/charlm.yaml

lint: setup
	$(BIN)/ruff check .

# Settings in pyproject.toml [tool.mypy]: strict on most modules.
typecheck: setup
	$(BIN)/python .ci/typecheck.py

# TEST_WORKERS pytest-xdist processes share the tests (most of a test's time is its processes starting
# and waiting); tests that share a module's serve stay on one (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 5  # on 2 cores: many tests mostly wait (heartbeats, grace periods, restarts)

# mypy runs beside the tests (the tests' processes leave a core idle while they wait); its report follows
# theirs, and their closing line is said again last. $(1): which tests (pytest's -m), empty for all.
define suite
	@$(BIN)/python .ci/typecheck.py > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(BIN)/pytest -q -rs -n $(TEST_WORKERS) --dist loadgroup $(1) 2>&1 | tee $(VENV)/pytest.log; \
	tests=$${PIPESTATUS[0]}; wait $$types; typed=$$?; \
	echo "mypy: $$(tail -n 1 $(VENV)/mypy.log)"; test $$typed -eq 0 || cat $(VENV)/mypy.log; \
	tail -n 1 $(VENV)/pytest.log; test $$tests -eq 0 -a $$typed -eq 0
endef

test: lint
	$(call suite,-m "not full")

test-all: lint
	$(call suite,)

test-fast: setup
	$(BIN)/pytest -q -m "not multiprocess" -n $(TEST_WORKERS) --dist loadgroup

# An hour of mixed faults on four jobs in one pool (bench/soak.py; root: network namespaces and a tmpfs).
# SOAK_MINUTES, SOAK_FAULTS, SOAK_SEED change it; tests/service/test_soak.py is its five-minute version.
SOAK_MINUTES ?= 60
SOAK_FAULTS ?= 100
SOAK_SEED ?= 1
soak: setup
	$(BIN)/python bench/soak.py --minutes $(SOAK_MINUTES) --faults $(SOAK_FAULTS) --seed $(SOAK_SEED)

# On a GPU host, from the repository root: the CUDA checks (bench/gpu-check.sh), on the host's own CUDA torch,
# with the other packages from .gpucheck/whl, which `make gpu-wheels` fills where a package index answers.
gpu-check:
	bash bench/gpu-check.sh

gpu-wheels:
	bash bench/gpu-check.sh --prepare

# Regenerate gpipe/service/v1 from protos/ (tests/project/test_protos.py fails when it is stale).
protos: setup
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/gpipe/service/v1/*.proto

clean:
	rm -rf $(VENV) gpipe-state gpipe-service gpipe-worker-logs .pytest_cache .ruff_cache .mypy_cache
