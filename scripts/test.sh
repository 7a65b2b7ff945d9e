#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite: the tests in pytest-xdist's workers, one a
# core (TEST_WORKERS, default the core count up to 4; 0 runs them in this process), then the tests
# marked `alone` (they time or measure the process) one at a time. Extra arguments go to both runs,
# e.g. a folder (tests/convert), -k EXPR, or --random-order (pytest-random-order: a shuffled run).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/build_llama_quantize.sh >/dev/null  # llama.cpp's llama-quantize, which a test compares with
. .venv/bin/activate
WORKERS=${TEST_WORKERS:-$(python -c "import os; print(min(os.cpu_count() or 1, 4))")}
# Run from the checkout but import the installed package, not ./python.
rc=0
if [ "$WORKERS" -gt 1 ]; then
  # One thread a worker (tests/conftest.py says why). Each worker takes whole files, in the order
  # tests/conftest.py puts them (the longest first; xdist's own reorder, by test count, is off).
  OMP_THREAD_LIMIT=1 OPENBLAS_NUM_THREADS=1 python -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder \
    -m "not alone" tests "$@" || rc=$?
else
  python -m pytest -q -m "not alone" tests "$@" || rc=$?
fi
alone=0
python -m pytest -q -m alone tests "$@" || alone=$?
# pytest's 5 is "no tests collected": one of the two runs may have none; both none is a failure.
if [ "$rc" = 5 ] && [ "$alone" = 5 ]; then exit 5; fi
[ "$rc" = 5 ] && rc=0
[ "$alone" = 5 ] && alone=0
[ "$rc" = 0 ] && [ "$alone" = 0 ]
