"""flash_attn: the engine's two attention paths against llama.cpp with the same setting.

flash_attn=True is ggml_flash_attn_ext over a KV cache with V stored like K (the default, and
what every other test compares). flash_attn=False is llama.cpp's build_attn_mha without flash
attention: KQ (F32 precision), the soft cap, soft_max_ext with an F32 mask, then V^T x KQ over a
V cache stored transposed (llama.cpp's v_trans), with n_kv padded to 256 as llama.cpp's get_n_kv.
Each must give llama.cpp's logits with the same flash_attn, in every River path: the river
writes the transposed V rows the skipped layers owe.

llama.cpp runs with n_threads=1 here, so the reduction order is the engine's; the tolerance is
test_engine_parity's anyway."""
import numpy as np
import pytest

import llama_cpp
from river_gguf import Model, _native
from river_gguf.convert.hybrid import write_hybrid_gguf
from river_gguf.llama import Llama
from river_gguf.convert.hybrid import write_backbone_attention_oracle
from river_gguf.options import ExitOptions

from support import LOGIT_TOL, PROSE


N_CTX = 512
PROMPT = 300          # longer than one 256-row block of the padded n_kv
DECODE_FROM = 250     # single-token steps at positions 250..261 cross the 256 boundary
DECODE_TO = 262

TINY = {
    "llama": dict(n_layer=3, tied=False, rope_freqs=True),
    "qwen2": dict(n_layer=3),
    # attention soft cap (inside the KQ chain without flash attention) and sliding-window layers
    "gemma2": dict(n_layer=3, tied=True, sliding_window=8),
    # joined Q/K/V: V is a strided view of one product, copied contiguous for its cache write
    "phi3": dict(n_layer=3, n_rot=12),
}


def _llama_cpp(path, flash_attn, n_ctx=N_CTX):
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=1, n_threads_batch=1, logits_all=True,
                           flash_attn=flash_attn, verbose=False)


def _ref_logits(llm, toks):
    llm.reset()
    llm.eval(list(toks))
    return np.array(llm.scores[: len(toks)], dtype=np.float32)


def _ref_decode(llm, prompt, steps):
    """llama.cpp's logits of each single-token step after `prompt`."""
    llm.reset()
    llm.eval(list(prompt))
    out = []
    for t in steps:
        llm.eval([t])
        out.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    return np.stack(out)


def _decode(m, prompt, steps, **opts):
    with m.session(**opts) as s:
        s.extend(prompt)
        return np.stack([s.extend([t], decode=True) for t in steps])


def _close(ours, ref):
    assert ours.shape == ref.shape and np.isfinite(ours).all()
    assert np.abs(ours - ref).max() < LOGIT_TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def _check_against_llama_cpp(path, toks, flash_attn):
    m = Model(str(path), n_ctx=N_CTX, n_threads=1, flash_attn=flash_attn)
    assert m.flash_attn is flash_attn
    llm = _llama_cpp(path, flash_attn)
    _close(m.logits(toks), _ref_logits(llm, toks))
    steps = toks[DECODE_FROM:DECODE_TO]
    _close(_decode(m, toks[:DECODE_FROM], steps), _ref_decode(llm, toks[:DECODE_FROM], steps))


def _random_tokens(n_vocab, n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(1, n_vocab, n)]


@pytest.fixture(scope="module")
def tiny_paths(tiny):
    return {arch: tiny.model(arch, seed=7, **kw) for arch, kw in TINY.items()}


@pytest.mark.parametrize("flash_attn", [False, True])
@pytest.mark.parametrize("arch", list(TINY))
def test_tiny_models_match_llama_cpp(arch, flash_attn, tiny_paths):
    path = tiny_paths[arch]
    n_vocab = Model(path, n_ctx=8, n_threads=1).n_vocab
    _check_against_llama_cpp(path, _random_tokens(n_vocab, PROMPT), flash_attn)


@pytest.fixture(scope="module")
def long_prose(q4_1_path):
    toks = Model(q4_1_path, n_ctx=8, n_threads=1).tokenize((PROSE + " ") * 6)[:PROMPT]
    assert len(toks) == PROMPT
    return toks


@pytest.mark.parametrize("flash_attn", [False, True])
def test_smollm2_matches_llama_cpp(flash_attn, q4_1_path, long_prose):
    _check_against_llama_cpp(q4_1_path, long_prose, flash_attn)


def test_prompt_chunks_without_flash_attention(q4_1_path, long_prose):
    # n_batch=64: later chunks read the transposed V rows earlier graphs wrote.
    m = Model(q4_1_path, n_ctx=N_CTX, n_threads=1, n_batch=64, flash_attn=False)
    _close(m.logits(long_prose), _ref_logits(_llama_cpp(q4_1_path, False), long_prose))


def test_llama_greedy_completion_matches_llama_cpp(q4_1_path):
    kw = dict(n_ctx=N_CTX, n_threads=1, n_threads_batch=1, seed=3, verbose=False)
    prompt = "Once upon a time, in a small village by the sea,"
    ours = Llama(q4_1_path, flash_attn=False, **kw)
    assert ours.river_model.flash_attn is False
    theirs = llama_cpp.Llama(q4_1_path, flash_attn=False, **kw)
    a = ours(prompt, max_tokens=48, temperature=0.0)
    b = theirs(prompt, max_tokens=48, temperature=0.0)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"] == b["usage"]


def test_llama_default_is_llama_cpps(q4_1_path):
    # llama_cpp.Llama's default is flash_attn=False; the drop-in keeps it, and passes True through.
    assert Llama(q4_1_path, n_ctx=64, n_threads=1, verbose=False).river_model.flash_attn is False
    assert Llama(q4_1_path, n_ctx=64, n_threads=1, flash_attn=True, verbose=False).river_model.flash_attn is True
    assert Model(q4_1_path, n_ctx=64, n_threads=1).flash_attn is True


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0])
def test_flash_attn_must_be_a_bool(bad, q4_1_path):
    with pytest.raises(ValueError, match="flash_attn"):
        Model(q4_1_path, n_ctx=64, n_threads=1, flash_attn=bad)
    with pytest.raises(ValueError, match="flash_attn"):
        Llama(q4_1_path, n_ctx=64, n_threads=1, flash_attn=bad, verbose=False)


# --- River without flash attention ----------------------------------------------------------------

@pytest.fixture(scope="module")
def river_files(tiny):
    """(plain tiny llama, its River GGUF with a Q4_0 river)."""
    model = dict(n_layer=4, seed=11)
    return tiny.model("llama", **model), tiny.river("llama", model)


@pytest.fixture(scope="module")
def river_model(river_files):
    return Model(river_files[1], n_ctx=N_CTX, n_threads=1, threshold=0.9, flash_attn=False)


@pytest.fixture(scope="module")
def river_tokens(river_model):
    return _random_tokens(river_model.n_vocab, PROMPT, seed=5)


def _same_as_llama_cpp(m, plain_file, toks, **opts):
    """Prompt logits and decode steps across the 256 boundary equal llama.cpp (flash_attn off) on
    the plain file that holds exactly the layers `opts` run."""
    llm = _llama_cpp(plain_file, False)
    _close(m.logits(toks, **opts), _ref_logits(llm, toks))
    steps = toks[DECODE_FROM:DECODE_TO]
    _close(_decode(m, toks[:DECODE_FROM], steps, **opts), _ref_decode(llm, toks[:DECODE_FROM], steps))


@pytest.mark.parametrize("k,tail", [(0, 0), (1, 0), (0, 1)])
def test_forced_exit_equals_hybrid_gguf(k, tail, river_files, river_model, river_tokens, tmp_path):
    rv = river_files[1]
    hybrid = tmp_path / "hybrid.gguf"
    write_hybrid_gguf(rv, rv, hybrid, exit_layer=k, river_head=False, tail=tail)
    _same_as_llama_cpp(river_model, hybrid, river_tokens, exit_layer=k, tail=tail, river_head=False)


def test_river_only_equals_the_river_file(river_files, river_model, river_tokens, tmp_path):
    rv = river_files[1]
    river_file = tmp_path / "river-only.gguf"
    write_hybrid_gguf(rv, rv, river_file, exit_layer=-1, river_head=True)
    _same_as_llama_cpp(river_model, river_file, river_tokens, mode="river-only", river_head=True)


def test_backbone_attention_equals_the_mixed_gguf(river_files, river_model, river_tokens, tmp_path):
    plain, rv = river_files
    mixed = write_backbone_attention_oracle(plain, rv, tmp_path)
    _same_as_llama_cpp(river_model, mixed, river_tokens, mode="river-only", river_head=True,
                       river_attention="backbone")


def test_dynamic_exit_equals_the_forced_exit(river_model, river_tokens):
    # threshold -1 passes every similarity: the step leaves right after min_exit_layer.
    s = river_model.session(ExitOptions(mode="backbone"))
    for k in range(river_model.n_layer - 1):
        s.truncate(0)
        s.extend(river_tokens[:DECODE_FROM])
        dynamic = ExitOptions(mode="river", threshold=-1.0, min_exit_layer=k)
        dyn = [(s.extend([t], decode=True, options=dynamic), s.exit_layer)
               for t in river_tokens[DECODE_FROM:DECODE_TO]]
        s.truncate(DECODE_FROM)
        forced = ExitOptions(exit_layer=k)
        fixed = [s.extend([t], decode=True, options=forced) for t in river_tokens[DECODE_FROM:DECODE_TO]]
        for (ld, kd), lf in zip(dyn, fixed):
            assert kd == k and np.array_equal(ld, lf)
    s.close()


def test_no_cache_holes_after_mixed_exits(river_files, river_tokens):
    # A fresh engine: without flash attention an unwritten entry holds POISON_NO_FLASH (finite,
    # since the V product spans masked rows too). Decode steps that leave at every depth,
    # river-only and dynamic exits included, some with a tail, must write every row of every layer.
    e = _native.Engine(river_files[1], n_ctx=N_CTX, n_threads=1, flash_attn=False)
    poison = _native.Engine.POISON_NO_FLASH
    assert np.isfinite(poison) and poison != 0
    L = e.hparams["n_layer"]
    assert (e.cache_rows(0, True, 4) == poison).all()
    e.eval(river_tokens[:DECODE_FROM - 10])
    exits = set()
    for i, tok in enumerate(river_tokens[DECODE_FROM - 10:DECODE_TO]):
        k = i % (L + 2) - 1
        if k < 0:
            logits, got, _ = e.eval([tok], mode=2, river_head=True)
        elif k == L:
            logits, got, _ = e.eval([tok], mode=1, threshold=-1.0, min_exit_layer=i % 2)
        else:
            logits, got, _ = e.eval([tok], mode=3, exit_layer=k, tail=i % 2 if k < L - 2 else 0)
        assert np.isfinite(logits).all()
        exits.add(got)
    assert len(exits) >= L
    n = e.n_past
    assert n == DECODE_TO
    for layer in range(L):
        for values in (False, True):
            rows = e.cache_rows(layer, values, n)
            assert np.isfinite(rows).all(), f"NaN in layer {layer} {'V' if values else 'K'}"
            assert not (rows == poison).all(axis=1).any(), f"hole in layer {layer} {'V' if values else 'K'}"
    # Past the last written position the poison is still there: the check above can fail.
    for values in (False, True):
        assert (e.cache_rows(0, values, n + 1)[n] == poison).all()
