#!/usr/bin/env bash
# Builds llama.cpp's llama-quantize from the pinned llama-cpp-python's source, against the libllama
# and ggml that .venv's llama-cpp-python installed (the same code the converter's quantizer runs):
# the tests compare the converter's river with what this binary writes (tests/convert/test_imatrix.py).
# It compiles five files (the tool, its imatrix loader, the logger and its JSON writer, the build
# info) and scripts/llama_quantize/common_rest.cpp instead of all of llama.cpp: about 15 s of CPU,
# where scripts/build_llama_tools.sh's full build of the tools takes about 10 minutes on 2 cores.
# The binary goes to .cache/llama-tools/quantize/llama-quantize (ignored by git); a binary newer
# than its inputs is kept. Run after scripts/setup.sh.
#   ./scripts/build_llama_quantize.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(sed -n 's/^LLAMA_CPP_PYTHON_VERSION=\([0-9.]*\).*/\1/p' scripts/setup.sh)
DIR=.cache/llama-tools
OUT=$DIR/quantize
BIN=$OUT/llama-quantize
LIB=$(.venv/bin/python -c "import llama_cpp, os; print(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib'))")
SHIM=scripts/llama_quantize/common_rest.cpp
if [ -x "$BIN" ] && [ "$BIN" -nt "$LIB/libllama.so" ] && [ "$BIN" -nt "$SHIM" ] && [ "$BIN" -nt "$0" ]; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$OUT"
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/tools/quantize/quantize.cpp" ]; then
  SDIST=${RIVER_GGUF_LLAMA_SDIST:-$(ls "$DIR"/llama_cpp_python-"$VERSION".tar.gz 2>/dev/null || true)}
  if [ -z "$SDIST" ]; then
    .venv/bin/python -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DIR"
    SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
  fi
  tar xzf "$SDIST" -C "$DIR"
fi
sed -e 's/@LLAMA_BUILD_NUMBER@/0/' -e "s/@LLAMA_BUILD_COMMIT@/llama-cpp-python-$VERSION/" \
    -e 's/@BUILD_COMPILER@/c++/' -e 's/@BUILD_TARGET@/host/' "$SRC/common/build-info.cpp.in" > "$OUT/build-info.cpp"
${CXX:-c++} -O2 -std=c++17 -I"$SRC/include" -I"$SRC/ggml/include" -I"$SRC/common" -I"$SRC/tools/quantize" \
  -I"$SRC/vendor" "$SRC/tools/quantize/main.cpp" "$SRC/tools/quantize/quantize.cpp" \
  "$SRC/common/imatrix-loader.cpp" "$SRC/common/log.cpp" "$SRC/common/json.cpp" "$SHIM" "$OUT/build-info.cpp" \
  -L"$LIB" -lllama -lggml -lggml-base -Wl,-rpath,"$LIB" -lpthread -o "$BIN.tmp"
mv "$BIN.tmp" "$BIN"
echo "$BIN"
