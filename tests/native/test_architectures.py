"""The architectures beyond llama/qwen (granite, olmo2, gemma2, gemma3, phi3, mistral3) against stock llama.cpp,
on random-weight models written by river_gguf.eval.random_model, and River's invariants (RIVER.md 1-6) on each.

Every prompt is longer than the sliding window of the models that have one (8 positions), so the
windowed layers read a cache with rows outside their window, in the backbone and in the river."""
import re

import numpy as np
import pytest

import river_gguf
from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.convert.hybrid import write_hybrid_gguf
from river_gguf.eval.random_model import YARN_ORIG_CTX, write_tiny_model
from river_gguf.convert.hybrid import write_backbone_attention_oracle
from river_gguf.measure.teacher import score
from river_gguf.options import ExitOptions

from support import LOGIT_TOL, PROSE, THREADS, write_unsupported_arch
from river_gguf.gguf.reader import GGUFReader


WINDOW = 8
N_GREEDY = 24

# Each case a tiny model that shows what its family adds.
CASES = {
    # every multiplier different from 1
    "granite": ("granite", dict(n_layer=3)),
    # q/k norms over the whole projection, post-norms only
    "olmo2": ("olmo2", dict(n_layer=3)),
    # OLMo 3's layout: layers 0-2 slide their window, layer 3 is global
    "olmo2-swa": ("olmo2", dict(n_layer=4, sliding_window=WINDOW)),
    # layers 0 and 2 slide their window; attention and final caps; tied head
    "gemma2": ("gemma2", dict(n_layer=3, tied=True, sliding_window=WINDOW)),
    # layers 0-4 slide (rope base 10000), layer 5 is global (the file's base), layer 6 slides;
    # head size 32 with 4 heads on a width of 64 (gemma's key_length)
    "gemma3": ("gemma3", dict(n_layer=7, head_dim=32, sliding_window=WINDOW)),
    # joined Q/K/V and gate/up; 12 of 16 dims rotated; grouped KV heads
    "phi3": ("phi3", dict(n_layer=3, n_rot=12)),
    # Phi-3-128k / Phi-4-mini: LongRoPE factors and attn_factor (n_ctx 256 runs the short set)
    "phi3-longrope": ("phi3", dict(n_layer=3, n_rot=12, longrope=True)),
    # Ministral 3: YaRN rope and the attention temperature, over an original context of 40
    # positions that every prompt here runs past (the temperature changes there)
    "mistral3": ("mistral3", dict(n_layer=3)),
}
SWA_CASES = ("olmo2-swa", "gemma2", "gemma3")


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param


@pytest.fixture(scope="module")
def files(case, tiny):
    """(plain model, River GGUF with a Q4_0 river) of the case."""
    arch, kw = CASES[case]
    model = dict(seed=11, **kw)
    return tiny.model(arch, **model), tiny.river(arch, model)


@pytest.fixture(scope="module")
def river_model(files):
    return Model(files[1], n_ctx=256, n_threads=THREADS, threshold=0.9)


@pytest.fixture(scope="module")
def prose_tokens(river_model):
    toks = river_model.tokenize(PROSE)
    assert len(toks) > 5 * WINDOW
    return toks


def _same_as_oracle(m, oracle, toks, **opts):
    ours = m.logits(toks, **opts)
    ref = oracle.logits(toks)
    assert ours.shape == ref.shape and np.isfinite(ours).all()
    assert np.abs(ours - ref).max() < LOGIT_TOL
    assert (ours.argmax(1) == ref.argmax(1)).all()
    prompt = toks[:12]
    g = greedy(m, prompt, max_tokens=N_GREEDY, **opts)
    assert g.tokens == oracle.greedy(prompt, N_GREEDY)


# --- the backbone against llama.cpp ---------------------------------------------------------------

def test_logits_and_greedy_match_llama_cpp(files, prose_tokens, oracle_factory):
    plain, _ = files
    oracle = oracle_factory(plain, 256)
    _same_as_oracle(Model(plain, n_ctx=256, n_threads=THREADS), oracle, prose_tokens)
    # Prompt chunks of 16: later chunks read the window's rows written by earlier graphs.
    chunked = Model(plain, n_ctx=256, n_threads=1, n_batch=16).logits(prose_tokens)
    assert np.abs(chunked - oracle.logits(prose_tokens)).max() < LOGIT_TOL


@pytest.mark.parametrize("case", SWA_CASES, indirect=True)
def test_the_sliding_window_is_live(case, files, tmp_path):
    # The same weights with a window longer than the prompt: the logits agree while every
    # position is inside the window and differ after it, so the window does mask.
    arch, kw = CASES[case]
    wide = write_tiny_model(tmp_path / "wide.gguf", arch, seed=11, **{**kw, "sliding_window": 512})
    toks = Model(files[0], n_ctx=8).tokenize(PROSE)
    a = Model(files[0], n_ctx=128, n_threads=THREADS).logits(toks)
    b = Model(wide, n_ctx=128, n_threads=THREADS).logits(toks)
    assert np.array_equal(a[:WINDOW], b[:WINDOW])
    assert np.abs(a[WINDOW:] - b[WINDOW:]).max(axis=1).min() > LOGIT_TOL


# --- River's invariants -----------------------------------------------------------------------------

def test_invariant1_threshold_above_one_is_the_backbone(river_model, prose_tokens):
    toks = prose_tokens[:3 * WINDOW]
    river = score(river_model, toks, prefix=8, mode="river", threshold=1.01)
    backbone = score(river_model, toks, prefix=8, mode="backbone")
    assert np.array_equal(river.logprobs, backbone.logprobs)
    assert (river.exit_layers == river_model.n_layer - 1).all()
    a = greedy(river_model, prose_tokens[:10], max_tokens=16, mode="river", threshold=1.01)
    b = greedy(river_model, prose_tokens[:10], max_tokens=16, mode="backbone")
    assert a.tokens == b.tokens and a.stats["river_layer_share"] == 0.0


@pytest.mark.parametrize("where", ["first", "middle"])
def test_invariant2_forced_exit_equals_hybrid_gguf_in_llama_cpp(where, files, river_model, prose_tokens, tmp_path,
                                                                 oracle_factory):
    k = 0 if where == "first" else river_model.n_layer // 2
    rv = files[1]
    hybrid = tmp_path / "hybrid.gguf"
    write_hybrid_gguf(rv, rv, hybrid, exit_layer=k, river_head=False)
    _same_as_oracle(river_model, oracle_factory(str(hybrid), 256), prose_tokens, exit_layer=k, river_head=False)


def test_invariant3_river_only_equals_the_river_in_llama_cpp(files, river_model, prose_tokens, tmp_path,
                                                             oracle_factory):
    # exit_layer -1 with the river head: the river's embeddings, layers and head, as a plain file.
    rv = files[1]
    river_file = tmp_path / "river-only.gguf"
    write_hybrid_gguf(rv, rv, river_file, exit_layer=-1, river_head=True)
    _same_as_oracle(river_model, oracle_factory(str(river_file), 256), prose_tokens, mode="river-only",
                    river_head=True)


def test_invariant4_no_cache_holes_after_mixed_exits(files, prose_tokens):
    # A fresh model (its cache starts as NaN), then decode steps that leave at every depth,
    # river-only included, some with a backbone tail: every row of every layer gets written,
    # the windowed layers' too.
    m = Model(files[1], n_ctx=128, n_threads=1, threshold=0.9)
    L = m.n_layer
    assert np.isnan(m.cache_rows(0, False, 4)).all()
    s = m.session(ExitOptions(mode="backbone"))
    s.extend(prose_tokens[:12])
    for i, tok in enumerate(prose_tokens[12:40]):
        k = i % (L + 1) - 1
        if k < 0:
            s.extend([tok], decode=True, options=ExitOptions(mode="river-only", river_head=True))
        else:
            s.extend([tok], decode=True, options=ExitOptions(exit_layer=k, tail=i % 2 if k < L - 2 else 0))
    n = m.n_past
    assert n == s.n_past == 40
    for layer in range(L):
        for values in (False, True):
            rows = m.cache_rows(layer, values, n)
            assert np.isfinite(rows).all(), f"hole in layer {layer} {'V' if values else 'K'}"
            assert np.abs(rows).max(axis=1).min() > 0
    assert np.isnan(m.cache_rows(0, False, n + 1)[n]).all()


def test_invariant5_forced_exit_with_tail_equals_hybrid_gguf(case, files, river_model, prose_tokens, tmp_path,
                                                            oracle_factory):
    # With the river's head where a file can hold it: gemma2's head is always its embedding
    # table, so its hybrid with the backbone's embeddings has the backbone's head.
    rv, tail, river_head = files[1], 1, case != "gemma2"
    hybrid = tmp_path / "hybrid-tail.gguf"
    write_hybrid_gguf(rv, rv, hybrid, exit_layer=0, river_head=river_head, tail=tail)
    _same_as_oracle(river_model, oracle_factory(str(hybrid), 256), prose_tokens, exit_layer=0, tail=tail,
                    river_head=river_head)


def test_invariant6_backbone_attention_equals_the_mixed_gguf(files, river_model, prose_tokens, tmp_path,
                                                             oracle_factory):
    # River layers with the backbone's attention group (phi3's joined attn_qkv, gemma's and
    # olmo2's post-attention norm included) and the river's FFN.
    plain, rv = files
    mixed = write_backbone_attention_oracle(plain, rv, tmp_path)
    _same_as_oracle(river_model, oracle_factory(str(mixed), 256), prose_tokens, mode="river-only", river_head=True,
                    river_attention="backbone")


def test_dynamic_exit_follows_the_rule_and_equals_the_forced_exit(river_model, prose_tokens):
    # The similarity test picks the depth; the step then equals a forced exit there. tau sits just
    # below this token's largest similarity among the layers a token may leave after, so it exits.
    L = river_model.n_layer
    exited = 0
    s = river_model.session(ExitOptions(mode="backbone"))
    for i in range(16, 24):
        prompt, tok = prose_tokens[:i], prose_tokens[i]
        s.truncate(0)
        s.extend(prompt)
        s.extend([tok], trace=True)
        tau = max(s.scores[:L - 1]) - 1e-4
        s.truncate(len(prompt))
        dyn = s.extend([tok], decode=True, trace=True, options=ExitOptions(mode="river", threshold=tau))
        k, seen = s.exit_layer, s.scores
        assert k == next(l for l, x in enumerate(seen) if x > tau)
        exited += k < L - 1
        s.truncate(len(prompt))
        fixed = s.extend([tok], decode=True, options=ExitOptions(exit_layer=k))
        assert np.array_equal(dyn, fixed)
    s.close()
    assert exited > 0


# --- refusals ---------------------------------------------------------------------------------------

def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    p = write_unsupported_arch(tmp_path / "mamba.gguf")
    with pytest.raises(river_gguf.UnsupportedModelError,
                       match=r"supported: llama, qwen2, qwen3, granite, olmo2, gemma2, gemma3, phi3"):
        Model(p, n_ctx=16)


@pytest.mark.parametrize("arch,key,value,error,match", [
    ("gemma2", "attention.sliding_window", 0, "format", r"sliding_window = 0 is invalid"),
    ("gemma2", "attention.sliding_window", None, "format", r"lacks the required key gemma2\.attention\.sliding_window"),
    ("gemma3", "attention.sliding_window", None, "unsupported", r"gemma3 without a sliding window"),
    ("gemma2", "attn_logit_softcapping", float("nan"), "format", r"attn_logit_softcapping = nan is invalid"),
    ("gemma2", "attention.sliding_window_pattern", 3, "unsupported", r"sliding_window_pattern"),
    ("gemma3", "rope.freq_base_swa", -1.0, "format", r"freq_base_swa = -1 is invalid"),
    ("granite", "logit_scale", None, "format", r"lacks the required key granite\.logit_scale"),
    ("granite", "residual_scale", -1.0, "format", r"residual_scale = -1 is invalid"),
    ("olmo2", "attention.key_length", 32, "format", r"key_length = 32 is invalid"),
    ("phi3", "rope.scaling.attn_factor", -1.0, "format", r"attn_factor = -1 is invalid"),
    ("phi3", "rope.scaling.original_context_length", 0, "format", r"original_context_length = 0 is invalid"),
])
def test_bad_family_hyperparameters_are_refused(arch, key, value, error, match, tmp_path):
    src = write_tiny_model(tmp_path / "src.gguf", arch)
    dst = tmp_path / "bad.gguf"
    _rewrite(src, dst, f"{arch}.{key}", value)
    err = river_gguf.GGUFFormatError if error == "format" else river_gguf.UnsupportedModelError
    with pytest.raises(err, match=match):
        Model(str(dst), n_ctx=16)


@pytest.mark.parametrize("extra", [{"gemma3.rope.freq_base_swa": 5000.0}, {"gemma3.attention.sliding_window_pattern": 3}])
def test_gemma3_window_period_and_sliding_rope_base_follow_the_file(extra, tmp_path, oracle_factory):
    # Both keys change llama.cpp's logits (a period of 3 makes layers 2 and 5 global).
    src = write_tiny_model(tmp_path / "src.gguf", "gemma3", n_layer=7, head_dim=32, sliding_window=WINDOW)
    dst = tmp_path / "keyed.gguf"
    (key, value), = extra.items()
    _rewrite(src, dst, key, value)
    m = Model(str(dst), n_ctx=128, n_threads=THREADS)
    toks = m.tokenize(PROSE)
    ref = oracle_factory(str(dst), 128).logits(toks)
    assert np.abs(m.logits(toks) - ref).max() < LOGIT_TOL
    assert np.abs(Model(src, n_ctx=128, n_threads=THREADS).logits(toks) - ref).max() > 10 * LOGIT_TOL


@pytest.fixture(scope="module")
def longrope_file(tmp_path_factory):
    arch, kw = CASES["phi3-longrope"]
    return write_tiny_model(tmp_path_factory.mktemp("longrope") / "longrope.gguf", arch, **kw)


@pytest.mark.parametrize("n_ctx", [256, 280, 512])
def test_phi3_longrope_picks_its_factors_by_context_as_llama_cpp(n_ctx, longrope_file, oracle_factory):
    # The file's original context is LONGROPE_ORIG_CTX = 300. 256 positions run the short
    # factors; 280 would too by its length, but llama.cpp rounds a context up to 256 positions
    # first (512) and so runs the long ones, as 512 does.
    src = longrope_file
    m = Model(src, n_ctx=n_ctx, n_threads=THREADS)
    toks = m.tokenize(PROSE)
    assert np.abs(m.logits(toks) - oracle_factory(src, n_ctx).logits(toks)).max() < LOGIT_TOL


def test_phi3_longrope_factors_and_attn_factor_are_live(longrope_file, tmp_path):
    # Each part changes the logits, so the parity above tests all of them.
    src = longrope_file
    no_factor = tmp_path / "no-attn-factor.gguf"
    _rewrite(src, no_factor, "phi3.rope.scaling.attn_factor", None)
    toks = Model(src, n_ctx=8).tokenize(PROSE)
    short = Model(src, n_ctx=256, n_threads=THREADS).logits(toks)
    long = Model(src, n_ctx=512, n_threads=THREADS).logits(toks)
    plain = Model(str(no_factor), n_ctx=256, n_threads=THREADS).logits(toks)
    assert np.abs(short - long).max() > 10 * LOGIT_TOL
    assert np.abs(short - plain).max() > 10 * LOGIT_TOL


@pytest.mark.parametrize("name", ["rope_factors_long.weight", "rope_factors_short.weight"])
def test_phi3_longrope_factors_of_the_wrong_length_are_refused(name, tmp_path):
    src = write_tiny_model(tmp_path / "src.gguf", "phi3", n_rot=12)
    dst = tmp_path / "bad-factors.gguf"
    _rewrite(src, dst, None, None, extra_tensor=(name, np.ones(5, dtype=np.float32)))
    with pytest.raises(river_gguf.GGUFFormatError, match=re.escape(name)):
        Model(str(dst), n_ctx=16)


def _rewrite(src, dst, key, value, extra_tensor=None):
    """Copy the F32 GGUF `src` to `dst` with metadata `key` set to `value` (None: left out), and
    an extra tensor."""
    import contextlib

    import gguf
    from river_gguf.gguf.io import metadata_items

    r = GGUFReader(src)
    with contextlib.closing(gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))) as w:
        for k, v, vtype, sub in metadata_items(r, [key] if key else []):
            w.add_key_value(k, v, vtype, sub_type=sub)
        if key is not None and value is not None:
            w.add_float32(key, value) if isinstance(value, float) else w.add_uint32(key, value)
        for t in r.tensors:
            w.add_tensor(t.name, np.array(t.data))
        if extra_tensor:
            w.add_tensor(*extra_tensor)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()


# --- rope scaling with the real models' hyperparameters ----------------------------------------------

@pytest.mark.parametrize("rope", ["llama3.1", "llama3.2"])
def test_llama3_rope_factors_match_llama_cpp(rope, tmp_path, oracle_factory):
    # Llama 3.1/3.2's rope base (500000) and per-dimension factors over 64-wide heads.
    path = write_tiny_model(tmp_path / f"{rope}.gguf", "llama", n_layer=2, n_embd=128, n_head=2, n_head_kv=1,
                            rope_freqs=rope, seed=4)
    m = Model(path, n_ctx=256, n_threads=THREADS)
    _same_as_oracle(m, oracle_factory(path, 256), m.tokenize(PROSE))


def test_mistral3_temperature_is_live(tmp_path):
    # The attention temperature scales Q from the original context on: the same weights without
    # it give the same logits up to position YARN_ORIG_CTX - 1 and others after it.
    a = write_tiny_model(tmp_path / "a.gguf", "mistral3", n_layer=3, seed=11)
    b = write_tiny_model(tmp_path / "b.gguf", "mistral3", n_layer=3, seed=11, attn_temperature=0.0)
    toks = Model(a, n_ctx=8).tokenize(PROSE)
    assert len(toks) > YARN_ORIG_CTX + 8
    la = Model(a, n_ctx=256, n_threads=THREADS).logits(toks)
    lb = Model(b, n_ctx=256, n_threads=THREADS).logits(toks)
    assert np.array_equal(la[:YARN_ORIG_CTX], lb[:YARN_ORIG_CTX])
    assert np.abs(la[YARN_ORIG_CTX:] - lb[YARN_ORIG_CTX:]).max(axis=1).min() > LOGIT_TOL
