"""KL divergence from the F16 backbone (measure/divergence.py): the measure the Pareto report and
`river-gguf eval` judge every configuration by."""
import os

import numpy as np
import pytest

from river_gguf import Model
from river_gguf.measure import divergence
from river_gguf.eval import report as evaluate
from river_gguf.measure import data as eval_data
from river_gguf.measure.teacher import score

from support import THREADS


@pytest.fixture(scope="module")
def ref(f16_path):
    return Model(f16_path, n_ctx=512, n_threads=THREADS)


@pytest.fixture(scope="module")
def river(river_gguf_path):
    return Model(river_gguf_path, n_ctx=512, n_threads=THREADS)


@pytest.fixture(scope="module")
def prepared(ref):
    items = [it for d in eval_data.DOMAINS for it in eval_data.select(eval_data.load_domain(d), "evaluation", 2)]
    return evaluate.prepare(ref, items, score_tokens=24, prompt_tokens=128)


def _log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_compare_is_kl_divergence():
    rng = np.random.default_rng(0)
    ref_logits = rng.normal(size=(40, 5000)).astype(np.float32)
    q_logits = (ref_logits + rng.normal(scale=0.5, size=ref_logits.shape)).astype(np.float32)
    targets = rng.integers(0, 5000, size=40)
    q_logits[3] = ref_logits[3]  # a row equal to the reference's
    q_logits[5, 7] = 1e30        # a top token that the reference does not share
    d = divergence.compare(ref_logits, q_logits, targets)
    # numpy in float64 as the oracle
    lp, lq = _log_softmax(ref_logits), _log_softmax(q_logits)
    np.testing.assert_allclose(d.kld, np.maximum((np.exp(lp) * (lp - lq)).sum(-1), 0.0), rtol=1e-9, atol=1e-12)
    assert d.kld[3] == 0.0 and (np.delete(d.kld, 3) > 0).all()
    np.testing.assert_array_equal(d.same_top, ref_logits.argmax(-1) == q_logits.argmax(-1))
    assert d.same_top[3] and not d.same_top[5]
    np.testing.assert_allclose(d.nll, -lq[np.arange(40), targets], rtol=1e-9)
    with pytest.raises(ValueError):
        divergence.compare(ref_logits, q_logits[:3], targets[:3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        divergence.compare(ref_logits, q_logits, np.full(40, 5000))


def test_rows_of_every_spread_match_numpy_in_double():
    """The native exp over the whole range a logit row spans (down to where e^x underflows), and
    vocabularies that are not a multiple of the kernel's lanes: numpy in float64 as the oracle."""
    rng = np.random.default_rng(2)
    for n_vocab, scale in ((5003, 0.01), (4099, 3.0), (2053, 40.0), (1031, 300.0)):
        ref_logits = (rng.normal(size=(9, n_vocab)) * scale).astype(np.float32)
        q_logits = (ref_logits + rng.normal(scale=0.3 * scale, size=ref_logits.shape)).astype(np.float32)
        targets = rng.integers(0, n_vocab, size=9)
        d = divergence.compare(ref_logits, q_logits, targets)
        lp, lq = _log_softmax(ref_logits), _log_softmax(q_logits)
        np.testing.assert_allclose(d.kld, np.maximum((np.exp(lp) * (lp - lq)).sum(-1), 0.0), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(d.nll, -lq[np.arange(9), targets], rtol=1e-9)
        np.testing.assert_array_equal(d.same_top, ref_logits.argmax(-1) == q_logits.argmax(-1))


def test_settings_compared_together_score_as_each_alone():
    """compare_many computes the reference's softmax once for every configuration: each result is
    compare()'s alone, bit for bit, whatever is compared beside it."""
    rng = np.random.default_rng(1)
    ref_logits = rng.normal(size=(12, 3000)).astype(np.float32)
    targets = rng.integers(0, 3000, size=12)
    qs = [(ref_logits + rng.normal(scale=s, size=ref_logits.shape)).astype(np.float32) for s in (0.1, 1.0, 3.0)]
    qs.append(ref_logits.copy())
    together = divergence.compare_many(ref_logits, qs, targets)
    assert len(together) == len(qs)
    for q, d in zip(qs, together):
        alone = divergence.compare(ref_logits, q, targets)
        for key in ("kld", "same_top", "nll"):
            np.testing.assert_array_equal(getattr(d, key), getattr(alone, key))
    assert (together[3].kld == 0).all() and (together[2].kld > together[0].kld).all()
    assert divergence.compare_many(ref_logits, [], targets) == []
    with pytest.raises(ValueError, match="shape"):
        divergence.compare_many(ref_logits, [qs[0], qs[1][:3]], targets)


def test_kld_of_a_file_against_itself_is_zero(ref, prepared):
    runs = divergence.score_configs(ref, {"self": (ref, dict(mode="backbone"))}, prepared)
    s = divergence.summarize(runs["self"])
    assert s["n_tokens"] == sum(len(t) - p for t, p in prepared)
    assert s["kld"] == 0.0 and s["kld_p99"] == 0.0 and s["same_top"] == 1.0
    assert s["kld_ci"] == [0.0, 0.0]


def test_batched_scoring_equals_the_decode_path_for_a_static_f16_setting(ref, prepared):
    """For F16 weights one batched pass computes what teacher-forced decoding computes, up to
    float summation order."""
    b = divergence.score_configs(ref, {"x": (ref, dict(mode="backbone"))}, prepared, batched_static=True)["x"]
    d = divergence.score_configs(ref, {"x": (ref, dict(mode="backbone"))}, prepared, batched_static=False)["x"]
    assert divergence.summarize(b)["kld"] == 0.0 == divergence.summarize(d)["kld"]
    for (toks, prefix), x, y in zip(prepared, b.items, d.items):
        np.testing.assert_allclose(x.nll, y.nll, rtol=1e-2, atol=1e-2)
        batched, _ = divergence.config_logits(ref, toks, prefix, batched=True, mode="backbone")
        decoded, _ = divergence.config_logits(ref, toks, prefix, batched=False, mode="backbone")
        assert np.abs(batched - decoded).max() < 0.2


def test_batched_and_decode_differ_for_q4_0_exactly_as_in_llama_cpp(q4_0_path, prepared):
    """Why reports score every row through decode: for Q4_0 weights ggml's batched and
    single-token kernels give different logits. Stock llama.cpp on the same file shows the very
    same difference, so it is ggml's, not the engine's."""
    import llama_cpp

    toks, prefix = prepared[0]
    m = Model(q4_0_path, n_ctx=512, n_threads=THREADS)
    ours_b, _ = divergence.config_logits(m, toks, prefix, batched=True, mode="backbone")
    ours_d, _ = divergence.config_logits(m, toks, prefix, batched=False, mode="backbone")
    del m
    kw = dict(n_ctx=512, n_threads=THREADS, n_threads_batch=THREADS, logits_all=True, flash_attn=True, verbose=False)
    a = llama_cpp.Llama(q4_0_path, **kw)
    try:
        a.eval(toks)
        ref_b = np.array(a.scores[prefix - 1:len(toks) - 1])
    finally:
        a.close()
    a = llama_cpp.Llama(q4_0_path, **kw)  # a fresh context: an empty KV cache
    try:
        a.eval(toks[:prefix])
        rows = [np.array(a.scores[prefix - 1])]
        for t in toks[prefix:-1]:
            a.eval([t])
            rows.append(np.array(a.scores[a.n_tokens - 1]))
    finally:
        a.close()
    ref_d = np.stack(rows)
    np.testing.assert_array_equal(ours_b, ref_b)
    np.testing.assert_array_equal(ours_d, ref_d)
    assert np.abs(ref_b - ref_d).max() == np.abs(ours_b - ours_d).max() > 0


def test_dynamic_settings_are_never_batched(river, prepared):
    toks, prefix = prepared[0]
    with pytest.raises(ValueError, match="static"):
        divergence.config_logits(river, toks, prefix, batched=True, mode="river", threshold=0.98)
    logits, exits = divergence.config_logits(river, toks, prefix, mode="river", threshold=0.9, tail=0)
    assert logits.shape == (len(toks) - prefix, river.n_vocab) and len(exits) == len(toks) - prefix - 1
    # The decode path is what Model.score computes: the same log p of each actual token.
    r = score(river, toks, prefix=prefix, mode="river", threshold=0.9, tail=0)
    lp = _log_softmax(logits)[np.arange(len(toks) - prefix), toks[prefix:]]
    np.testing.assert_allclose(lp, r.logprobs, rtol=0, atol=1e-9)
    assert list(r.exit_layers[1:]) == exits and min(exits) < river.n_layer - 1  # tau 0.9 exits


def test_bootstrap_interval_is_deterministic_and_covers_the_mean(ref, river, prepared):
    cfg = {"rq": (river, dict(mode="river-only", river_head=True, tail=0)), "bb": (ref, dict(mode="backbone"))}
    runs = divergence.score_configs(ref, cfg, prepared)
    a, b = divergence.summarize(runs["rq"]), divergence.summarize(runs["rq"])
    assert a == b
    assert a["kld_ci"][0] <= a["kld"] <= a["kld_ci"][1] and a["kld_ci"][0] < a["kld_ci"][1]
    assert a["kld_median"] <= a["kld_p99"]
    d = divergence.paired_delta(runs["rq"], runs["bb"])
    assert d["kld"] == pytest.approx(a["kld"]) and d["kld_ci"][0] > 0  # the river is further from F16
    with pytest.raises(ValueError):
        divergence.paired_delta(runs["rq"], divergence.merge([runs["bb"], runs["bb"]]))


def test_reference_rows_read_back_what_was_added(tmp_path):
    rng = np.random.default_rng(0)
    # Odd widths put blocks at offsets no page boundary divides; a block without rows; a float64
    # and a strided block are stored as float32 rows.
    blocks = [rng.standard_normal((n, 7)).astype(np.float32) for n in (3, 1, 5)]
    blocks += [np.zeros((0, 7), np.float32), rng.standard_normal((4, 14))[:, ::2], rng.standard_normal((2000, 7))]
    with divergence.ReferenceRows("F16", str(tmp_path)) as ref:
        for b in blocks[:3]:
            ref.add(b)
        np.testing.assert_array_equal(ref[1], blocks[1])  # read before more rows are added
        for b in blocks[3:]:
            ref.add(b)
        assert ref.label == "F16" and len(ref) == len(blocks)
        assert os.listdir(tmp_path) == []  # unlinked at once: nothing to leave behind
        for i in (2, 0, 1, 2, 3, 4, 5):
            got = ref[i]
            assert got.dtype == np.float32 and got.shape == blocks[i].shape and not got.flags.writeable
            np.testing.assert_array_equal(got, blocks[i].astype(np.float32))
        kept = ref[5]
        with pytest.raises(ValueError):
            ref.add(np.zeros(3, np.float32))
    np.testing.assert_array_equal(kept, blocks[5].astype(np.float32))  # still readable once closed
