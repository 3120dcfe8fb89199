# make demo: set up .venv and answer one question with the offline default model.
# make test: run the test suite in a venv of its own (.venv-test), leaving .venv as make demo made it:
# a worker process a core, up to TEST_WORKERS (pytest-xdist), each taking whole test modules, so a
# module's fixtures are built once; OpenBLAS on one thread a process, so that workers, and the
# processes tests start, do not spin on each other's cores.

PYTHON ?= python3
VENV ?= .venv
TEST_VENV ?= .venv-test
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, os.cpu_count() or 1))")
# MLX's Linux CPU wheel bundles the slow reference BLAS; once OpenBLAS is installed, the package
# makes MLX call it instead (llm_paged_mlx_openblas.py).
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/openblas-pthread/libblas.so.3

.PHONY: demo test install openblas clean

demo: install openblas
	$(VENV)/bin/python -m llm_paged_mlx_openblas
	$(VENV)/bin/llm -m paged-smollm2 "What is the capital of France?"

test: openblas $(TEST_VENV)/bin/python
	$(TEST_VENV)/bin/pip install -q -e ".[test]" -e tests/plugin_pkg
	OPENBLAS_NUM_THREADS=1 $(TEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

install: $(VENV)/bin/python
	$(VENV)/bin/pip install -q -e .

%/bin/python:
	$(PYTHON) -m venv $*
	$*/bin/pip install -q --upgrade pip

# On Linux with apt, install OpenBLAS if it is missing (as root, or with passwordless sudo).
openblas:
	@if [ "$$(uname)" = Linux ] && [ ! -e $(OPENBLAS) ] && command -v apt-get >/dev/null; then \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo "sudo -n"); \
	  echo "Installing OpenBLAS (libopenblas0-pthread)"; \
	  ($$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq libopenblas0-pthread) \
	    || echo "Could not install OpenBLAS; MLX will use its slower bundled BLAS"; \
	fi

clean:
	rm -rf $(VENV) $(TEST_VENV)
