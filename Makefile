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

# The whole test suite (what CI runs).
test: venv
	$(BIN)/python -m pytest

test-fast: venv
	$(BIN)/python -m pytest -m "not slow"

protos: venv
	$(BIN)/python -m protos.generate

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
