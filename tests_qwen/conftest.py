"""Fixtures for the Qwen2.5-Coder-0.5B tests: the fetched model, its derived files (cached across
runs, like tests/), and the oracle: stock llama.cpp through llama-cpp-python.

Kept out of CI (tests/) because the first run downloads ~490 MB and builds ~2 GB of derived files;
run with scripts/test_qwen.sh."""
import os
import pathlib

import numpy as np
import pytest

# The same cache as tests/: derived files are slow to make, keep them between runs.
os.environ.setdefault("RIVER_GGUF_CACHE", str(pathlib.Path(__file__).resolve().parent.parent / ".cache" / "test"))

import llama_cpp  # noqa: E402

from river_gguf import model_zoo  # noqa: E402

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
    """Qwen F16 backbone + Q4_0 river with the profiled tau: a cached River GGUF."""
    from river_gguf.convert import FORMAT_VERSION, build_river_gguf

    # The F16's name carries the source file's tag, so a re-fetched source gets a new River GGUF.
    stem = pathlib.Path(qwen_f16).name.removesuffix(".gguf")
    dst = model_zoo.cache_dir() / f"{stem}+q4_0.v{FORMAT_VERSION}.river.gguf"
    if not dst.is_file():
        build_river_gguf(qwen_f16, dst, river_type="q4_0", progress=False)
    return str(dst)


class Oracle:
    """llama.cpp on a GGUF, set up like the engine: F16 KV cache (the default), flash attention."""

    def __init__(self, path, n_ctx=512):
        self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=2, n_threads_batch=2, logits_all=True,
                                   flash_attn=True, verbose=False)

    def logits(self, tokens):
        self.llm.reset()
        self.llm.eval(list(tokens))
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32)

    def greedy(self, tokens, n):
        # reset: llama-cpp-python would otherwise reuse a prefix computed inside a longer batch,
        # which is not the computation the engine repeats step by step.
        self.llm.reset()
        out = []
        for tok in self.llm.generate(list(tokens), temp=0.0, top_k=1, reset=True):
            if llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, tok) or len(out) >= n:
                break
            out.append(tok)
        return out

    def close(self):
        self.llm.close()


@pytest.fixture
def oracle_factory():
    made = []

    def make(path, n_ctx=512):
        made.append(Oracle(path, n_ctx))
        return made[-1]

    yield make
    for o in made:
        o.close()
