#!/usr/bin/env bash
# Everything a GPU machine without network lacks to build and check river_gguf, in one folder
# that git ignores (default .gpu-bundle/, at most 60 MiB), for scripts/gpu_device_run.sh:
#   - llama-cpp-python's source, trimmed (scripts/trim_llama_sdist.sh, about 9.5 MB);
#   - wheels/: the Python packages a fresh Python 3.12 environment needs to build llama-cpp-python
#     and river_gguf, import river_gguf and run tests_gpu/ (BUNDLE_PACKAGES below), manylinux
#     cp312 builds where a package has compiled parts; the device installs those it lacks;
#   - tokenizer.gguf: SmolLM2's tokenizer alone (its tokenizer.* keys, no tensors), from which the
#     test helpers give the random-weight models they write a real vocabulary
#     (RIVER_GGUF_TOKENIZER), since the model itself (93 MB) cannot travel;
#   - SHA256SUMS of all of it.
#   ./scripts/gpu_bundle.sh [DIR]          (BUNDLE_PYTHON=3.12: the device's Python)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpu-bundle}
PY=${BUNDLE_PYTHON:-3.12}
MAX_MIB=60
# What a runtime import of river_gguf needs (pyproject.toml's dependencies and theirs), what the
# builds need (build backends, pybind11), and pytest for tests_gpu/. One version each.
BUNDLE_PACKAGES=(
  numpy gguf tqdm jinja2 MarkupSafe typing_extensions diskcache PyYAML requests urllib3 idna certifi
  charset_normalizer
  scikit-build-core pathspec packaging pybind11
  pytest iniconfig pluggy Pygments
)
rm -rf "$OUT.partial"
mkdir -p "$OUT.partial/wheels"
./scripts/trim_llama_sdist.sh "$OUT.partial" >/dev/null
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$OUT.partial/wheels" "${BUNDLE_PACKAGES[@]}"
# SmolLM2's tokenizer keys, from the default model of this checkout's environment.
python3 - "$OUT.partial/tokenizer.gguf" <<'EOF'
import sys

from river_gguf.eval.random_model import write_tokenizer_gguf

write_tokenizer_gguf(sys.argv[1])
EOF
(cd "$OUT.partial" && find . -type f ! -name SHA256SUMS | sort | xargs sha256sum > SHA256SUMS)
size=$(du -sm "$OUT.partial" | cut -f1)
if [ "$size" -gt "$MAX_MIB" ]; then
  echo "gpu_bundle: $size MiB is more than $MAX_MIB MiB" >&2
  exit 1
fi
rm -rf "$OUT"
mv "$OUT.partial" "$OUT"
echo "gpu_bundle: $OUT ($size MiB): $(ls "$OUT/wheels" | wc -l) wheels, $(ls "$OUT"/*.tar.gz)" >&2
echo "$OUT"
