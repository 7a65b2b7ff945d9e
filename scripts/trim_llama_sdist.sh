#!/usr/bin/env bash
# A small source archive of the pinned llama-cpp-python, for a GPU machine without network
# (scripts/gpu_check.sh with RIVER_GGUF_LLAMA_SDIST=FILE): PyPI's sdist less what no build reads
# (llama.cpp's git data, docs, vocab test files, web UI, benchmarks and tests). Written to
# DIR (default .whl/, which git ignores); prints the archive's path.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36   # keep in step with scripts/setup.sh
OUT=${1:-.whl}
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# --no-build-isolation: pip reads the sdist's metadata with the scikit-build-core at hand, instead
# of building its build tools (cmake among them) from source first.
python3 -m pip download -q --no-deps --no-binary llama-cpp-python --no-build-isolation \
  "llama-cpp-python==$VERSION" -d "$tmp" >&2
tar xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
src="$tmp/llama_cpp_python-$VERSION"
v="$src/vendor/llama.cpp"
rm -rf "$src/.git" "$v/.git" "$v/docs" "$v/tools/ui" "$v/benches" "$v/tests/snapshots" "$v/media" "$v/gguf-py/tests"
find "$v/models" -name '*.gguf' -delete
find "$v/models" -name '*.inp' -delete -o -name '*.out' -delete
tar czf "$OUT/llama_cpp_python-$VERSION.tar.gz" -C "$tmp" "llama_cpp_python-$VERSION"
ls -la "$OUT/llama_cpp_python-$VERSION.tar.gz" >&2
echo "$OUT/llama_cpp_python-$VERSION.tar.gz"
