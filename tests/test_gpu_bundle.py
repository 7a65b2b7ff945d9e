"""The offline GPU run's pieces that can be checked without a GPU: the CUDA architecture a caller
sets reaches llama.cpp's CMake (scripts/gpu_device_run.sh), and the bundle (scripts/gpu_bundle.sh)
lists every package a runtime import of river_gguf needs."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN = ROOT / "scripts" / "gpu_device_run.sh"
BUNDLE = ROOT / "scripts" / "gpu_bundle.sh"


def _cmake_args(**env) -> list:
    out = subprocess.run([str(RUN), "--print-cmake-args"], capture_output=True, text=True, check=True,
                         env={**{k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "CUDA_ARCH")}, **env})
    return out.stdout.split()


def _last_arch(args) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith("-DCMAKE_CUDA_ARCHITECTURES=")]
    return values[-1]  # CMake keeps a variable's last value


def test_the_cuda_architecture_reaches_cmake():
    args = _cmake_args()
    assert "-DGGML_CUDA=ON" in args and "-DGGML_RPC=ON" in args
    assert _last_arch(args) == "90-real"  # an H200's, by default
    assert _last_arch(_cmake_args(CUDA_ARCH="80")) == "80"
    # The caller's own CMAKE_ARGS come last, so they win over the script's default.
    assert _last_arch(_cmake_args(CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=86-real")) == "86-real"


def _bundle_packages() -> set:
    text = BUNDLE.read_text()
    body = re.search(r"BUNDLE_PACKAGES=\(\n(.*?)\n\)", text, re.S).group(1)
    return {re.sub(r"[-_.]+", "-", p).lower() for p in body.split()}


def test_the_bundle_holds_what_importing_river_gguf_needs():
    # The distributions whose modules a fresh process has loaded after importing river_gguf and
    # what tests_gpu/ imports, less the standard library and llama-cpp-python (carried as source).
    # Modules the interpreter loaded before (site hooks of this environment) do not count.
    probe = (
        "import json, sys, importlib.metadata as md\n"
        "before = set(sys.modules)\n"
        "import river_gguf, river_gguf.testing, river_gguf.convert.build, river_gguf.calibrate.lossless, pytest\n"
        "dists = md.packages_distributions()\n"
        "top = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(json.dumps(sorted({d for t in top if t not in sys.stdlib_module_names for d in dists.get(t, [])})))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd="/")
    needed = {re.sub(r"[-_.]+", "-", d).lower() for d in json.loads(out.stdout.strip().splitlines()[-1])}
    needed -= {"llama-cpp-python", "river-gguf"}
    assert needed, "the probe found no third-party package: it is not looking"
    missing = needed - _bundle_packages()
    assert not missing, f"scripts/gpu_bundle.sh's BUNDLE_PACKAGES lacks {sorted(missing)}"


@pytest.mark.parametrize("pkg", ["numpy", "gguf", "jinja2", "tqdm", "diskcache", "pytest"])
def test_the_bundle_lists_the_obvious(pkg):
    assert pkg in _bundle_packages()
