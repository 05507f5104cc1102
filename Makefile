# Everything runs from the checkout's own virtual environment, .venv/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PARITY_DEPS := torch==2.13.0 transformers==5.24.0

.PHONY: install test parity parity-deps golden demo clean

install: $(BIN)/emit-qwen3vl

$(BIN)/emit-qwen3vl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $@

test: install
	$(BIN)/pytest -q

# torch and transformers only for the parity checks (never imported by the package).
parity-deps: install
	$(BIN)/pip install --quiet $(PARITY_DEPS)

parity: parity-deps
	$(BIN)/pytest -q -m parity

# The main job with nothing on disk: a deterministic random-weight tiny checkpoint,
# then the vision tower on a shipped image (compiled into demo/cache on first use).
demo: install
	$(BIN)/qwen3vl random-checkpoint demo/tiny-random --preset tiny
	$(BIN)/qwen3vl run --model demo/tiny-random assets/demo.png -o demo/features.safetensors --cache-dir demo/cache

golden: install
	$(BIN)/python tests/test_golden.py

clean:
	rm -rf $(VENV) build *.egg-info demo
