#!/usr/bin/env bash
# Builds llama.cpp's own command-line tools from the source archive of the pinned
# llama-cpp-python, so that a benchmark can compare with them on the same text and the same ggml:
# benchmarks/imatrix_cost.py runs llama-imatrix beside the converter's imatrix, and
# benchmarks/lossless_speed.py runs llama-speculative beside lossless mode, and
# benchmarks/parallel_throughput.py runs llama-server beside `river-gguf serve --parallel`.
# The binaries go to .cache/llama-tools/build/bin (ignored by git). About 10 minutes on 2 cores.
#   ./scripts/build_llama_tools.sh [TARGET ...]   (default: llama-imatrix llama-quantize llama-speculative llama-server)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(sed -n 's/^LLAMA_CPP_PYTHON_VERSION=\([0-9.]*\).*/\1/p' scripts/setup.sh)
DIR=.cache/llama-tools
TARGETS=("$@"); [ ${#TARGETS[@]} -gt 0 ] || TARGETS=(llama-imatrix llama-quantize llama-speculative llama-server)
mkdir -p "$DIR"
SDIST=${RIVER_GGUF_LLAMA_SDIST:-}
if [ -z "$SDIST" ]; then
  SDIST=$(ls "$DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)
  if [ -z "$SDIST" ]; then
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DIR"
    SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
  fi
fi
SRC="$DIR/llama_cpp_python-$VERSION"
[ -d "$SRC/vendor/llama.cpp" ] || tar xzf "$SDIST" -C "$DIR"
# The same CPU flags as setup.sh's llama-cpp-python build (no AMX kernels: see there).
# llama-server is built without its web UI (the UI step would download prebuilt assets) and
# without OpenSSL (the benchmark talks plain HTTP on localhost).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$SRC/vendor/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >/dev/null
cmake --build "$DIR/build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" --target "${TARGETS[@]}" >/dev/null
for t in "${TARGETS[@]}"; do echo "$DIR/build/bin/$t"; done
