#!/usr/bin/env bash
# pytest_each.sh PYTHON TESTS [PYTEST_ARGS...]: runs each test that pytest collects from TESTS in a
# process of its own (JUNIT_DIR, when set: a JUnit file per test there, numbered in order), then
# says how many passed and names the ones that did not. Exits 1 when one failed or none was
# collected. scripts/test_gpu.sh and gpu_device_run.sh run tests_gpu/ this way on lavapipe, whose
# heap corruption in a long process of device models would otherwise crash whichever test runs
# next (docs/gpu.md).
set -uo pipefail
PY=$1 TESTS=$2
shift 2
COLLECTED=$("$PY" -m pytest -q -p no:cacheprovider --collect-only "$TESTS" "$@" 2>&1) || { echo "$COLLECTED" >&2; exit 1; }
mapfile -t IDS < <(grep '::' <<<"$COLLECTED")
[ ${#IDS[@]} -gt 0 ] || { echo "$COLLECTED" >&2; echo "no tests collected from $TESTS" >&2; exit 1; }
[ -n "${JUNIT_DIR:-}" ] && mkdir -p "$JUNIT_DIR"
failed=()
for i in "${!IDS[@]}"; do
  junit=()
  [ -n "${JUNIT_DIR:-}" ] && junit=(--junitxml="$JUNIT_DIR/$((i + 1)).xml")
  "$PY" -m pytest -q -p no:cacheprovider "$@" "${junit[@]}" "${IDS[$i]}" || failed+=("${IDS[$i]}")
done
echo "$TESTS: $(( ${#IDS[@]} - ${#failed[@]} )) of ${#IDS[@]} passed, each in its own process"
if [ ${#failed[@]} -gt 0 ]; then printf 'failed: %s\n' "${failed[@]}" >&2; exit 1; fi
