# specsplit: the two set-up commands are `make demo` and `make test`; both build the venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast protos bench clean

venv: $(STAMP)

# Idempotent: re-installs only when the pinned requirements change.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --config-settings editable_mode=compat -e .
	touch $(STAMP)

# The main job: draft, target and orchestrator on loopback (bundled tiny model, CPU),
# then one streamed generation with its acceptance statistics.
demo: venv
	$(BIN)/specsplit demo

# The whole test suite (what CI runs), on TEST_WORKERS pytest-xdist processes. Nearly every test
# is single-threaded CPU work (runtime.cpu_threads defaults to 1), so two workers use CI's two
# cores. --dist loadfile keeps each test file on one worker: its module/session fixtures (the
# transformers references, the bundled-model engines, the live stack) are built once, not once per
# worker. TEST_WORKERS=0 runs in this process (no workers).
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile)

test: venv
	$(BIN)/python -m pytest $(XDIST)

test-fast: venv
	$(BIN)/python -m pytest $(XDIST) -m "not slow"

protos: venv
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
