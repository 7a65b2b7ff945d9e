"""The engine and llama_cpp share one ggml, and a different ggml underneath is refused at import."""
import subprocess
import sys

import llama_cpp

import river_gguf
from river_gguf import _native


def _loaded(name):
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if name in line.split()[-1]}


def test_one_copy_of_ggml_and_libllama():
    river_gguf.Model  # both packages imported
    for lib in ("libggml-base.so", "libggml.so", "libllama.so"):
        paths = _loaded(lib)
        assert len(paths) == 1, f"{lib} loaded from {paths}"
        assert "llama_cpp/lib" in next(iter(paths))


def test_built_against_the_loaded_ggml():
    assert _native.BUILT_LLAMA_CPP_PYTHON == llama_cpp.__version__ == "0.3.36"
    assert _native.BUILT_GGML_COMMIT == _native.loaded_ggml_commit()


def test_mismatched_llama_cpp_is_refused_at_import():
    code = "import llama_cpp; llama_cpp.__version__ = '9.9.9'; import river_gguf"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "ImportError" in r.stderr
    assert "built against llama-cpp-python 0.3.36" in r.stderr and "9.9.9" in r.stderr
