# `make run`: set up .venv on first use, then run the default job.
# `make test`: set up .venv (with test extras) on first use, then run the whole suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/.installed: setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

.PHONY: run test
run: $(BIN)/.installed
	$(BIN)/megainfer-launch

test: $(BIN)/.installed
	TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests
