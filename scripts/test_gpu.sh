#!/usr/bin/env bash
# The GPU test module (tests_gpu/) on a GPU build of its own: RIVER_GGUF_GPU=vulkan (the default)
# or cuda, in RIVER_GGUF_VENV (default .venv-vulkan / .venv-cuda), made by scripts/setup.sh.
# With no GPU, Vulkan runs on Mesa's lavapipe, a Vulkan driver on the CPU (GGML_VK_VISIBLE_DEVICES=0
# lets ggml use it): this is how CI tests the device path. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export RIVER_GGUF_GPU=${RIVER_GGUF_GPU:-vulkan}
export RIVER_GGUF_VENV=${RIVER_GGUF_VENV:-.venv-$RIVER_GGUF_GPU}
if [ "$RIVER_GGUF_GPU" = vulkan ]; then
  # The Vulkan loader, lavapipe, the shader compiler and the SPIR-V headers (ggml-vulkan's CMake
  # finds them as a package: find_package(SPIRV-Headers CONFIG REQUIRED)), from Debian (root
  # only; else say what is missing).
  need=()
  for p in libvulkan1 mesa-vulkan-drivers glslc spirv-headers; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
  if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
      apt-get install -y -q "${need[@]}" >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null; }
    else
      echo "install ${need[*]} (Debian packages) first" >&2; exit 2
    fi
  fi
  export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
fi
./scripts/setup.sh
# One process per test (scripts/pytest_each.sh). On lavapipe a long process of device models
# corrupts the C heap now and then (glibc's checker, LD_PRELOAD=libc_malloc_debug.so.0
# MALLOC_CHECK_=3, catches it in lavapipe's own thread as it allocates device memory; which write
# does it is not found, see docs/gpu.md), and the segfault that follows lands in whichever test
# runs then. A process per test keeps each test's verdict its own, and a crash names the test it
# happened in.
exec ./scripts/pytest_each.sh "$RIVER_GGUF_VENV/bin/python" tests_gpu "$@"
