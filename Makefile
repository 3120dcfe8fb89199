# make demo: set up .venv and answer one question with the offline default model.
# make test: set up .venv with the test dependencies and run the test suite.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
# MLX's Linux CPU wheel uses the reference BLAS; OpenBLAS, when installed, is much faster.
WITH_BLAS = env $$([ -e $(OPENBLAS) ] && echo LD_PRELOAD=$(OPENBLAS))
# Where the tests keep the converted SmolLM2 between runs.
TEST_CACHE ?= $(HOME)/.cache/llm-paged-mlx/models

.PHONY: demo test install openblas clean

demo: install openblas
	$(WITH_BLAS) $(BIN)/llm -m paged-smollm2 "What is the capital of France?"

test: openblas $(BIN)/python
	$(BIN)/pip install -q -e ".[test]"
	if [ -d tests/plugin_pkg ]; then $(BIN)/pip install -q -e tests/plugin_pkg; fi
	LLM_PAGED_MLX_CACHE="$${LLM_PAGED_MLX_CACHE:-$(TEST_CACHE)}" $(WITH_BLAS) $(BIN)/python -m pytest -q

install: $(BIN)/python
	$(BIN)/pip install -q -e .

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# On Linux with apt, install OpenBLAS if it is missing (as root, or with passwordless sudo).
openblas:
	@if [ "$$(uname)" = Linux ] && [ ! -e $(OPENBLAS) ] && command -v apt-get >/dev/null; then \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
	  echo "Installing OpenBLAS (libopenblas0-pthread)"; \
	  ($$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq libopenblas0-pthread) \
	    || echo "Could not install OpenBLAS; MLX will use its slower bundled BLAS"; \
	fi

clean:
	rm -rf $(VENV)
