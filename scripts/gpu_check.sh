#!/usr/bin/env bash
# River on a GPU in one command: build the GPU variant (llama-cpp-python with CUDA or Vulkan, RPC
# on, and the engine against it, in a venv of its own), run the GPU test module (tests_gpu/), then
# print decode tok/s with every layer, the head, the river and the KV cache offloaded, beside
# llama.cpp's own offload of the same files, timed in the same run.
#
#   ./scripts/gpu_check.sh                          # CUDA, for the GPU at hand
#   RIVER_GGUF_GPU=vulkan ./scripts/gpu_check.sh    # Vulkan (on Mesa's lavapipe when there is no GPU)
#
# Per model (RIVER_GGUF_GPU_MODELS, default "smollm2 qwen2.5-coder-0.5b") the table has: the
# default River GGUF's backbone and llama.cpp's file of that type, river-only and llama.cpp's Q4_0,
# every preset, tau 0.97, and the cost of one exit test per layer (benchmarks/preset_speed.py
# --gpu-check). GPU_CHECK_TOKENS (default 64) greedy tokens, GPU_CHECK_REPEATS (default 3) rounds.
#
# Offline: RIVER_GGUF_LLAMA_SDIST=FILE builds llama.cpp from a carried source archive
# (scripts/trim_llama_sdist.sh makes one small enough to carry), PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR
# takes the Python packages from carried wheels, and the models' files must already be in
# RIVER_GGUF_CACHE (a model whose files are missing is reported and skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
export RIVER_GGUF_GPU=${RIVER_GGUF_GPU:-cuda}
export RIVER_GGUF_VENV=${RIVER_GGUF_VENV:-.venv-$RIVER_GGUF_GPU}
export RIVER_GGUF_CACHE=${RIVER_GGUF_CACHE:-$PWD/.cache/test}
if [ "$RIVER_GGUF_GPU" = cuda ]; then
  command -v nvcc >/dev/null || { echo "gpu_check: nvcc not found (a CUDA toolkit is needed)" >&2; exit 2; }
  # Kernels for the GPU at hand only: the build takes minutes, not an hour. The caller's
  # CMAKE_ARGS come last, so CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=90-real overrides it.
  export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=native ${CMAKE_ARGS:-}"
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
start=$SECONDS
echo "== gpu_check: $RIVER_GGUF_GPU, build and GPU tests"
./scripts/test_gpu.sh -x
[ "$RIVER_GGUF_GPU" = vulkan ] && export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
echo "== gpu_check: tests passed after $((SECONDS - start)) s; decode speed"
status=0
for model in ${RIVER_GGUF_GPU_MODELS:-smollm2 qwen2.5-coder-0.5b}; do
  if ! "$RIVER_GGUF_VENV/bin/python" benchmarks/preset_speed.py --model "$model" --ngl -1 --gpu-check \
      --threads "${GPU_CHECK_THREADS:-$(nproc)}" --tokens "${GPU_CHECK_TOKENS:-64}" --repeats "${GPU_CHECK_REPEATS:-3}" \
      --json "${GPU_CHECK_OUT:-.}/gpu_check.$model.json"; then
    echo "gpu_check: $model's speed table failed (are its files in $RIVER_GGUF_CACHE?)" >&2
    status=1
  fi
done
echo "== gpu_check: done in $((SECONDS - start)) s"
exit $status
