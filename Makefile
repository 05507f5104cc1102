# Everything runs from the checkout's own virtual environment, .venv/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install kernels test-deps test parity golden demo clean

# The package alone (what `make demo` needs), and the hand-written kernels' objects.
install: $(BIN)/emit-qwen3vl kernels

$(BIN)/emit-qwen3vl: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	@touch $@

# kernels/q8_matmul.c (--precision q8_0) compiled for AVX-512 VNNI and AVX2 with the system C
# compiler ($CC, cc, gcc or clang) into $QWEN3VL_KERNEL_DIR (default ~/.cache/qwen3vl-kernels);
# cached by a hash of source, flags and compiler, so a rerun builds nothing.
kernels: $(BIN)/emit-qwen3vl
	$(BIN)/python -m kernels

# The test-only dependencies, pinned in pyproject.toml's `test` extra: pytest, and torch,
# transformers and the rest for the checks against the reference implementations.
test-deps: $(VENV)/.test-deps

$(VENV)/.test-deps: pyproject.toml $(BIN)/emit-qwen3vl
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $@

# Two workers, each test file whole on one (its module fixtures built once): 27 min 49 s for
# the suite on a 2-core Zen 4, against 45 min 37 s in one process. A test still running after
# 30 min prints every thread's stack and ends its worker (a hang fails, named, instead of CI's clock).
test: test-deps kernels
	QWEN3VL_REQUIRE_REFERENCES=1 $(BIN)/pytest -q -n 2 --dist loadfile --durations=15 --timeout 1800 --timeout-method thread

# Only the checks against transformers (and the other reference implementations).
parity: test-deps
	$(BIN)/pytest -q -m parity

# The main job with nothing on disk: a deterministic random-weight tiny checkpoint,
# then the vision tower on a shipped image (compiled into demo/cache on first use),
# then a whole answer from a tiny random model with a language model.
demo: install demo/tiny-random/config.json demo/tiny-answer/config.json
	$(BIN)/qwen3vl run --model demo/tiny-random assets/demo.png -o demo/features.safetensors --cache-dir demo/cache
	$(BIN)/qwen3vl generate --model demo/tiny-answer --image assets/demo.png --prompt "Describe the image." \
		--max-new-tokens 16 --json demo/answer.json --cache-dir demo/cache

demo/tiny-random/config.json: | $(BIN)/emit-qwen3vl
	$(BIN)/qwen3vl random-checkpoint demo/tiny-random --preset tiny

# The same with a language model, a tokenizer it trains and a chat template: image and prompt in, answer out.
demo/tiny-answer/config.json: | $(BIN)/emit-qwen3vl
	$(BIN)/qwen3vl random-checkpoint demo/tiny-answer --preset tiny --with-text

golden: install
	$(BIN)/python tests/test_golden.py

clean:
	rm -rf $(VENV) build *.egg-info demo
