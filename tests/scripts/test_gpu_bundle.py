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

from support import REPO

ROOT = REPO
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
        "import river_gguf, river_gguf.eval.random_model, river_gguf.convert.build, river_gguf.calibrate.lossless, pytest\n"
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


def _roundtrip(tmp_path, whl, **env):
    out = tmp_path / "out"
    r = subprocess.run([str(RUN)], capture_output=True, text=True, check=True,
                       env={**os.environ, "WHEEL_ROUNDTRIP": str(whl), "OUT": str(out), **env})
    return out, pathlib.Path(r.stdout.strip().splitlines()[-1])


def test_a_built_wheel_comes_back_in_parts_and_unpacks_to_its_files(tmp_path):
    # A device run brings back files of at most 16 MiB. A wheel holds each library several times
    # (soname copies in lib/ and llama_cpp/lib/): each content travels once, and the next run
    # unpacks every file of the wheel, byte for byte.
    import random
    import zipfile

    whl = tmp_path / "llama_cpp_python-0.3.36-cp312-cp312-linux_x86_64.whl"
    # Random bytes do not compress: one copy of the library is just over one part of 15 MiB, so
    # its archive comes back in 2 parts, and in 3 if the copy were stored twice. (xz spends about
    # a CPU second per MiB of it: the smallest size that still needs parts keeps this test short.)
    lib = random.Random(0).randbytes(16 << 20)
    members = {"llama_cpp/lib/libggml-cuda.so": lib, "llama_cpp/lib/libggml-cuda.so.0": lib,
               "llama_cpp/__init__.py": b"__version__ = '0.3.36'\n"}
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    out, tree = _roundtrip(tmp_path, whl, WHEEL_MAX_MIB="64")
    parts = sorted(p.name for p in out.iterdir())
    assert parts == [f"{whl.name[:-4]}.tar.xz.test-key.part-{i:02d}" for i in range(2)], parts
    assert all((out / p).stat().st_size <= 16 << 20 for p in parts)
    for name, data in members.items():
        assert (tree / name).read_bytes() == data, name


def test_a_wheel_too_big_to_travel_is_not_written(tmp_path):
    import random
    import zipfile

    whl = tmp_path / "llama_cpp_python-0.3.36-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_STORED) as z:
        z.writestr("lib.so", random.Random(1).randbytes(3 << 20))
    out = tmp_path / "out"
    r = subprocess.run([str(RUN)], capture_output=True, text=True,
                       env={**os.environ, "WHEEL_ROUNDTRIP": str(whl), "OUT": str(out), "WHEEL_MAX_MIB": "2"})
    assert r.returncode != 0 and "more than WHEEL_MAX_MIB=2" in r.stderr
    assert not list(out.iterdir())


def test_the_cuda_build_hides_the_archives_it_links():
    # A library that re-exported a static archive's copy of C++ runtime code could be bound in
    # place of libstdc++'s (docs/gpu.md); the build passes the linker flag that prevents it.
    assert "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL" in _cmake_args()
    assert "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL" not in _cmake_args(LLAMA_EXCLUDE_LIBS="0")


def test_the_installed_libraries_define_no_cxx_runtime_symbols():
    # The invariant the CUDA fix depends on, for every library of the installed wheel that loads
    # here: none defines std::locale's or ctype's own symbols, which libstdc++ alone must.
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "cxx_runtime_exports.py")], capture_output=True,
                         text=True)
    lines = out.stdout.strip().splitlines()
    assert any(line.startswith("libllama") and line.endswith(": none") for line in lines), out.stdout
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_runtime_symbol_check_sees_libstdcxx():
    # The check is not blind: libstdc++ itself defines every symbol it looks for.
    sys.path.insert(0, str(ROOT / "scripts"))
    from cxx_runtime_exports import RUNTIME_SYMBOLS, defined_runtime_symbols

    import llama_cpp  # noqa: F401  (loads libstdc++ into this process)

    path = next(line.split()[-1] for line in open("/proc/self/maps") if "libstdc++.so" in line)
    assert defined_runtime_symbols(path) == list(RUNTIME_SYMBOLS)
