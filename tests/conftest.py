"""Shared fixtures: the default model, derived files (cached across runs), and the oracle:
stock llama.cpp through llama-cpp-python."""
import os
import pathlib
import sys

import pytest

# The repository's tools (tools/fuzz_gguf.py, ...) are scripts, not part of the package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))

# Derived files (F16, quants, rivers) are slow to make; keep them between runs.
os.environ.setdefault("RIVER_GGUF_CACHE", str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "test"))

import llama_cpp  # noqa: E402,F401

from river_gguf.default_model import default_model_path, derived_model  # noqa: E402
from river_gguf.testing import LlamaCppOracle, oracle_pick, oracles  # noqa: E402,F401

PROSE = (
    "The river rose in the hills above the town. Every spring it carried snow water down past the mill, "
    "and the miller's children counted the days until the ice broke. One year the flood came early; "
    "the bridge held, but the road to the market was closed for a week."
)


@pytest.fixture(scope="session")
def q4_1_path():
    return default_model_path()


@pytest.fixture(scope="session")
def f16_path():
    return derived_model("f16")


@pytest.fixture(scope="session")
def q4_0_path():
    return derived_model("q4_0")


Oracle = LlamaCppOracle  # tests import it by this name


@pytest.fixture
def oracle_factory():
    with oracles() as make:
        yield make


@pytest.fixture(scope="session")
def river_gguf_path(f16_path):
    """SmolLM2 F16 backbone + Q4_0 river, profiled tau: a cached River GGUF (built once if missing)."""
    from river_gguf.convert.build import FORMAT_VERSION, build_river_gguf
    from river_gguf.default_model import cache_dir

    stem = pathlib.Path(f16_path).name.removesuffix(".gguf")  # carries the source model's tag
    dst = cache_dir() / f"{stem}+q4_0.v{FORMAT_VERSION}.river.gguf"
    if not dst.is_file():
        build_river_gguf(f16_path, dst, river_type="q4_0", backbone_type=None, progress=False, imatrix=None,
                         presets=False)
    return str(dst)
