"""Shared fixtures: the default model, derived files (cached across runs), and the oracle:
stock llama.cpp through llama-cpp-python."""
import os
import pathlib

import numpy as np
import pytest

# Derived files (F16, quants, rivers) are slow to make; keep them between runs.
os.environ.setdefault("RIVER_GGUF_CACHE", str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "test"))

import llama_cpp  # noqa: E402

from river_gguf.default_model import default_model_path, derived_model  # noqa: E402

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


class Oracle:
    """llama.cpp on a GGUF, configured like the engine (F16 KV cache, flash attention)."""

    def __init__(self, path, n_ctx=512):
        self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=2, n_threads_batch=2, logits_all=True,
                                   flash_attn=True, verbose=False)

    def logits(self, tokens):
        self.llm.reset()
        self.llm.eval(list(tokens))
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32)

    def greedy(self, tokens, n):
        out = []
        # Forget earlier evals: llama-cpp-python would otherwise reuse a cached prefix that was
        # computed inside a longer batch, which is not the computation the engine repeats.
        self.llm.reset()
        for tok in self.llm.generate(list(tokens), temp=0.0, top_k=1, reset=True):
            if self.llm.token_eos() == tok or len(out) >= n:
                break
            out.append(tok)
        return out

    def close(self):
        self.llm.close()


@pytest.fixture
def oracle_factory():
    made = []

    def make(path, n_ctx=512):
        o = Oracle(path, n_ctx)
        made.append(o)
        return o

    yield make
    for o in made:
        o.close()


@pytest.fixture(scope="session")
def river_gguf_path(f16_path):
    """SmolLM2 F16 backbone + Q4_0 river, profiled tau: a cached River GGUF (built once if missing)."""
    from river_gguf.convert import FORMAT_VERSION, build_river_gguf
    from river_gguf.default_model import cache_dir

    stem = pathlib.Path(f16_path).name.removesuffix(".gguf")  # carries the source model's tag
    dst = cache_dir() / f"{stem}+q4_0.v{FORMAT_VERSION}.river.gguf"
    if not dst.is_file():
        build_river_gguf(f16_path, dst, river_type="q4_0", progress=False, imatrix=None, presets=False)
    return str(dst)
