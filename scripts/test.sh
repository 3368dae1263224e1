#!/usr/bin/env bash
# The test command of README.md: install the pinned set and run the suite on 2 CPU workers.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -r requirements-test.txt -e .
export OPENBLAS_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=3
# A test that hangs fails after 15 minutes instead of stalling CI.
exec python -m pytest tests -n 2 -q --durations=15 --timeout=900 "$@"
