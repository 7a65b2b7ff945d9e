"""The engine against stock llama.cpp on the same GGUF: logits, top-1 tokens, greedy text.

Tolerance: both sides run the same ggml kernels on the same graph shape (F16 KV cache, flash
attention), so logits agree to the bit in practice. support.LOGIT_TOL leaves room only for
reduction order (thread splits), far below the ~1-10 logit gaps that decide tokens."""
import numpy as np
import pytest

from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.options import ExitOptions
from river_gguf.eval.random_model import write_tiny_model

from support import LOGIT_TOL, PROSE, THREADS, oracle_pick


def _check_logits(model_path, oracle_factory, n_ctx=512, text=PROSE, **model_kw):
    m = Model(model_path, n_ctx=n_ctx, n_threads=THREADS, **model_kw)
    toks = m.tokenize(text)
    assert len(toks) > 40
    ours = m.logits(toks)
    ref = oracle_factory(model_path, n_ctx).logits(toks)
    assert ours.shape == ref.shape == (len(toks), m.n_vocab)
    assert np.isfinite(ours).all()
    assert np.abs(ours - ref).max() < LOGIT_TOL
    assert (ours.argmax(1) == ref.argmax(1)).all()
    return m


@pytest.mark.parametrize("which", ["q4_1_path", "f16_path"])
def test_logits_match_llama_cpp(which, request, oracle_factory):
    _check_logits(request.getfixturevalue(which), oracle_factory)


GREEDY_PROMPTS = ["Once upon a time, in a small village by the sea,", PROSE, "The history of the bridge begins",
                  "Chapter 1\n\nThe rain had not stopped for three days."]


@pytest.mark.parametrize("which", ["q4_1_path", "f16_path"])
def test_greedy_128_tokens_match_llama_cpp(which, request, oracle_factory):
    path = request.getfixturevalue(which)
    m = Model(path, n_ctx=512, n_threads=THREADS)
    oracle = oracle_factory(path)
    # A prompt whose greedy reply on llama.cpp runs the full 128 tokens (no early EOS) on this CPU.
    _, (prompt, ref) = oracle_pick(GREEDY_PROMPTS, lambda t: (m.tokenize(t), oracle.greedy(m.tokenize(t), 128)),
                                   lambda r: len(r[1]) == 128, "a greedy reply of 128 tokens without EOS")
    g = greedy(m, prompt, max_tokens=128)
    assert g.tokens == ref
    assert g.finish_reason == "length" and len(g.tokens) == 128


@pytest.mark.parametrize(
    "arch,kw",
    [
        ("qwen2", {}),
        ("qwen3", {}),
        ("llama", {"tied": False, "rope_freqs": True}),
        ("llama", {"n_head": 4, "n_head_kv": 1, "tied": True}),
    ],
)
def test_tiny_random_models_match_llama_cpp(arch, kw, tmp_path, oracle_factory):
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_tiny_model(path, arch, n_layer=3, seed=7, **kw)
    _check_logits(path, oracle_factory, n_ctx=256)


def test_prompt_longer_than_batch_is_chunked(q4_1_path, oracle_factory):
    # n_batch=16 splits the prompt into several graphs; the cache must stitch them exactly.
    m = Model(q4_1_path, n_ctx=512, n_threads=THREADS, n_batch=16)
    toks = m.tokenize(PROSE)
    ref = oracle_factory(q4_1_path).logits(toks)
    assert np.abs(m.logits(toks) - ref).max() < LOGIT_TOL


def test_layer_by_layer_decode_equals_fused(q4_1_path):
    # The segmented path (one graph per layer, exit-decision readback) computes the same thing.
    m = Model(q4_1_path, n_ctx=256, n_threads=THREADS)
    toks = m.tokenize(PROSE)[:24]
    with m.session(ExitOptions(mode="backbone")) as s:
        s.extend(toks[:8])
        fused = [s.extend([t], decode=True) for t in toks[8:]]
        s.truncate(0)
        s.extend(toks[:8])
        segmented = [(s.extend([t], decode=True, trace=True), s.exit_layer, s.scores) for t in toks[8:]]
    for f, (row, exit_layer, sims) in zip(fused, segmented):
        assert exit_layer == m.n_layer - 1 and len(sims) == m.n_layer
        # Real layers never leave the residual stream unchanged; a similarity of 1 would mean the
        # exit node compared a layer's output with itself.
        assert max(sims) < 0.9999 and min(sims) > -1
        assert np.abs(f - row).max() < LOGIT_TOL
