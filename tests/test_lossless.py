"""Lossless mode: the river drafts, the backbone verifies the drafts in one batch, and the text is
the backbone's, token for token (RIVER.md invariants 6 and 7).

The reference is the same file in mode="backbone" decoding in the verify batch's kernels
(verify_kernels: each step's token with a throwaway in one batch) at the same seed and sampler
settings; the verify batch's logits are checked against stock llama.cpp evaluating the same
tokens in one batch after the same prefix."""
import numpy as np
import pytest

import llama_cpp
from river_gguf import Model
from river_gguf.llama import Llama
from river_gguf.session import STOP
from river_gguf.measure.teacher import score

from support import LOGIT_TOL, PROSE, THREADS, generated_tokens


N_TOKENS = 48
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1, seed=1234)


@pytest.fixture(scope="module")
def tiny_rivers(tiny):
    """Random qwen2 and gemma3 models (gemma3 with a sliding window shorter than the prompts),
    each as a River GGUF with a Q4_0 river."""
    return {arch: tiny.river(arch, dict(seed=5, **kw))
            for arch, kw in (("qwen2", dict(n_layer=3)), ("gemma3", dict(n_layer=4, head_dim=32, sliding_window=8)))}


def _llama(path, **kw):
    return Llama(path, n_ctx=256, n_threads=THREADS, flash_attn=True, verbose=False, **kw)


@pytest.fixture(scope="module")
def smol(river_gguf_path):
    return _llama(river_gguf_path)


_EXACT = {}


def _exact(llm):
    """The exact reference for `llm`'s file: its backbone decoding in the verify batch's kernels
    (verify_kernels: each step's token with a throwaway in one batch), which lossless mode equals
    bit for bit, at any seed (one per file and worker)."""
    if llm.model_path not in _EXACT:
        _EXACT[llm.model_path] = _llama(llm.model_path, verify_kernels=True)
    return _EXACT[llm.model_path]


def _completion_tokens(llm, prompt, **kw):
    """The sampled tokens of one completion (every token, end-of-generation included)."""
    return generated_tokens(llm, prompt, N_TOKENS, **kw)


def _why_they_differ(llm, prompt_toks, a, b) -> str:
    """At the first token where two runs part, whether the backbone's single-token and batched
    logits pick different tokens there (a near-tie that the two evaluations round differently):
    the one allowed cause of a difference (RIVER.md invariant 6)."""
    i = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
    m = Model(llm.model_path, n_ctx=256, n_threads=THREADS)
    prefix = prompt_toks + a[:i]
    batched = m.logits(prefix, mode="backbone")[-1]
    with m.session(mode="backbone") as s:
        s.extend(prefix[:-1])
        single = s.extend(prefix[-1:], decode=True)
    top2 = np.sort(single)[-2:]
    return (f"token {i}: lossless {a[i]} vs backbone {b[i]}; backbone argmax single {int(single.argmax())} "
            f"batched {int(batched.argmax())}; top-2 margin {top2[1] - top2[0]:.3g}, "
            f"largest |single - batched| {np.abs(single - batched).max():.3g}")


#: A round drafts draft_max river drafts, as the drafting tests here assume: the default planner's
#: choices follow its clock and the rounds before (tests/test_lossless_ngram.py covers it).
FIXED_DRAFTS = dict(ngram_draft=False, adaptive_draft=False)


def _assert_lossless(llm, prompt, **kw):
    prompt_toks, lossless = _completion_tokens(llm, prompt, mode="lossless", **FIXED_DRAFTS, **kw)
    stats = dict(llm.last_stats)
    _, backbone = _completion_tokens(_exact(llm), prompt, mode="backbone", **kw)
    assert lossless == backbone, _why_they_differ(llm, prompt_toks, lossless, backbone)
    # Drafting happened, and some drafts were accepted: the rounds did verify more than one token.
    assert stats["mode"] == "lossless" and stats["rounds"] > 0 and stats["drafted"] > 0
    assert 0 <= stats["accepted"] <= stats["drafted"]
    return stats


# --- invariant 6: the backbone's tokens -------------------------------------------------------------

def test_greedy_lossless_is_the_backbone_smollm2(smol):
    stats = _assert_lossless(smol, "The three most important rivers of Europe are", temp=0.0)
    assert stats["accepted"] > 0


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_greedy_lossless_is_the_backbone_random_models(tiny_rivers, arch):
    _assert_lossless(_llama(tiny_rivers[arch]), PROSE[:120], temp=0.0)


def test_sampled_lossless_is_the_backbone(smol):
    # Temperature, top-k, top-p and a repeat penalty at a fixed seed: the chain samples each
    # verified row in order, so the RNG and the penalties' history advance as in backbone mode,
    # and the rows are the exact reference's bit for bit.
    kw = dict(temp=SAMPLED["temperature"], top_k=SAMPLED["top_k"], top_p=SAMPLED["top_p"],
              repeat_penalty=SAMPLED["repeat_penalty"])
    smol.set_seed(SAMPLED["seed"])
    prompt_toks, lossless = _completion_tokens(smol, "Once upon a time", mode="lossless", **kw)
    ref = _exact(smol)
    ref.set_seed(SAMPLED["seed"])
    _, backbone = _completion_tokens(ref, "Once upon a time", mode="backbone", **kw)
    assert lossless == backbone, _why_they_differ(smol, prompt_toks, lossless, backbone)


def test_sampled_drafts_draw_with_the_chains_state(f16_path):
    """Sampled drafts come from a copy of the call's chain (same random state and history): with
    a river that is the backbone itself, the copy draws the backbone's own tokens, so nearly every
    draft is accepted (greedy drafts against sampled text would match only the rows whose draw is
    the top token), and the text is still the backbone's."""
    llm = _llama(f16_path, river=f16_path)
    kw = dict(temp=SAMPLED["temperature"], top_k=SAMPLED["top_k"], top_p=SAMPLED["top_p"],
              repeat_penalty=SAMPLED["repeat_penalty"])
    llm.set_seed(SAMPLED["seed"])
    prompt_toks, lossless = _completion_tokens(llm, PROSE, mode="lossless", **FIXED_DRAFTS, **kw)
    stats = dict(llm.last_stats)
    ref = _exact(llm)
    ref.set_seed(SAMPLED["seed"])
    _, backbone = _completion_tokens(ref, PROSE, mode="backbone", **kw)
    assert lossless == backbone, _why_they_differ(llm, prompt_toks, lossless, backbone)
    assert stats["drafted"] > 0 and stats["acceptance_rate"] >= 0.9, stats


def test_sampled_completion_and_draft_settings(smol):
    prompt = "List four colours:"
    ref = _exact(smol).create_completion(prompt, max_tokens=32, mode="backbone", **SAMPLED)["choices"][0]["text"]
    for kw in (dict(), dict(draft_max=1), dict(draft_max=8, draft_p_min=0.6), dict(draft_mode="river", threshold=0.9)):
        got = smol.create_completion(prompt, max_tokens=32, mode="lossless", **kw, **SAMPLED)["choices"][0]["text"]
        assert got == ref, kw


def test_json_mode_lossless_is_the_backbone(smol):
    messages = [{"role": "user", "content": "Give a JSON object with a name and an age."}]
    kw = dict(messages=messages, response_format={"type": "json_object"}, max_tokens=48, temperature=0.0)
    ref = _exact(smol).create_chat_completion(mode="backbone", **kw)["choices"][0]["message"]["content"]
    got = smol.create_chat_completion(mode="lossless", **FIXED_DRAFTS, **kw)["choices"][0]["message"]["content"]
    assert got == ref
    assert smol.last_stats["mode"] == "lossless" and smol.last_stats["drafted"] > 0


def test_streaming_lossless_gives_the_same_text(smol):
    kw = dict(max_tokens=24, temperature=0.0, mode="lossless")
    whole = smol.create_completion("The capital of France", **kw)["choices"][0]["text"]
    pieces = [c["choices"][0]["text"] for c in smol.create_completion("The capital of France", stream=True, **kw)]
    assert len(pieces) > 1 and "".join(pieces) == whole


# --- the verify batch and the cache (invariant 7) ---------------------------------------------------

def _drafted(path, n_prompt: int, draft_max: int, **model_kw):
    """A model and a lossless session whose cache holds a prompt of n_prompt - 1 tokens of PROSE,
    and the river's drafts after its last token: (model, session, prefix, that token, drafts,
    their probabilities)."""
    m = Model(path, n_ctx=256, n_threads=THREADS, **model_kw)
    s = m.session(mode="lossless", draft_max=draft_max)
    toks = m.tokenize(PROSE)[:n_prompt]
    prefix, nxt = toks[:-1], toks[-1]
    s.extend(prefix)
    drafts, probs = s.draft(nxt, with_probs=True)
    return m, s, prefix, nxt, drafts, probs


@pytest.mark.parametrize("kernels", ["decode", "batch"])
def test_verify_rows_are_llama_cpps(river_gguf_path, f16_path, kernels):
    """In the decode steps' kernels (the default), each verify row is what stock llama.cpp's decode
    step gives for that token after the same prefix, bit for bit; in the batched kernels, what
    llama.cpp's batch of the same tokens gives, up to the threads' reduction order."""
    m, s, prefix, nxt, drafts, probs = _drafted(river_gguf_path, 40, 5, lossless_kernels=kernels)
    assert m.lossless_kernels == kernels
    assert len(drafts) == 5 and len(probs) == 5 and all(0 < p <= 1 for p in probs)
    assert m.n_past == s.n_past == len(prefix)  # drafting leaves the cache's length alone
    batch = [nxt] + drafts
    ours = s.verify(batch)
    # llama.cpp: the same prefix, then the same tokens (the F16 file is the backbone).
    ref = llama_cpp.Llama(f16_path, n_ctx=256, n_threads=THREADS, n_threads_batch=THREADS, logits_all=True,
                          flash_attn=True, verbose=False)
    try:
        ref.eval(prefix)
        if kernels == "decode":
            for t in batch:
                ref.eval([t])
        else:
            ref.eval(batch)
        theirs = np.array(ref.scores[len(prefix):len(prefix) + len(batch)], dtype=np.float32)
    finally:
        ref.close()
    assert ours.shape == theirs.shape
    if kernels == "decode":
        assert np.array_equal(ours, theirs), np.abs(ours - theirs).max()
    else:
        assert np.abs(ours - theirs).max() < LOGIT_TOL
        assert (ours.argmax(1) == theirs.argmax(1)).all()


# Single-token and batched evaluation of the F16 backbone round differently (the CPU's mat-mul
# kernels differ): a decode step and a batch over the same cache differ by about 1e-2 in the logits.
ROUNDING_TOL = 5e-2


def _after_rejection(path, keep, drafted=True, rejected=None, truncate=True):
    """Prefix, a lossless round with 4 drafts of which `keep` are accepted, then a decode step of a
    token other than the rejected draft: (its logits, the model, the kept tokens). drafted=False
    verifies the same tokens without the river's draft rows written first; `rejected` replaces the
    rejected drafts in the verify batch."""
    m, s, prefix, nxt, drafts, _ = _drafted(path, 30, 4)
    assert len(drafts) == 4
    if not drafted:
        s.truncate(0)
        s.extend(prefix)
    batch = [nxt] + drafts[:keep] + (drafts[keep:] if rejected is None else [rejected] * (4 - keep))
    s.verify(batch)
    if truncate:
        s.truncate(len(prefix) + 1 + keep)
    follow = 42 if 42 != drafts[keep] else 43
    kept = prefix + [nxt] + drafts[:keep] + [follow]
    return s.extend([follow], decode=True), m, kept


@pytest.mark.parametrize("keep", [0, 2])
def test_rejected_rows_leave_the_cache(river_gguf_path, keep):
    step, m, kept = _after_rejection(river_gguf_path, keep)
    # Bit for bit what the same verify batch gives with other rejected tokens and no draft
    # before it: neither the river's rows nor the rejected ones are read.
    other, _, _ = _after_rejection(river_gguf_path, keep, drafted=False, rejected=100)
    assert np.array_equal(step, other)
    # A fresh backbone evaluation of the kept tokens in one batch: equal up to the rounding of
    # batched against single-token evaluation, with the same top token.
    fresh = Model(river_gguf_path, n_ctx=256, n_threads=THREADS)
    ref = fresh.logits(kept, mode="backbone")[-1]
    assert np.abs(step - ref).max() < ROUNDING_TOL and step.argmax() == ref.argmax()
    for layer in range(m.n_layer):
        for values in (False, True):
            a = m.cache_rows(layer, values, len(kept))
            b = fresh.cache_rows(layer, values, len(kept))
            assert np.abs(a - b).max() < ROUNDING_TOL, (layer, values)
    # The check can fail: left in the cache, the rejected rows change the next step.
    stale, _, _ = _after_rejection(river_gguf_path, keep, truncate=False)
    assert np.abs(stale - ref).max() > 10 * ROUNDING_TOL


def test_a_round_is_the_draft_then_one_backbone_batch(river_gguf_path):
    """A Session's lossless round, the one Llama, greedy and teacher-forced scoring run: the river's drafts
    after the token, then the backbone's rows for the token and its drafts, bit for bit what one
    backbone batch of those tokens gives; the acceptance rule keeps the drafts the policy chooses,
    and a rejected draft leaves the cache with every draft after it."""
    m = Model(river_gguf_path, n_ctx=256, n_threads=THREADS)
    toks = m.tokenize(PROSE)[:24]
    backbone = m.options(mode="backbone")
    with m.session(m.options(mode="lossless", draft_max=4, **FIXED_DRAFTS)) as s:
        s.prefill(toks[:-1])
        drafts = s.draft(toks[-1])
        assert len(drafts) == 4 and s.n_past == len(toks) - 1
        wanted = iter([toks[-1]] + drafts + [STOP])
        steps = [(st.token, np.array(st.row)) for st in s.decode(lambda row, seen: next(wanted))]
        assert [t for t, _ in steps] == [toks[-1]] + drafts
        assert (s.counters.rounds, s.counters.drafted, s.counters.accepted) == (1, 4, 4)
        assert s.tokens == toks + drafts  # STOP at the last row: the whole batch stays
        rows = np.stack([r for _, r in steps[1:]])

        other = next(t for t in range(m.n_vocab) if t != drafts[1])
        s.prefill(toks[:-1])  # the round's tokens leave; the prompt's last row is evaluated again
        wanted = iter([toks[-1], drafts[0], other, STOP])
        assert [st.token for st in s.decode(lambda row, seen: next(wanted))] == [toks[-1], drafts[0], other]
        assert s.tokens == toks + drafts[:1] + [other]  # the drafts after the rejected one left
    with m.session(backbone) as b:
        b.extend(toks[:-1])
        batch = b.verify([toks[-1]] + drafts)
    assert np.array_equal(rows, batch[:4])


def test_lossless_scoring_is_the_backbone(river_gguf_path):
    # Teacher-forced through the decode path: drafts, verify batches and rejections on the text.
    m = Model(river_gguf_path, n_ctx=256, n_threads=THREADS)
    toks = m.tokenize(PROSE)[:64]
    lossless = score(m, toks, prefix=8, keep_logits=True, mode="lossless", draft_max=4)
    backbone = score(m, toks, prefix=8, keep_logits=True, mode="backbone")
    assert lossless.logits.shape == backbone.logits.shape
    assert np.abs(lossless.logits - backbone.logits).max() < ROUNDING_TOL
    assert (lossless.exit_layers == m.n_layer - 1).all()


def test_options_are_checked(river_gguf_path, q4_0_path):
    m = Model(river_gguf_path, n_ctx=64, n_threads=1)
    for bad in (dict(draft_max=-1), dict(draft_max=65), dict(draft_max=True), dict(draft_p_min=1.5),
                dict(draft_p_min="x"), dict(draft_mode="backbone")):
        with pytest.raises(ValueError):
            m.options(mode="lossless", **bad)
    with pytest.raises(ValueError, match="river"):
        Model(q4_0_path, n_ctx=64, mode="lossless")
    with pytest.raises(ValueError, match="river option"):
        Model(q4_0_path, n_ctx=64, draft_max=3)
    # The draft never runs past the context: the verify batch must fit.
    with m.session(mode="lossless", draft_max=16) as s:
        s.extend(list(range(1, 61)))
        drafts = s.draft(5)
    assert len(drafts) <= 64 - 60 - 1


# --- when it pays (calibrate.lossless) -----------------------------------------------------------------

def test_cost_model_of_a_round():
    from river_gguf.calibrate.lossless import Costs, best_draft_max, predicted_speedup, tokens_per_round

    assert tokens_per_round(0.0, 4) == 1.0 and tokens_per_round(1.0, 4) == 5.0
    assert tokens_per_round(0.5, 2) == pytest.approx(1.75)
    # Weight-bound backbone (a batch of 5 costs 1.4 steps) and a draft at a third of a step.
    bound = Costs(step=0.105, draft=0.035, verify={n: 0.105 * (1 + 0.1 * (n - 1)) for n in range(2, 7)})
    choice = best_draft_max(bound, 0.9)
    assert choice["pays"] and choice["speedup"] == pytest.approx(predicted_speedup(bound, 0.9, choice["draft_max"]))
    assert choice["speedup"] == max(choice["per_k"].values())
    # A batch that costs as much as its tokens' steps never pays, whatever the acceptance.
    flat = Costs(step=0.011, draft=0.005, verify={n: 0.011 * n for n in range(2, 7)})
    assert not best_draft_max(flat, 0.95)["pays"]


@pytest.mark.parametrize("a,k", [(0.0, 4), (0.5, 2), (0.89, 8), (0.97, 4), (1.0, 3)])
def test_acceptance_of_measured_rounds(a, k):
    from river_gguf.calibrate.lossless import acceptance_of, tokens_per_round

    assert acceptance_of(tokens_per_round(a, k) - 1, k) == pytest.approx(a, abs=1e-6)
    with pytest.raises(ValueError):
        acceptance_of(k + 0.5, k)


def test_acceptance_from_the_grid():
    from river_gguf.calibrate.lossless import river_only_acceptance
    from river_gguf.presets import Setting

    grid = [{"options": Setting.of(mode="river-only", tail=2), "same_top": 95.0},
            {"options": Setting.of(mode="river-only", river_head=True), "same_top": 87.5}]
    assert river_only_acceptance(grid) == pytest.approx(0.875)
    assert river_only_acceptance(grid[:1]) is None


def test_a_verify_graph_serves_every_round(river_gguf_path):
    # A verify batch attends over llama.cpp's padded n_kv, so a round's graph is the next round's
    # when the batch has the same size: after the first round, rounds build no graph.
    m = Model(river_gguf_path, n_ctx=256, n_threads=THREADS)
    opts = m.options(mode="lossless", draft_max=4)
    s = m.session(opts)
    tok = int(s.extend(m.tokenize(PROSE)[:20]).argmax())
    built = []
    for _ in range(6):
        start = m.n_past
        drafts = s.draft(tok)
        assert len(drafts) == 4
        rows = s.verify([tok] + drafts)
        s.truncate(start + 1)  # every draft rejected: the next batch has the same size
        tok = int(rows[0].argmax())
        built.append(m.graph_counts["built"])
    assert built[0] > 0 and built[-1] == built[0], built


@pytest.mark.parametrize("n_ctx,context", [(512, 256), (64, 64 - 2 - 5 - 1)])
def test_costs_are_timed_where_generation_runs(river_gguf_path, n_ctx, context):
    # After CONTEXT positions (256), or as many as n_ctx leaves room for beside the timed steps.
    from river_gguf.calibrate import lossless as cost_model

    m = Model(river_gguf_path, n_ctx=n_ctx, n_threads=THREADS)
    costs = cost_model.measure_costs(m, m.options(mode="lossless", draft_max=4), 5, rounds=1, steps=2)
    assert costs.context == context == min(cost_model.CONTEXT, context)
    assert costs.step > 0 and costs.draft > 0 and set(costs.verify) == {2, 3, 4, 5}
    assert m.n_past == 0  # the cache is left empty
