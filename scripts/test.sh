#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
. .venv/bin/activate
# Run from the checkout but import the installed package, not ./python.
python -m pytest -q tests "$@"
