"""Fixtures for the Qwen2.5-Coder-0.5B tests: the fetched model, its derived files (cached across
runs, like tests/), and the oracle: stock llama.cpp through llama-cpp-python.

Kept out of CI (tests/) because the first run downloads ~490 MB and builds ~2 GB of derived files;
run with scripts/test_qwen.sh."""
import os
import pathlib
import sys

import pytest

# The same cache as tests/: derived files are slow to make, keep them between runs.
os.environ.setdefault("RIVER_GGUF_CACHE", str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "test"))

import llama_cpp  # noqa: E402,F401

from river_gguf.eval import model_zoo  # noqa: E402

# The oracle and oracle_pick are tests/'s (support).
sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from support import oracle_pick, oracles  # noqa: E402,F401

QWEN = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="session")
def qwen_source():
    return model_zoo.source_path(QWEN)


@pytest.fixture(scope="session")
def qwen_f16(qwen_source):
    return model_zoo.derived(QWEN, "f16")


@pytest.fixture(scope="session")
def qwen_q4_0(qwen_f16):
    return model_zoo.derived(QWEN, "q4_0")


@pytest.fixture(scope="session")
def qwen_river(qwen_f16):
    """Qwen F16 backbone + Q4_0 river with the profiled tau: a cached River GGUF. No presets
    (as tests/conftest.py's): the tests give their exit settings explicitly, not a preset the
    conversion chose, and the file builds faster."""
    from river_gguf.convert.build import FORMAT_VERSION, build_river_gguf

    # The F16's name carries the source file's tag, so a re-fetched source gets a new River GGUF.
    stem = pathlib.Path(qwen_f16).name.removesuffix(".gguf")
    dst = model_zoo.cache_dir() / f"{stem}+q4_0.v{FORMAT_VERSION}.river.gguf"
    if not dst.is_file():
        build_river_gguf(qwen_f16, dst, river_type="q4_0", backbone_type=None, progress=False, presets=False)
    return str(dst)


@pytest.fixture
def oracle_factory():
    # Qwen's chat turns end on <|im_end|>, not on its EOS token.
    with oracles(stop_at_any_eog=True) as make:
        yield make
