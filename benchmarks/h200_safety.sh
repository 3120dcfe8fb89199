#!/usr/bin/env bash
# Issue J on the lent H200: the self-check, transaction and scheduler tests on the GPU, then what the
# safety costs and the engine against mlx-lm's BatchGenerator. Run after ../shared/device/README.md's two
# staging commands, carrying .mlx-cuda-b and .wheels/ (the wheels of hypothesis, sortedcontainers and
# attrs for Python 3.12). About 10 minutes, 8 of them the tests; the whole test suite takes far longer there.
set -uo pipefail
source .mlx-cuda-b/setup.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl
export PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pytest -q -p no:cacheprovider --tb=line -rf tests/test_model_check.py tests/test_transactions.py \
  tests/test_scheduler.py 2>&1 | tail -n 12
python3 benchmarks/safety_costs.py --concurrency 16 64 --rounds 3
python3 benchmarks/engine_throughput.py --concurrency 64 256 --new-tokens 128 --kernels auto --rounds 2 --kv-gib 24
