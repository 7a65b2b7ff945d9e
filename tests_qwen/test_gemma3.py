"""Gemma 3 270M (gemma3: q/k norms, pre- and post-norms, GELU gate, scaled embedding, a 512-token
sliding window on 5 of every 6 layers with its own rope base): the engine against stock llama.cpp
on the shipped Q4_K_M file, a River conversion of its F16, and River generation.

Run with the model-zoo tests (scripts/test_qwen.sh): the first run downloads ~250 MB. Prompts reach
past the 512-token window, so the windowed mask is live. Exit settings are given here, not taken
from a preset the conversion chose."""
import gguf
import numpy as np
import pytest

from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.convert.build import sha256_file
from river_gguf.eval import model_zoo

from conftest import oracle_pick

GEMMA = "gemma3-270m"
LOGIT_TOL = 2e-3
# Past the sliding window (512): the windowed layers then see a different context than the global ones.
LONG = " ".join(f"Item {i}: the river carries {i % 7} boats past the mill at {i % 12} o'clock." for i in range(36))


@pytest.fixture(scope="module")
def gemma_source():
    return model_zoo.source_path(GEMMA)


@pytest.fixture(scope="module")
def gemma_f16(gemma_source):
    return model_zoo.derived(GEMMA, "f16")


@pytest.fixture(scope="module")
def gemma_river(gemma_f16, tmp_path_factory):
    from river_gguf.convert.build import build_river_gguf

    out = tmp_path_factory.mktemp("gemma") / "gemma3.river.gguf"
    build_river_gguf(gemma_f16, out, river_type="q4_0", backbone_type=None, presets=False, progress=False)
    return str(out)


def test_fetched_file_is_the_published_model(gemma_source):
    assert sha256_file(gemma_source) == model_zoo.MODELS[GEMMA].split_source.sha256
    r = gguf.GGUFReader(gemma_source)
    assert r.fields["general.architecture"].contents() == "gemma3"
    assert r.fields["gemma3.attention.sliding_window"].contents() == 512


@pytest.mark.parametrize("which", ["gemma_source", "gemma_f16"])
def test_logits_past_the_window_match_llama_cpp(which, request, oracle_factory):
    path = request.getfixturevalue(which)
    m = Model(path, n_ctx=1024, n_threads=2)
    toks = m.tokenize(LONG)
    assert len(toks) > 600
    ours = m.logits(toks)
    ref = oracle_factory(path, 1024).logits(toks)
    assert ours.shape == ref.shape
    assert np.isfinite(ours).all()
    assert np.abs(ours - ref).max() < LOGIT_TOL
    assert (ours.argmax(1) == ref.argmax(1)).all()


def test_greedy_matches_llama_cpp(gemma_source, oracle_factory):
    m = Model(gemma_source, n_ctx=1024, n_threads=2)
    oracle = oracle_factory(gemma_source, 1024)
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,", LONG]
    _, (prompt, ref) = oracle_pick(prompts, lambda p: (m.tokenize(p), oracle.greedy(m.tokenize(p), 24)),
                                   lambda r: len(r[1]) == 24, "a greedy reply of 24 tokens without EOS")
    assert greedy(m, prompt, max_tokens=24).tokens == ref


def test_river_conversion_generates_and_keeps_the_backbone(gemma_river, gemma_f16, oracle_factory):
    m = Model(gemma_river, n_ctx=1024, n_threads=2, mode="river", threshold=0.97, min_exit_layer=0,
              river_head=True, prefill="backbone", tail=0)
    assert m.has_river and m.n_layer == 18
    toks = m.tokenize(LONG)
    # Invariant 1: tau above 1 is the backbone, and the backbone is the F16 file in llama.cpp.
    bb = m.logits(toks, mode="backbone")
    assert np.abs(bb - oracle_factory(gemma_f16, 1024).logits(toks)).max() < LOGIT_TOL
    g = greedy(m, "The history of the bridge begins", max_tokens=24)
    assert len(g.tokens) == len(g.stats["exit_layers"]) and g.text == m.detokenize(g.tokens)
    assert all(-1 <= e <= m.n_layer - 1 for e in g.stats["exit_layers"])
