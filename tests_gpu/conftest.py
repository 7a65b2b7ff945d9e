"""Fixtures of the GPU test module: SmolLM2's derived files (cached across runs, as in tests/), or
with RIVER_GGUF_GPU_MODELS=random random-weight files of SmolLM2's shape (a machine the model
cannot reach: scripts/gpu_device_run.sh), random-weight models of other architectures, and
llama.cpp's own offload as the oracle."""
import os
import pathlib
import sys

import pytest

os.environ.setdefault("RIVER_GGUF_CACHE", str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "test"))

import llama_cpp  # noqa: E402,F401

from river_gguf.default_model import cache_dir, derived_model  # noqa: E402
from river_gguf.devices import offload_gpus  # noqa: E402

# The oracle is tests/'s (support.oracles), with llama.cpp's own offload.
sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from support import oracles  # noqa: E402

PROSE = (
    "The river rose in the hills above the town. Every spring it carried snow water down past the mill, "
    "and the miller's children counted the days until the ice broke. One year the flood came early; "
    "the bridge held, but the road to the market was closed for a week."
)


def pytest_collection_modifyitems(config, items):
    # This module is run on purpose, on a build with a GPU backend (scripts/test_gpu.sh): no GPU
    # is a failure of the set-up, never a skip.
    if not offload_gpus():
        raise pytest.UsageError(
            "no GPU device: build with RIVER_GGUF_GPU=cuda|vulkan ./scripts/setup.sh (on lavapipe set "
            "GGML_VK_VISIBLE_DEVICES=0, as scripts/test_gpu.sh does)")


RANDOM_MODELS = os.environ.get("RIVER_GGUF_GPU_MODELS") == "random"


def _model(kind: str) -> str:
    if not RANDOM_MODELS:
        return derived_model(kind)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
    from random_models import make

    return make("smollm2-135m", ["q4_0"], "", str(cache_dir()), os.cpu_count() or 2)[kind]


@pytest.fixture(scope="session")
def f16_path():
    return _model("f16")


@pytest.fixture(scope="session")
def q4_0_path():
    return _model("q4_0")


@pytest.fixture
def gpu_oracle():
    """make(path, n_ctx=512): stock llama.cpp with every layer and the head offloaded."""
    with oracles(n_gpu_layers=-1) as make:
        yield make
