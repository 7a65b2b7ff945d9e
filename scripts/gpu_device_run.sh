#!/usr/bin/env bash
# River on CUDA in one command, on a borrowed GPU machine with no network, from the checkout and
# the bundle scripts/gpu_bundle.sh made (carried beside it):
#
#   OUT=DIR ./scripts/gpu_device_run.sh [BUNDLE]        (BUNDLE default .gpu-bundle)
#   ./scripts/gpu_device_run.sh --print-cmake-args      (llama.cpp's CMake arguments, then exit)
#   OUT=DIR ./scripts/gpu_device_run.sh --save-wheel WHL [BUNDLE]   (WHL, built for this run's
#                                                          settings, written to DIR in parts)
#   WHEEL_ROUNDTRIP=WHL OUT=DIR ./scripts/gpu_device_run.sh   (WHL's parts written to DIR, joined and
#                                                          unpacked; prints the folder: a test)
#
# 1. installs what the machine's Python lacks from the bundle (no index), into a folder of its own
#    on PYTHONPATH (no venv: ensurepip may be missing);
# 2. builds llama-cpp-python from the bundle's source with CUDA and RPC (CUDA_ARCH, default
#    90-real: an H200's) as a wheel, installs it, and writes its files to OUT in parts that can
#    come back (each content once, tar.xz, parts under 16 MiB); a later run given those parts in
#    WHEEL_DIR (default .gpu-wheel, carried beside the bundle) installs them and skips the build.
#    Then it builds river_gguf against it;
# 2b. the load crash's diagnosis (crash-diagnosis.txt): which libraries export the C++ runtime's
#    locale symbols, the first GPU load under each import order and environment that could change
#    which copy binds, the dynamic linker's bindings of those symbols, and tests_gpu's first test
#    plain, with LD_BIND_NOW and with the system libstdc++ preloaded;
# 3. writes random-weight F16 models shaped like SmolLM2-135M and Llama-3.2-1B, their static quants
#    and River GGUFs (benchmarks/random_models.py; the timings and the parity checks do not depend
#    on the weights), each shape when it is needed;
# 4. runs tests_gpu/ on the SmolLM2-shaped ones (RIVER_GGUF_GPU_MODELS=random), every test, into a
#    JUnit file;
# 5. times decode with every layer offloaded beside llama.cpp's own CUDA offload of the same files,
#    the GPU synchronized inside the clock (benchmarks/preset_speed.py --gpu-check: the backbone,
#    river-only, tau 0.97, every layer tested), and lossless mode's step, draft and verify costs
#    (benchmarks/lossless_speed.py --shape --ngl -1);
# 6. or, instead of 3-5 (RUN_8B=1; RUN_8B=auto, the default, picks it when the wheel was carried and
#    DEVICE_ONLY=1): writes a random-weight F16 of SHAPE_8B's shape (default llama-3.1-8b, 16 GB),
#    llama.cpp's Q4_0 of it and its River GGUF (Q4_0 river) into RIVER_GGUF_CACHE on the machine's
#    own disk, after checking that the disk has room for them, and times decode there as in 5: the
#    backbone, river-only, exits forced after 2, 4 and 8 layers, tau 0.97, every layer tested, and
#    llama.cpp's own offload of the F16 and the Q4_0.
# Every step has a time limit, and the whole run BUDGET_S seconds (default 540; a step that would
# start after it is skipped and says so); the log (each stage's start, end, status and seconds) goes
# to OUT (default ./gpu-run-out), and stages.txt, the JUnit file, the diagnosis and the JSON tables
# into OUT/results.tar.gz when the run ends (a device run brings back at most 8 files). A step that
# fails is logged and the ones that do not need it still run.
#
# The dry run on a machine without a GPU: GPU_BACKEND=vulkan builds the Vulkan backend instead
# (Mesa's lavapipe; the loader, glslc and headers as scripts/test_gpu.sh installs them) and
# DEVICE_ONLY=0 leaves out the timings, which mean nothing there; on 2 cores it took 22 minutes,
# 10 of them the build, and 7 minutes given the first run's wheel (BUDGET_S=4000 LIMIT_SCALE=8).
# The 8B stages' dry run, at SmolLM2's shape (lavapipe's speeds mean nothing; the stages, their
# order, the files and the table do):
#
#   rm -rf /tmp/river-8b-dry && RUN_8B=1 SHAPE_8B=smollm2-135m RIVER_GGUF_CACHE=/tmp/river-8b-dry \
#     GPU_BACKEND=vulkan DEVICE_ONLY=0 BUDGET_S=3600 LIMIT_SCALE=8 PYTHON=.venv/bin/python ./scripts/gpu_device_run.sh
#
# The time plan. A command runs at most 10 minutes on the device (16 cores), so BUDGET_S is 540 s,
# and the plan is two calls: the first builds, and its diagnosis and tests leave no room for the 8B
# table (about 6 minutes); the second, given the first's wheel in .gpu-wheel/, runs it instead of
# them. Seconds on the device, estimated (a stage's limit is cut to what is left of BUDGET_S):
#
#   stage             call  estimate  limit  from
#   bundle-check      1, 2         2     30
#   install           1, 2        15    120
#   build-llama-cpp   1          280    400  229 s measured on an H200, and the wheel's parts
#   build-llama-cpp   2           10    400  the carried wheel unpacked
#   build-engine      1, 2        16    120  measured on an H200
#   devices           1, 2         5     60
#   models-smollm2    1           20     90
#   load-check        1           10     60
#   crash-diagnosis   1          100    150  6 loads, 3 single tests
#   tests-gpu         1          150    200  cut to the ~90 s left of the budget
#   decode-smollm2, models-1b, decode-1b, lossless-costs: 1, skipped (the budget is spent)
#   space-8b          2            3     30
#   models-8b-f16     2          150    240  8.03e9 weights drawn on one core at ~15 ns each
#                                            (rng.standard_normal, the scale, astype(float16):
#                                            135 MB/s of F16 on one core of a 2-core Xeon VM);
#                                            16.1 GB written
#   models-8b-q4_0    2           45    120  llama.cpp's quantizer on 16 threads; 4.7 GB written
#   models-8b-river   2          110    180  the engine's load check (~9 GB of Q/K/V and gate/up
#                                            joined on one thread), the river's Q4_0, 20.7 GB written
#   decode-8b         2           75    180  41 GB loaded onto the GPU; 9 rows, 2 rounds of 64 tokens
#   call 1: ~540 (the budget); call 2: ~430 (the budget: 540)
#
# The 8B files need about 43 GiB of disk at the peak (the F16, its Q4_0, the River GGUF and the
# river's temporary Q4_0 while it is written): space-8b checks that first. RUN_8B=0 makes the second
# call what the first was (the tests, then the smaller tables); RUN_8B=1 runs the 8B stages in any call.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --print-cmake-args ]; then  # what the build would pass to llama.cpp's CMake, and no more
  PRINT_ONLY=1
  shift
elif [ "${1:-}" = --save-wheel ]; then  # a wheel built for this run's key, written to OUT in parts
  SAVE_WHEEL=$(realpath "$2")
  shift 2
fi
ROOT=$PWD
BUNDLE=$(cd "${1:-.gpu-bundle}" 2>/dev/null && pwd || echo "${1:-.gpu-bundle}")
OUT=${OUT:-$ROOT/gpu-run-out}
GPU_BACKEND=${GPU_BACKEND:-cuda}
CUDA_ARCH=${CUDA_ARCH:-90-real}
DEVICE_ONLY=${DEVICE_ONLY:-1}
RUN_8B=${RUN_8B:-auto}  # the 8B table instead of the tests: 1, 0, or auto (when the wheel was carried)
SHAPE_8B=${SHAPE_8B:-llama-3.1-8b}  # its shape (eval/random_model.py RANDOM_SHAPES): smollm2-135m for the dry run
JOBS=${JOBS:-$(nproc)}
BUDGET_S=${BUDGET_S:-540}   # the whole run, the build included: a lease's command runs at most 10 minutes
LIMIT_SCALE=${LIMIT_SCALE:-1}  # each step's limit times this (the dry run on 2 cores: 8)
SITE=${SITE:-/tmp/river-site}
WHEEL_DIR=$(cd "${WHEEL_DIR:-.gpu-wheel}" 2>/dev/null && pwd || echo "${WHEEL_DIR:-.gpu-wheel}")
WHEEL_PART_MIB=15   # a file that comes back from a device run is at most 16 MiB
WHEEL_MAX_MIB=${WHEEL_MAX_MIB:-32}  # with the bundle (31 MiB), what can travel is 64 MiB
# The shared linker flag that keeps a library from re-exporting the static archives linked into it
# (a copy of C++ runtime code among them): LLAMA_EXCLUDE_LIBS=0 builds without it.
LLAMA_EXCLUDE_LIBS=${LLAMA_EXCLUDE_LIBS:-1}
LOG=$OUT/run.log
T0=$(date +%s)
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export RIVER_GGUF_CACHE=${RIVER_GGUF_CACHE:-/tmp/river-models}
export RIVER_GGUF_TOKENIZER=$BUNDLE/tokenizer.gguf
export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
[ "$GPU_BACKEND" = vulkan ] && export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}  # lavapipe
PY=${PYTHON:-python3}

log() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
# stage NAME SECONDS COMMAND...: run it with a time limit (and within the run's BUDGET_S, so the
# whole run ends in time); log and record its status and seconds.
stage() {
  local name=$1 limit=$2 t rc left
  shift 2
  t=$(date +%s)
  limit=$((limit * LIMIT_SCALE))
  left=$((T0 + BUDGET_S - t))
  if [ "$left" -lt 10 ]; then
    log "skip $name: the run's ${BUDGET_S}s are spent"
    echo "$name skipped 0" >> "$OUT/stages.txt"
    return 124
  fi
  [ "$limit" -le "$left" ] || limit=$left
  log "start $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" bash -c '"$@"' stage "$@" >> "$LOG" 2>&1
  rc=$?
  log "end $name: status $rc after $(($(date +%s) - t))s"
  echo "$name $rc $(($(date +%s) - t))" >> "$OUT/stages.txt"
  return $rc
}

install_missing() {  # the bundle's wheels of the packages this Python cannot import
  local need=() pkg mod
  for pkg in numpy:numpy gguf:gguf tqdm:tqdm jinja2:jinja2 MarkupSafe:markupsafe typing_extensions:typing_extensions \
             diskcache:diskcache PyYAML:yaml requests:requests urllib3:urllib3 idna:idna certifi:certifi \
             charset_normalizer:charset_normalizer scikit_build_core:scikit_build_core pathspec:pathspec \
             packaging:packaging pybind11:pybind11 pytest:pytest iniconfig:iniconfig pluggy:pluggy Pygments:pygments; do
    mod=${pkg#*:}
    "$PY" -c "import $mod" 2>/dev/null || need+=("${pkg%%:*}")
  done
  echo "installing from the bundle: ${need[*]:-nothing}"
  [ ${#need[@]} -eq 0 ] || "$PY" -m pip install -q --no-index --no-deps --find-links "$BUNDLE/wheels" \
    --target "$SITE" "${need[@]}"
}

# llama.cpp's CMake arguments: the backend, RPC, no multimodal library (nothing here uses it), and
# the caller's CMAKE_ARGS last: CMake keeps a variable's last value, so they override these.
llama_cmake_args() {
  local args="-DGGML_RPC=ON -DLLAVA_BUILD=OFF"
  [ "$LLAMA_EXCLUDE_LIBS" = 0 ] || args="$args -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL"
  if [ "$GPU_BACKEND" = cuda ]; then
    args="$args -DGGML_CUDA=ON -DGGML_CUDA_NCCL=OFF -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH"
  else
    local loader
    loader=$(ldconfig -p | awk '/libvulkan\.so\.1 / && !p {p = $NF} END {print p}')
    args="$args -DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$(./scripts/vulkan_headers.sh) -DVulkan_LIBRARY=$loader"
  fi
  echo "$args ${CMAKE_ARGS:-}"
}

# What a built wheel was built for: the source, the CMake arguments and the Python. A carried
# wheel is used only when its key is this run's.
wheel_key() {
  { sha256sum "$BUNDLE"/llama_cpp_python-*.tar.gz | cut -d' ' -f1; llama_cmake_args; "$PY" -c 'import sys; print(sys.version_info[:2])'; } |
    sha256sum | cut -c1-10
}

# A wheel holds each library several times over (lib/ and llama_cpp/lib/, each soname link a copy:
# a Vulkan build's wheel is 74 MB of 216 MB unpacked). What travels is the wheel's files with each
# content stored once (copies hardlinked) in a tar.xz: NAME.tar.xz.KEY.part-NN in OUT.
pack_wheel() {  # WHL ARCHIVE
  local tree
  tree=$(mktemp -d /tmp/river-wheel-tree.XXXX)
  "$PY" - "$1" "$tree" <<'PYEOF' || return 1
import hashlib, os, sys, zipfile
whl, tree = sys.argv[1:]
first = {}
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if info.is_dir():
            continue
        data = z.read(info)
        dst = os.path.join(tree, info.filename)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        digest = hashlib.sha256(data).hexdigest()
        if digest in first:
            os.link(first[digest], dst)
            continue
        with open(dst, "wb") as f:
            f.write(data)
        os.chmod(dst, (info.external_attr >> 16) & 0o777 or 0o644)
        first[digest] = dst
PYEOF
  tar -C "$tree" -cf - . | xz -T0 -6 > "$2" || return 1
  rm -rf "$tree"
}

# The carried parts (NAME.tar.xz.KEY.part-NN, in order) joined into DIR and checked; prints the
# archive's path.
join_wheel() {
  local key=$1 dir=$2 first name
  first=$(ls "$WHEEL_DIR"/*."$key".part-* 2>/dev/null | sort | head -1)
  [ -n "$first" ] || return 1
  name=$(basename "${first%.$key.part-*}")
  cat $(ls "$WHEEL_DIR"/"$name.$key".part-* | sort) > "$dir/$name" || return 1
  xz -t "$dir/$name" || { echo "the carried wheel $name is damaged" >&2; return 1; }
  echo "$dir/$name"
}

# The built wheel into OUT in parts, unless it is too big to travel back with the bundle.
save_wheel() {
  local whl=$1 key=$2 arc mib
  arc=$(dirname "$whl")/$(basename "${whl%.whl}").tar.xz
  pack_wheel "$whl" "$arc" || return 1
  mib=$(( ($(stat -c%s "$arc") + 1048575) / 1048576 ))
  if [ "$mib" -gt "$WHEEL_MAX_MIB" ]; then
    echo "the wheel is $mib MiB as $(basename "$arc"), more than WHEEL_MAX_MIB=$WHEEL_MAX_MIB: not written to OUT"
    return 0
  fi
  split -b "${WHEEL_PART_MIB}M" -d -a 2 "$arc" "$OUT/$(basename "$arc").$key.part-"
  echo "wrote $(basename "$arc") ($mib MiB) to OUT in $(ls "$OUT"/*."$key".part-* | wc -l) parts: carry them as $WHEEL_DIR/ to skip this build"
}

build_llama_cpp() {
  local key dir whl arc
  key=$(wheel_key)
  dir=$(mktemp -d /tmp/river-wheel.XXXX)
  if arc=$(join_wheel "$key" "$dir"); then
    # The wheel's files where pip install --target would put them.
    echo "installing the carried wheel $(basename "$arc") (key $key): the build is skipped"
    tar -xJf "$arc" -C "$SITE" && echo "carried $key" > "$OUT/wheel.txt"
    return
  fi
  ls "$WHEEL_DIR"/*.part-* >/dev/null 2>&1 && echo "the wheel parts in $WHEEL_DIR are not for this build (key $key): building"
  [ "$GPU_BACKEND" != cuda ] || command -v nvcc >/dev/null || export PATH=/usr/local/cuda/bin:$PATH
  CMAKE_ARGS="$(llama_cmake_args)" "$PY" -m pip wheel -q --no-index --no-deps --no-build-isolation \
    -w "$dir" "$BUNDLE"/llama_cpp_python-*.tar.gz || return 1
  whl=$(ls "$dir"/llama_cpp_python-*.whl)
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$whl" || return 1
  echo "built $key" > "$OUT/wheel.txt"
  save_wheel "$whl" "$key"
}

build_engine() {
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" \
    -C build-dir="/tmp/river-build-$GPU_BACKEND" "$ROOT"
}

models() {  # shape quants [river]: the random-weight files of one shape (their paths: models-SHAPE.json)
  "$PY" benchmarks/random_models.py --shape "$1" --quants "$2" --river "${3-q4_0}" > "$RIVER_GGUF_CACHE/models-$1.json"
}

# shape: whether RIVER_GGUF_CACHE has room for the files of the shape that are not there yet (its
# F16, llama.cpp's Q4_0 and the River GGUF with a Q4_0 river, as the 8B stages write them).
models_room() {
  "$PY" - "$1" "$RIVER_GGUF_CACHE" <<'PYEOF'
import os, shutil, sys
from river_gguf.eval.random_model import RANDOM_SHAPES
shape, out = sys.argv[1:]
s = RANDOM_SHAPES[shape]
e, kv = s["n_embd"], s["n_head_kv"] * (s["n_embd"] // s["n_head"])
weights = (s.get("n_vocab", 49152) * e * (1 if s["tied"] else 2)
           + s["n_layer"] * (2 * e * e + 2 * e * kv + 3 * e * s["n_ff"]))
f16 = 2 * weights
# A Q4_0 file is about 0.3 of the F16 (its head Q6_K); the River GGUF is the F16 and its Q4_0
# river, with the river's temporary Q4_0 beside it while it is written.
need = {"f16": f16, "q4_0": 0.3 * f16, "f16+q4_0.river": 1.6 * f16}
missing = {k: b for k, b in need.items() if not os.path.exists(os.path.join(out, f"random-{shape}.{k}.gguf"))}
free = shutil.disk_usage(out).free
print(f"{shape}: {weights / 1e9:.2f}e9 weights; to write: {', '.join(missing) or 'nothing'}, "
      f"{sum(missing.values()) / 2**30:.1f} GiB; free in {out}: {free / 2**30:.1f} GiB")
sys.exit(0 if 1.05 * sum(missing.values()) < free else 1)
PYEOF
}

load_check() {
  local f code
  f=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['river'])" "$RIVER_GGUF_CACHE/models-smollm2-135m.json")
  code="from river_gguf import Model; m = Model('$f', n_ctx=1024, n_threads=2, n_gpu_layers=-1); print('loaded', m.placement['kv_cache'][:2])"
  "$PY" -X faulthandler -c "$code" && return 0
  command -v cuda-gdb >/dev/null && cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args "$PY" -c "$code"
  return 1
}

# The load crash's evidence, into OUT/crash-diagnosis.txt (see docs/gpu.md). Each probe runs in a
# process of its own with a time limit; its status is recorded (139: the segfault).
crash_diagnosis() {
  local f load d=$OUT/crash-diagnosis.txt stdcxx probe rc
  f=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['river'])" "$RIVER_GGUF_CACHE/models-smollm2-135m.json")
  load="from river_gguf import Model; Model('$f', n_ctx=1024, n_threads=2, n_gpu_layers=-1); print('loaded')"
  stdcxx=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 / && !p {p = $NF} END {print p}')
  {
    echo "== libraries that define the C++ runtime's locale symbols (scripts/cxx_runtime_exports.py)"
    "$PY" scripts/cxx_runtime_exports.py "$SITE/llama_cpp/lib"
    echo "== the system libstdc++: $stdcxx"
    echo "== the first GPU load, each in a fresh process: status, then the probe"
    for probe in "" "import numpy;" "import ctypes; ctypes.CDLL('libstdc++.so.6');" \
                 "import ctypes, os; ctypes.CDLL('libstdc++.so.6', os.RTLD_GLOBAL); import numpy;" \
                 "import llama_cpp; from river_gguf.devices import offload_gpus; offload_gpus();" \
                 "import numpy, llama_cpp; from river_gguf.devices import offload_gpus; offload_gpus();"; do
      timeout 60 "$PY" -X faulthandler -c "$probe${probe:+ }$load" > /tmp/probe.log 2>&1; rc=$?
      echo "status $rc: $probe"
      [ $rc = 0 ] || tail -5 /tmp/probe.log | sed 's/^/    /'
      if [ $rc -ge 128 ] && [ -z "${bound:-}" ]; then  # the first crash (a signal): where the symbols bound
        bound=1
        LD_DEBUG=bindings LD_DEBUG_OUTPUT=/tmp/ld-bindings timeout 90 "$PY" -c "$probe${probe:+ }$load" >/dev/null 2>&1
        # libllama's own inline copies (ctype<char>::do_widen, ...) take bindings on every machine:
        # those to libggml-cuda come first, the others are counted.
        echo "  == its bindings to libggml-cuda of C++ runtime symbols (_ZNSt, _ZNKSt, _ZTVSt...; first 40)"
        cat /tmp/ld-bindings.* 2>/dev/null | grep -E "to [^ ]*libggml-cuda[^ ]* .*\`_Z[A-Z]*St" | head -40 | sed 's/^ *[0-9]*:[[:space:]]*/    /'
        echo "  == bindings of such symbols to ggml's other libraries or libllama: $(cat /tmp/ld-bindings.* 2>/dev/null |
          grep -E "to [^ ]*lib(ggml|llama)[^ ]* .*\`_Z[A-Z]*St" | grep -vc "to [^ ]*libggml-cuda")"
        echo "  == its bindings of locale, ctype and codecvt symbols to anything but libstdc++ (first 40)"
        cat /tmp/ld-bindings.* 2>/dev/null | grep -E "St6locale|St5ctype|St7codecvt" | grep -v "to [^ ]*libstdc++" |
          head -40 | sed 's/^ *[0-9]*:[[:space:]]*/    /'
        rm -f /tmp/ld-bindings.*
      fi
    done
    echo "== tests_gpu's first test (test_the_gpu_holds_every_layer), each in a fresh process"
    for env in "" "LD_BIND_NOW=1" "LD_PRELOAD=$stdcxx"; do
      env $env RIVER_GGUF_GPU_MODELS=random timeout 120 "$PY" -X faulthandler -m pytest -q -x -p no:cacheprovider \
        tests_gpu -k test_the_gpu_holds_every_layer > /tmp/probe.log 2>&1; rc=$?
      echo "status $rc: ${env:-plain} $(tail -1 /tmp/probe.log)"
    done
  } > "$d" 2>&1
  cat "$d"
}

gpu_tests() {  # tests_gpu/ on the random SmolLM2-shaped files, into JUnit
  export RIVER_GGUF_GPU_MODELS=random
  if [ "$GPU_BACKEND" != vulkan ]; then
    "$PY" -m pytest -q -p no:cacheprovider tests_gpu --junitxml="$OUT/tests_gpu.xml"
    return
  fi
  # Lavapipe: a process per test, as scripts/test_gpu.sh runs them (its heap corruption, docs/gpu.md);
  # a JUnit file per test.
  JUNIT_DIR="$OUT/tests_gpu" ./scripts/pytest_each.sh "$PY" tests_gpu
}

decode_table() {  # shape: preset_speed.py over the shape's files
  local shape=$1 f k exits=()
  f=$RIVER_GGUF_CACHE/models-$shape.json
  # Forced exits after 2, 4 and 8 backbone layers (the paper's depth): the cost of an exit depth
  # does not depend on the weights.
  for k in 2 4 8; do
    exits+=(--setting "exit after $k={\"mode\": \"river\", \"exit_layer\": $((k - 1)), \"tail\": 0, \"river_attention\": \"river\"}")
  done
  "$PY" benchmarks/preset_speed.py --ngl -1 --gpu-check --no-presets --static "" --threads "$JOBS" "${exits[@]}" \
    --river "$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['river'])" "$f")" \
    $("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print(' '.join(f'--static-file {k.upper()}={v}' for k, v in d.items() if k != 'river'))" "$f") \
    --tokens 64 --repeats 2 --json "$OUT/decode-$shape.json"
}

if [ "${PRINT_ONLY:-0}" = 1 ]; then
  llama_cmake_args
  exit 0
fi
if [ -n "${SAVE_WHEEL:-}" ]; then
  mkdir -p "$OUT"
  save_wheel "$SAVE_WHEEL" "$(wheel_key)"
  exit
fi
if [ -n "${WHEEL_ROUNDTRIP:-}" ]; then  # the test of the wheel's parts: write them to OUT, join and unpack them
  mkdir -p "$OUT"
  save_wheel "$WHEEL_ROUNDTRIP" test-key >&2 || exit 1
  arc=$(WHEEL_DIR=$OUT join_wheel test-key "$(mktemp -d)") || exit 1
  tree=$(mktemp -d)
  tar -xJf "$arc" -C "$tree" && echo "$tree"
  exit
fi
export ROOT BUNDLE OUT GPU_BACKEND CUDA_ARCH JOBS SITE PY WHEEL_DIR WHEEL_PART_MIB WHEEL_MAX_MIB LLAMA_EXCLUDE_LIBS
export -f install_missing llama_cmake_args wheel_key pack_wheel join_wheel save_wheel build_llama_cpp build_engine models \
  models_room load_check crash_diagnosis gpu_tests decode_table
case "$RUN_8B" in auto | 0 | 1) ;; *) echo "RUN_8B must be auto, 0 or 1, not $RUN_8B" >&2; exit 2 ;; esac
mkdir -p "$OUT" "$SITE" "$RIVER_GGUF_CACHE"
: > "$OUT/stages.txt"
rm -f "$OUT/wheel.txt"  # the build stage says there whether it built the wheel or was given it
# At the end, however the run ends: everything but the log and the wheel's parts in one archive.
pack_results() {
  (cd "$OUT" && ls | grep -v -e '^run\.log$' -e '\.part-[0-9]*$' -e '^results\.tar\.gz$' |
    tar -czf results.tar.gz -T - --remove-files 2>/dev/null)
}
trap pack_results EXIT
log "gpu_device_run: backend $GPU_BACKEND, arch $CUDA_ARCH, $JOBS jobs, bundle $BUNDLE, out $OUT"
stage bundle-check 30 sh -c "cd '$BUNDLE' && sha256sum -c --quiet SHA256SUMS" || exit 1
stage install 120 install_missing || exit 1
[ "$GPU_BACKEND" = cuda ] && { nvidia-smi >> "$LOG" 2>&1; command -v nvcc >> "$LOG" 2>&1; nvcc --version >> "$LOG" 2>&1; }
stage build-llama-cpp 400 build_llama_cpp || exit 1
# The 8B table needs the time the build takes (the time plan above): by default it runs in the call
# that was given the wheel, in place of the tests.
if [ "$RUN_8B" = auto ]; then
  RUN_8B=0
  [ "$DEVICE_ONLY" = 1 ] && grep -qs '^carried ' "$OUT/wheel.txt" && RUN_8B=1
fi
log "the wheel: $(cat "$OUT/wheel.txt" 2>/dev/null || echo unknown); RUN_8B=$RUN_8B (the $SHAPE_8B table)"
stage build-engine 120 build_engine || exit 1
# No GPU in ggml's list ends the run here: nothing after this could say anything.
stage devices 60 "$PY" -c "import river_gguf; from river_gguf.devices import list_devices, offload_gpus; \
print(river_gguf.__version__, list_devices()); assert offload_gpus(), 'ggml sees no GPU'" || exit 1
if [ "$RUN_8B" = 1 ]; then
  # Each step needs the one before it: the first that fails or is skipped ends the chain.
  stage space-8b 30 models_room "$SHAPE_8B" &&
    stage models-8b-f16 240 models "$SHAPE_8B" "" "" &&
    stage models-8b-q4_0 120 models "$SHAPE_8B" q4_0 "" &&
    stage models-8b-river 180 models "$SHAPE_8B" q4_0 q4_0 &&
    stage decode-8b 180 decode_table "$SHAPE_8B" ||
    log "the $SHAPE_8B table: stopped at the first step that failed or was skipped (stages.txt)"
else
  stage models-smollm2 90 models smollm2-135m q8_0,q4_k_m,q4_0
  # The first load with every layer offloaded, alone: where it dies, a native backtrace (cuda-gdb
  # debugs host code too; the image has no gdb) says where, for the log.
  stage load-check 60 load_check
  stage crash-diagnosis 150 crash_diagnosis
  stage tests-gpu 200 gpu_tests
  if [ "$DEVICE_ONLY" = 1 ]; then
    stage decode-smollm2 90 decode_table smollm2-135m
    stage models-1b 90 models llama-3.2-1b q8_0,q4_0
    stage decode-1b 90 decode_table llama-3.2-1b
    stage lossless-costs 90 "$PY" benchmarks/lossless_speed.py --shape llama-3.2-1b --ngl -1 --draft-max 8 \
      --acceptance 0.87,0.93 --threads "$JOBS" --json "$OUT/lossless-1b.json"
  fi
fi
log "gpu_device_run: done after $(($(date +%s) - T0))s"
