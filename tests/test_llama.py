"""river_gguf.Llama against llama_cpp.Llama on the same GGUF (SmolLM2-135M-Instruct Q4_1).

llama-cpp-python 0.3.36's own tests/test_llama.py, case by case, adapted to the local model with
llama_cpp.Llama as the oracle:
  test_llama_cpp_tokenization           -> test_tokenization, test_vocab_only
  test_real_llama (greedy, grammar,     -> test_greedy_completion_matches, test_grammar_completion_matches,
    logits_processor, seeds + states)      test_logits_processor_matches, test_save_load_state_replays_seeds
  test_real_llama_repeated_prompt_cache -> test_repeated_prompt_reuses_cache
  test_exact_cached_prompt_reuse_matches_fresh, test_loaded_exact_cached_prompt_reuse_matches_fresh,
  test_ram_cache_exact_prompt_hit_matches_fresh, test_shorter_prompt_prefix_reuse_matches_fresh
                                        -> the tests of the same names (transformer model case)
  test_real_llama_embeddings            -> test_embeddings_need_embedding_true, tests/test_llama_embeddings.py
Beyond upstream: dict shapes key by key (stream / non-stream, logprobs, echo), max_tokens <= 0 and
None, stop strings, suffix, logit_bias, stopping_criteria, exact sampler-chain parity on shared
logits, seeded end-to-end sampling, River options and last_stats, constructor parameters, close.

Not covered, because they need features outside a single-sequence text model or outside this
engine: test_real_model (drives llama.cpp's own LlamaContext/LlamaBatch, not the Llama class);
the recurrent (mamba) and hybrid (Falcon-H1) cases of the cache tests (the engine runs
llama/qwen2/qwen3 only); test_llama_cpp_version.

Model behaviour (a reply that runs to the context's end, a stop string that occurs, a logit bias
that wins) is asserted on the oracle first, for an input where it holds (stop strings are taken
from the oracle's own text), and ours must then equal the oracle's: float rounding differs
between CPUs, so what SmolLM2 generates for one fixed prompt does too.

Exactness: greedy text is compared for equality. Seeded sampled text is compared for equality
too, but that equality is not guaranteed in general: the engine's logits are not bit-identical
to llama.cpp's (different kernels, ~1e-3), so a draw that lands within that distance of a
probability boundary could flip. test_sampler_chain_parity_on_shared_logits removes that
caveat: the same logits, fed to river_gguf's chain and to llama_cpp's, must give the same tokens.
"""
import itertools
import warnings

import numpy as np
import pytest

import llama_cpp
from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.llama import Llama, LlamaGrammar, ModelPathError
from river_gguf.llama_sampling import SamplerChain, SamplingError

from support import Oracle, THREADS, oracle_pick

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
COLORS = "List three colors:\n1."


@pytest.fixture(scope="module")
def llm(q4_1_path):
    m = Llama(q4_1_path, n_ctx=512, n_threads=1, flash_attn=True, verbose=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def ref(q4_1_path):
    """The oracle: stock llama.cpp on the same file (logits_all so it can return logprobs)."""
    m = llama_cpp.Llama(q4_1_path, n_ctx=512, n_threads=1, n_threads_batch=1, logits_all=True, flash_attn=True,
                        verbose=False)
    yield m
    m.close()


def shape(x, key=None):
    """A value's structure: dict keys in order, list lengths, and value types (numbers as one
    type, since llama_cpp returns numpy floats in logprobs). The keys of a top_logprobs dict are
    token strings, so only their count counts."""
    if isinstance(x, dict):
        if key == "top_logprobs":
            return {"n": len(x), "values": sorted({shape(v) for v in x.values()})}
        return [(k, shape(v, k)) for k, v in x.items()]
    if isinstance(x, list):
        return [shape(v, key) for v in x]
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, (int, float, np.integer, np.floating)):
        return "number"
    if isinstance(x, str):
        return "str"
    return None if x is None else type(x).__name__


def without_ids(chunks):
    return [{k: v for k, v in c.items() if k not in ("id", "created")} for c in chunks]


# ----- tokenization ----------------------------------------------------------------------------

def test_tokenization(llm, ref):
    for text in (b"Hello World", b"Hello World<|im_end|>", "naïve café ☕ 12 bridges".encode(), b""):
        for add_bos, special in itertools.product((True, False), (True, False)):
            assert llm.tokenize(text, add_bos=add_bos, special=special) == ref.tokenize(text, add_bos, special)
    toks = llm.tokenize(b"Hello World")
    assert llm.detokenize(toks) == ref.detokenize(toks) == b"Hello World"
    assert isinstance(llm.detokenize(toks), bytes)
    # special=True turns the marker into its one control token, as in upstream's "</s>" case.
    assert llm.tokenize(b"Hello World<|im_end|>", special=True)[-1] == llm.tokenize(b"<|im_end|>", False, True)[0]
    assert len(llm.tokenize(b"Hello World<|im_end|>", special=False)) > len(llm.tokenize(b"Hello World<|im_end|>",
                                                                                          special=True))
    assert llm.detokenize([llm.token_eos()], special=True) == ref.detokenize([ref.token_eos()], special=True)
    assert (llm.token_bos(), llm.token_eos(), llm.token_nl()) == (ref.token_bos(), ref.token_eos(), ref.token_nl())
    assert (llm.n_ctx(), llm.n_vocab(), llm.n_embd()) == (ref.n_ctx(), ref.n_vocab(), ref.n_embd())
    with pytest.raises(ValueError):
        llm.detokenize([llm.n_vocab()])  # libllama would abort on an id outside the vocabulary


def test_vocab_only(q4_1_path, ref):
    v = Llama(q4_1_path, vocab_only=True, verbose=False)
    assert v.tokenize(b"Hello World") == ref.tokenize(b"Hello World")
    assert v.metadata == ref.metadata and v.chat_format == ref.chat_format
    with pytest.raises(RuntimeError, match="vocab_only"):
        v.eval([1, 2])
    with pytest.raises(RuntimeError, match="vocab_only"):
        v("Hi", max_tokens=1)
    v.close()


# ----- completions -----------------------------------------------------------------------------

def test_greedy_completion_matches(llm, ref):
    for prompt, n in ((PROMPT, 6), (COLORS, 12)):
        a = llm.create_completion(prompt, max_tokens=n, top_k=50, top_p=0.9, temperature=0.0, seed=1337)
        b = ref.create_completion(prompt, max_tokens=n, top_k=50, top_p=0.9, temperature=0.0, seed=1337)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["usage"] == b["usage"]
        assert shape(a) == shape(b)
        assert a["id"].startswith("cmpl-") and a["model"] == llm.model_path
    # The defaults (llama_cpp's sampling parameters) at temperature 0: the oracle's text too.
    assert llm(COLORS, max_tokens=4, temperature=0.0)["choices"][0]["text"] == \
        ref(COLORS, max_tokens=4, temperature=0.0)["choices"][0]["text"]


def test_completion_shapes_key_by_key(llm, ref):
    """Non-stream and stream, with and without logprobs and echo: same keys, order, types and
    lengths as llama_cpp; same text, tokens and offsets; log-probabilities within rounding."""
    for kw in ({}, {"logprobs": 3}, {"logprobs": 2, "echo": True}, {"echo": True}):
        a = llm(COLORS, max_tokens=6, temperature=0.0, **kw)
        b = ref(COLORS, max_tokens=6, temperature=0.0, **kw)
        assert shape(a) == shape(b), kw
        ca, cb = a["choices"][0], b["choices"][0]
        assert ca["text"] == cb["text"] and ca["finish_reason"] == cb["finish_reason"]
        if "logprobs" in kw:
            la, lb = ca["logprobs"], cb["logprobs"]
            assert la["tokens"] == lb["tokens"] and la["text_offset"] == lb["text_offset"]
            for x, y in zip(la["token_logprobs"], lb["token_logprobs"]):
                assert (x is None) == (y is None) and (x is None or abs(x - y) < 0.05)
            # The very types llama_cpp returns (numpy float32 in a whole completion).
            assert [type(x) for x in la["token_logprobs"]] == [type(y) for y in lb["token_logprobs"]]
            for ta, tb in zip(la["top_logprobs"], lb["top_logprobs"]):
                assert (ta is None) == (tb is None)
                if ta is not None:
                    assert set(ta) == set(tb)
                    assert {type(v) for v in ta.values()} == {type(v) for v in tb.values()}
    for kw in ({}, {"logprobs": 2}, {"stop": ["Blue"]}, {"stop": "\n3"}):
        a = list(llm(COLORS, max_tokens=8, temperature=0.0, stream=True, **kw))
        b = list(ref(COLORS, max_tokens=8, temperature=0.0, stream=True, **kw))
        assert [shape(c) for c in a] == [shape(c) for c in b], kw
        assert [c["choices"][0]["text"] for c in a] == [c["choices"][0]["text"] for c in b], kw
        types = [[type(x) for x in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])] for c in a]
        assert types == [[type(x) for x in (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])] for c in b]
        assert a[-1]["choices"][0]["finish_reason"] == b[-1]["choices"][0]["finish_reason"]
        assert len({c["id"] for c in a}) == 1 and a[0]["object"] == "text_completion"


def _runs_to_the_end(r, n_ctx):
    """A completion that ended at the context's end, not at EOS."""
    return r["choices"][0]["finish_reason"] == "length" and r["usage"]["total_tokens"] == n_ctx


def test_max_tokens_unbounded(llm, ref):
    """max_tokens None, 0 and -1 all mean: until EOS or the end of the context, as in llama_cpp."""
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    results = set()
    for n in (None, 0, -1):
        a = llm(prompt, max_tokens=n, temperature=0.0)
        b = ref(prompt, max_tokens=n, temperature=0.0)
        assert a["choices"][0] == {**b["choices"][0], "logprobs": None} and a["usage"] == b["usage"]
        # Either side of "until": EOS ("stop"), or the whole context filled ("length").
        assert a["choices"][0]["finish_reason"] == "stop" or _runs_to_the_end(a, llm.n_ctx())
        results.add((a["choices"][0]["text"], a["choices"][0]["finish_reason"]))
    assert len(results) == 1


def test_max_tokens_fills_small_context(q4_1_path):
    """max_tokens -1 (and a max_tokens past the end) stop at the context's end, as in llama_cpp:
    for a prompt whose greedy reply on llama.cpp does not reach EOS first (llama_cpp.Llama rounds
    a 24-token context up, so its greedy tokens come from the oracle of tests/conftest.py)."""

    small = Llama(q4_1_path, n_ctx=24, n_threads=1, flash_attn=True, verbose=False)
    oracle = Oracle(q4_1_path, stop_at_any_eog=True)  # ends at any EOG, as llama_cpp.Llama does
    try:
        def greedy(p):
            toks = small.tokenize(p.encode(), add_bos=True, special=True)  # as a completion tokenizes
            return toks, oracle.greedy(toks, 24 - len(toks))

        prompt, (toks, ref) = oracle_pick([COLORS, PROMPT, "1, 2, 3, 4, 5,", "Once upon a time"], greedy,
                                          lambda r: len(r[1]) == 24 - len(r[0]),
                                          "a greedy reply that fills a 24-token context without EOS")
    finally:
        oracle.close()
    for max_tokens in (-1, 100):  # 100: capped to the context as well
        r = small(prompt, max_tokens=max_tokens, temperature=0.0)
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["choices"][0]["text"] == small.detokenize(ref).decode()
        assert r["usage"]["prompt_tokens"] == len(toks) and r["usage"]["completion_tokens"] == 24 - len(toks)
    with pytest.raises(ValueError, match=r"Requested tokens \(\d+\) exceed context window of 24"):
        small("word " * 30, max_tokens=1)
    small.close()


def test_stop_strings_and_finish_reasons(llm, ref):
    for stop in (["Blue"], "\n3", ["\n2", "Red"], []):
        a = llm(COLORS, max_tokens=12, temperature=0.0, stop=stop)
        b = ref(COLORS, max_tokens=12, temperature=0.0, stop=stop)
        assert a["choices"][0] == {**b["choices"][0], "logprobs": None}
        assert a["usage"] == b["usage"]
    # A stop string that occurs: a word from the middle of the oracle's own text (so it is there
    # on any CPU). The text ends just before it, on both sides.
    full = ref(COLORS, max_tokens=12, temperature=0.0)["choices"][0]["text"]
    words = full.split()
    assert len(words) >= 2, f"the oracle's 12 tokens hold fewer than two words: {full!r}"
    stop = words[len(words) // 2]
    b = ref(COLORS, max_tokens=12, temperature=0.0, stop=[stop])
    a = llm(COLORS, max_tokens=12, temperature=0.0, stop=[stop])
    assert a["choices"][0] == {**b["choices"][0], "logprobs": None} and a["usage"] == b["usage"]
    assert a["choices"][0]["finish_reason"] == "stop" and a["choices"][0]["text"] == full[:full.index(stop)]


def test_logit_bias_matches(llm, ref):
    tok = llm.tokenize(b" Purple", add_bos=False)[0]
    b = ref(COLORS, max_tokens=3, temperature=0.0, logit_bias={str(tok): 50.0})
    assert b["choices"][0]["text"].startswith(" Purple"), "the oracle's bias of 50 did not win on this CPU"
    a = llm(COLORS, max_tokens=3, temperature=0.0, logit_bias={tok: 50.0})
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_logits_processor_matches(llm, ref):
    """Upstream's processor: push the tokens of "rot" up, sampled at temperature 0.8."""
    tokens = llm.tokenize(b"rot", add_bos=True, special=True)

    def push(input_ids, logits):
        for t in tokens:
            logits[t] *= 1000
        return logits

    kw = dict(max_tokens=4, top_k=50, top_p=0.9, temperature=0.8, seed=1337)
    b = ref("The capital of france is par", logits_processor=llama_cpp.LogitsProcessorList([push]), **kw)
    assert b["choices"][0]["text"].lower().startswith("rot"), "the oracle's processor did not win on this CPU"
    a = llm("The capital of france is par", logits_processor=llama_cpp.LogitsProcessorList([push]), **kw)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_stopping_criteria(llm, ref):
    seen = []

    def after_three(input_ids, logits):
        seen.append((len(input_ids), logits.shape))
        return len(input_ids) >= n_prompt + 3

    n_prompt = len(llm.tokenize(COLORS.encode(), add_bos=False, special=True))
    b = ref(COLORS, max_tokens=10, temperature=0.0, stopping_criteria=llama_cpp.StoppingCriteriaList([after_three]))
    # The oracle's criterion fired (no EOS among its first three tokens on this CPU).
    assert b["choices"][0]["finish_reason"] == "stop" and b["usage"]["completion_tokens"] == 3, b
    seen.clear()
    a = llm(COLORS, max_tokens=10, temperature=0.0, stopping_criteria=llama_cpp.StoppingCriteriaList([after_three]))
    assert seen[0] == (n_prompt, (llm.n_vocab(),))
    assert a["choices"][0] == {**b["choices"][0], "logprobs": None} and a["usage"] == b["usage"]


def test_suffix_without_fim_tokens_is_appended(llm):
    """SmolLM2 has no FIM tokens: the suffix is appended to the text (llama_cpp 0.3.36 would
    build an infill prompt around token 0 instead; see docs/usage.md, "The drop-in Llama")."""
    plain = llm(COLORS, max_tokens=4, temperature=0.0)
    r = llm(COLORS, max_tokens=4, temperature=0.0, suffix=" [end]")
    assert r["choices"][0]["text"] == plain["choices"][0]["text"] + " [end]"
    assert r["usage"] == plain["usage"]


# ----- sampling --------------------------------------------------------------------------------

CHAINS = [
    dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05),
    dict(temp=1.3, top_k=0, top_p=1.0, min_p=0.0, typical_p=0.9),
    dict(temp=0.7, top_k=20, top_p=0.8, min_p=0.1, repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    dict(temp=1.0, mirostat_mode=1, mirostat_tau=4.0, mirostat_eta=0.2),
    dict(temp=1.0, mirostat_mode=2, mirostat_tau=3.0, mirostat_eta=0.1),
    dict(temp=-1.0),
    dict(temp=0.0, repeat_penalty=1.5),
    dict(temp=0.0),  # greedy with neutral penalties: the first highest logit, without the candidate array
]


@pytest.mark.parametrize("params", CHAINS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_sampler_chain_parity_on_shared_logits(ref, params):
    """Exact parity: llama_cpp generates (its chain on its logits); river_gguf's chain gets the
    very same logits rows and seed and must choose the same token at every step, penalties,
    mirostat's mu and the RNG advancing alike."""
    seed = 4242
    ref.set_seed(seed)
    prompt = ref.tokenize(COLORS.encode(), add_bos=False, special=True)
    ref.reset()
    out = list(itertools.islice(ref.generate(prompt, **params), 12))
    rows = ref.scores[len(prompt) - 1: len(prompt) - 1 + len(out)].copy()
    chain = SamplerChain(ref.n_vocab(), seed=seed, penalty_last_n=ref.last_n_tokens_size, **params)
    ours = [chain.sample(r) for r in rows]
    chain.close()
    assert ours == out


def test_greedy_takes_the_first_highest_logit_as_libllama_does():
    """The greedy chain's shortcut (neutral penalties, no grammar) chooses what libllama's chain
    chooses on the same rows: ties go to the first, -inf is never chosen over a finite logit, a row
    with a NaN is the chain's to decide, and a row of -inf alone is an error. The reference is the
    same greedy chain with penalties that cannot act (penalty_last_n 0), which takes the full path."""
    n = 1000
    rng = np.random.default_rng(3)
    rows = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    tie = np.zeros(n, np.float32)
    tie[[700, 7, 30]] = 5.0
    lone = np.full(n, -np.inf, np.float32)
    lone[123] = -1e30
    nan = rng.standard_normal(n).astype(np.float32)
    nan[[10, 500]] = np.nan
    first_nan = nan.copy()
    first_nan[0] = np.nan
    rows += [tie, lone, nan, first_nan]
    with SamplerChain(n, seed=1, temp=0.0) as fast, \
            SamplerChain(n, seed=1, temp=0.0, repeat_penalty=1.5, penalty_last_n=0) as chain:
        assert [fast.sample(r) for r in rows] == [chain.sample(r) for r in rows]
        assert fast.sample(tie) == 7
        for c in (fast, chain):
            with pytest.raises(SamplingError):
                c.sample(np.full(n, -np.inf, np.float32))


def test_seeded_sampling_matches_end_to_end(llm, ref):
    """Same seed, same chain, logits from two engines (see the module docstring on exactness)."""
    for seed in (0, 1, 7):
        kw = dict(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=seed)
        assert llm("Once upon a time", **kw)["choices"][0]["text"] == ref("Once upon a time", **kw)["choices"][0]["text"]
    # Another seed, another text: on the oracle, and the same two texts on ours.
    theirs = [ref("Once upon a time", max_tokens=12, temperature=0.9, seed=s)["choices"][0]["text"] for s in (3, 4)]
    assert theirs[0] != theirs[1], "seeds 3 and 4 gave the oracle the same text on this CPU"
    assert [llm("Once upon a time", max_tokens=12, temperature=0.9, seed=s)["choices"][0]["text"]
            for s in (3, 4)] == theirs


def test_default_seed_sequence_matches(q4_1_path):
    """Without a seed every call draws the next seed from the previous one, from the
    constructor's seed: two fresh objects with seed=11 produce llama_cpp's sequence."""
    ours = Llama(q4_1_path, n_ctx=128, n_threads=1, seed=11, flash_attn=True, verbose=False)
    theirs = llama_cpp.Llama(q4_1_path, n_ctx=128, n_threads=1, n_threads_batch=1, seed=11, flash_attn=True,
                             verbose=False)
    for _ in range(2):
        a = ours("Once upon a time", max_tokens=6, temperature=1.0)["choices"][0]["text"]
        b = theirs("Once upon a time", max_tokens=6, temperature=1.0)["choices"][0]["text"]
        assert a == b
    ours.close()
    theirs.close()


def test_grammar_completion_matches(llm, ref):
    kw = dict(max_tokens=4, top_k=50, top_p=0.9, temperature=0.8, seed=1337)
    g = 'root ::= "true" | "false"\n'
    b = ref("The capital of france is paris, 'true' or 'false'?:\n", grammar=llama_cpp.LlamaGrammar.from_string(g),
            **kw)
    assert b["choices"][0]["text"] in ("true", "false")  # the grammar's language (4 tokens are room enough)
    a = llm("The capital of france is paris, 'true' or 'false'?:\n", grammar=LlamaGrammar.from_string(g), **kw)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_save_load_state_replays_seeds(llm, ref):
    """Upstream's state test: a saved state restores the seed, so the same call after
    load_state repeats the first draw; the numbers equal llama_cpp's."""
    grammar = 'root ::= "1" | "2" | "3" | "4" | "5" | "6" | "7" | "8" | "9" | "10"\n'
    kw = dict(max_tokens=4, top_k=50, top_p=0.9, temperature=1.0)
    results = []
    for m in (llm, ref):
        m.set_seed(1337)
        state = m.save_state()
        n1 = m("Pick a number from 1 to 10?:\n", grammar=LlamaGrammar.from_string(grammar), **kw)["choices"][0]["text"]
        n2 = m("Pick a number from 1 to 10?:\n", grammar=LlamaGrammar.from_string(grammar), **kw)["choices"][0]["text"]
        m.load_state(state)
        n3 = m("Pick a number from 1 to 10?:\n", grammar=LlamaGrammar.from_string(grammar), **kw)["choices"][0]["text"]
        results.append((n1, n2, n3))
    ours, (t1, t2, t3) = results
    assert t1 == t3 and t1 in [str(i) for i in range(1, 11)]  # the oracle replays its first draw
    assert ours == (t1, t2, t3)
    with pytest.raises(ValueError, match="not saved by river_gguf"):
        llm.load_state(ref.save_state())


# ----- the KV cache: prefix reuse, states, caches -------------------------------------------------

def _first3(m, tokens):
    return list(itertools.islice(m.generate(tokens, temp=0.0), 3))


def test_repeated_prompt_reuses_cache(llm, ref):
    a = llm(PROMPT, max_tokens=6, temperature=0.0, seed=1337)
    b = llm(PROMPT, max_tokens=6, temperature=0.0, seed=1337)
    c = ref(PROMPT, max_tokens=6, temperature=0.0, seed=1337)
    assert a["choices"][0]["text"] == b["choices"][0]["text"] == c["choices"][0]["text"]
    assert llm.last_stats["prompt_tokens_cached"] == a["usage"]["prompt_tokens"] - 1
    assert llm.last_stats["prefill_tokens"] == 1


def test_exact_cached_prompt_reuse_matches_fresh(llm, ref):
    tokens = llm.tokenize(b"The quick brown fox", add_bos=True, special=True)
    llm.reset()
    expected = _first3(llm, tokens)
    ref.reset()
    assert _first3(ref, tokens) == expected
    llm.reset()
    llm.eval(tokens)
    assert llm.n_tokens == len(tokens) and llm.input_ids[: llm.n_tokens].tolist() == tokens
    assert llm.sample(temp=0.0, idx=len(tokens) - 1) == expected[0]
    calls = []
    original = llm.reset
    llm.reset = lambda: (calls.append(1), original())
    try:
        assert _first3(llm, tokens) == expected
    finally:
        del llm.reset
    assert calls == [] and llm.last_stats["prompt_tokens_cached"] == len(tokens)
    assert llm.n_tokens == len(tokens) + 3 - 1


def test_loaded_exact_cached_prompt_reuse_matches_fresh(llm, q4_1_path):
    tokens = llm.tokenize(b"The quick brown fox", add_bos=True, special=True)
    llm.reset()
    expected = _first3(llm, tokens)
    llm.reset()
    llm.eval(tokens)
    state = llm.save_state()
    other = Llama(q4_1_path, n_ctx=512, n_threads=1, flash_attn=True, verbose=False)
    # Evaluate a same-length prompt whose next token differs, so a stale cache would show.
    for replacement in (other.token_eos(), other.token_nl(), 0, 1, 2, other.n_vocab() - 1):
        alternate = tokens[:-1] + [replacement]
        other.reset()
        other.eval(alternate)
        if other.sample(temp=0.0, idx=len(tokens) - 1) != expected[0]:
            break
    else:
        raise AssertionError("failed to find an alternate same-length prompt")
    other.load_state(state)
    assert other.n_tokens == len(tokens) and other.input_ids[: other.n_tokens].tolist() == tokens
    assert other.sample(temp=0.0) == expected[0]  # the saved last logits came back too
    assert _first3(other, tokens) == expected
    assert other.n_tokens == len(tokens) + 3 - 1
    other.close()


def test_ram_cache_exact_prompt_hit_matches_fresh(llm, q4_1_path):
    tokens = llm.tokenize(b"The quick brown fox", add_bos=True, special=True)
    llm.reset()
    expected = llm.create_completion(tokens, max_tokens=1, temperature=0.0, seed=1337)
    cache = llama_cpp.LlamaRAMCache()
    llm.set_cache(cache)
    llm.reset()
    llm.create_completion(tokens, max_tokens=1, temperature=0.0, seed=1337)
    llm.set_cache(None)
    cached = Llama(q4_1_path, n_ctx=512, n_threads=1, flash_attn=True, verbose=False)
    cached.set_cache(cache)
    loads = []
    original = cached.load_state
    cached.load_state = lambda s: (loads.append(1), original(s))
    actual = cached.create_completion(tokens, max_tokens=1, temperature=0.0, seed=1337)
    assert loads == [1]
    assert actual["choices"][0]["text"] == expected["choices"][0]["text"]
    assert actual["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
    cached.close()


def test_shorter_prompt_prefix_reuse_matches_fresh(llm):
    tokens = llm.tokenize(b"The quick brown fox", add_bos=True, special=True)
    history = llm.tokenize(b" jumps over the lazy dog", add_bos=False, special=True)
    llm.reset()
    expected = _first3(llm, tokens)
    llm.reset()
    llm.eval(tokens + history)
    assert llm.n_tokens > len(tokens) and llm.input_ids[: len(tokens)].tolist() == tokens
    assert _first3(llm, tokens) == expected


def test_eval_logits_all(q4_1_path):
    m = Llama(q4_1_path, n_ctx=64, n_threads=1, logits_all=True, flash_attn=True, verbose=False)
    # A reference of its own: llama_cpp.Llama.sample() reuses the sampler a generate() call left on
    # the instance (the module's `ref`), whatever it is asked for.
    ref = llama_cpp.Llama(q4_1_path, n_ctx=64, n_threads=1, n_threads_batch=1, logits_all=True, flash_attn=True,
                          verbose=False)
    tokens = m.tokenize(COLORS.encode())
    m.eval(tokens)
    ref.eval(tokens)
    assert np.abs(m._scores - ref._scores[: len(tokens)]).max() < 0.05
    assert m.sample(temp=0.0, idx=1) == ref.sample(temp=0.0, idx=1)
    assert len(m.eval_logits) == len(tokens) and list(m.eval_tokens) == tokens
    m.close()
    ref.close()


# ----- River -----------------------------------------------------------------------------------

def test_river_options_and_last_stats(f16_path, q4_0_path):
    """A river (F16 backbone + Q4_0 river): exit options per object and per call; statistics in
    last_stats and never in the OpenAI dict."""
    with Llama(f16_path, river=q4_0_path, threshold=0.95, n_ctx=128, n_threads=1, verbose=False) as m:
        r = m(COLORS, max_tokens=6, temperature=0.0)
        assert set(r) == {"id", "object", "created", "model", "choices", "usage"}
        s = m.last_stats
        assert s["mode"] == "river" and s["threshold"] == pytest.approx(0.95)
        n = r["usage"]["completion_tokens"]
        assert (n == 6) == (r["choices"][0]["finish_reason"] == "length")  # fewer only at EOS
        # One exit layer per token; a decode step for each but the last (or for each, before EOS).
        assert len(s["exit_layers"]) == n and s["decode_tokens"] == (n - 1 if n == 6 else n)
        assert s["prefill_tokens"] > 0
        only = m(COLORS, max_tokens=6, temperature=0.0, mode="river-only")
        assert m.last_stats["mode"] == "river-only" and m.last_stats["river_layer_share"] > 0.9
        back = m(COLORS, max_tokens=6, temperature=0.0, mode="backbone")
        assert m.last_stats["river_layer_share"] == 0.0
        # Another option set rebuilds the KV cache rather than reusing one computed otherwise.
        assert m.last_stats["prompt_tokens_cached"] == 0
        assert isinstance(only["choices"][0]["text"], str) and isinstance(back["choices"][0]["text"], str)
        r = m(COLORS, max_tokens=3, temperature=0.0, exit_layer=10)
        assert m.last_stats["mode"] == "exit_layer=10"
        assert m.last_stats["exit_layers"] == [10] * r["usage"]["completion_tokens"]
        chat = m.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=3, mode="river-only")
        assert m.last_stats["mode"] == "river-only" and "river" not in chat
        with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
            m(COLORS, max_tokens=2, nonsense=1)
        with pytest.raises(ValueError):
            m(COLORS, max_tokens=2, mode="sideways")
    with Llama(f16_path, n_ctx=128, n_threads=1, verbose=False) as plain:
        assert plain(COLORS, max_tokens=6, temperature=0.0)["choices"][0]["text"] == back["choices"][0]["text"]


def test_river_gguf_file(river_gguf_path):
    """A River GGUF: libllama reads its vocabulary and metadata, the engine its river; the file's
    exit settings apply by default (this fixture's file stores no presets: its own profiled tau)."""
    with Llama(river_gguf_path, n_ctx=128, n_threads=1, flash_attn=True, verbose=False) as m:
        r = m(COLORS, max_tokens=6, temperature=0.0)
        n = r["usage"]["completion_tokens"]
        assert (n == 6) == (r["choices"][0]["finish_reason"] == "length") and len(m.last_stats["exit_layers"]) == n
        # The same defaults as river_gguf.Model applies to the file: the same greedy text.
        want = greedy(Model(river_gguf_path, n_ctx=128, n_threads=1), COLORS, 6)
        assert r["choices"][0]["text"] == want.text and n == len(want.tokens)
        assert m.last_stats["exit_layers"] == want.exit_layers
        assert m.last_stats["mode"] == m.exit_options.mode == "river"
        assert m.last_stats["threshold"] == pytest.approx(m.exit_options.threshold)
        assert m.chat_format == "chat_template.default"


def test_one_token_eval_is_a_decode_step(river_gguf_path):
    """Llama.eval([token]) after a prompt runs a decode step with River's exits, as generate()
    does: the logits rows through eval equal generate's with the same exits (every decode token
    leaves after layer 5 here; a prompt pass would run the whole backbone)."""
    kw = dict(n_ctx=128, n_threads=1, verbose=False, logits_all=True, threshold=-1.0, min_exit_layer=5, tail=0)
    with Llama(river_gguf_path, **kw) as llm:
        toks = llm.tokenize(COLORS.encode())
        out = list(itertools.islice(llm.generate(toks, temp=0.0, top_k=1), 8))
        exits = llm.last_stats["exit_layers"]
        assert exits == [llm.river_model.n_layer - 1] + [5] * 7  # the prompt, then seven decode steps
        n = len(toks)
        rows = llm.scores[n - 1:n + 7].copy()
        llm.reset()
        llm.eval(toks)
        for t in out[:-1]:
            llm.eval([t])
        assert llm.n_tokens == n + 7
        assert np.array_equal(llm.scores[n - 1:n + 7], rows)
        assert int(llm.scores[n + 6].argmax()) == out[-1]
        # A batch of several tokens stays a prompt pass (the prefill policy: no exits).
        llm.reset()
        llm.eval(toks + out[:-1])
        assert not np.array_equal(llm.scores[n:n + 7], rows[1:])


# ----- the object ------------------------------------------------------------------------------

def test_embeddings_need_embedding_true(llm, ref):
    # (the embeddings themselves: tests/test_llama_embeddings.py)
    with pytest.raises(RuntimeError) as ours:
        llm.embed("Hello World")
    with pytest.raises(RuntimeError) as theirs:
        ref.embed("Hello World")
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(RuntimeError):
        llm.create_embedding("Hello World")


def test_constructor_parameters(q4_1_path, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = Llama(q4_1_path, n_ctx=0, n_batch=64, n_ubatch=32, n_threads=1, n_threads_batch=THREADS, seed=5,
                  flash_attn=True, offload_kqv=False, use_mmap=True, use_mlock=False, type_k=1, type_v=1,
                  n_gpu_layers=0, last_n_tokens_size=32, verbose=False)
    assert m.n_ctx() == m.river_model.hparams["n_ctx_train"] and m.n_batch == 64
    m.close()
    with pytest.warns(RuntimeWarning, match="unknown keyword"):
        Llama(q4_1_path, n_ctx=32, n_threads=1, verbose=False, n_gqa=8).close()
    for bad in (dict(lora_path="x.gguf"), dict(rope_freq_base=20000.0), dict(kv_overrides={"a": 1})):
        with pytest.raises(NotImplementedError):
            Llama(q4_1_path, n_ctx=32, n_threads=1, verbose=False, **bad)
    missing = str(tmp_path / "missing.gguf")
    for exc in (ValueError, FileNotFoundError):
        with pytest.raises(exc, match="Model path does not exist"):
            Llama(missing, verbose=False)
    assert issubclass(ModelPathError, ValueError) and issubclass(ModelPathError, FileNotFoundError)


def test_pickle_round_trip(llm):
    """Pickling keeps the constructor's arguments and loads the model again, as llama_cpp does."""
    import pickle

    clone = pickle.loads(pickle.dumps(llm))
    assert clone is not llm and clone.n_ctx() == llm.n_ctx() and clone.n_threads == llm.n_threads
    assert clone(COLORS, max_tokens=4, temperature=0.0)["choices"][0]["text"] == \
        llm(COLORS, max_tokens=4, temperature=0.0)["choices"][0]["text"]
    clone.close()


def test_bad_call_arguments(llm):
    for kw in (dict(max_tokens=2.5), dict(logprobs=-1), dict(stop=[1]), dict(temperature="hot"),
               dict(stream="yes"), dict(logit_bias={"x": 1.0}), dict(grammar="root ::= (")):
        with pytest.raises((ValueError, TypeError)):
            llm(COLORS, **kw)
    with pytest.raises(ValueError, match="empty"):
        llm("", max_tokens=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm([1, 10 ** 7], max_tokens=1)
    with pytest.raises(ValueError, match="grammar"):
        llm(COLORS, grammar="root ::= (", stream=True)  # fails when created, not at the first chunk


def test_close_and_context_manager(q4_1_path):
    with Llama(q4_1_path, n_ctx=32, n_threads=1, verbose=False) as m:
        r = m("Hi", max_tokens=1, temperature=0.0)
        # One token, or none when that token is EOS.
        assert (r["usage"]["completion_tokens"], r["choices"][0]["finish_reason"]) in ((1, "length"), (0, "stop"))
    for call in (lambda: m.tokenize(b"Hi"), lambda: m("Hi", max_tokens=1), lambda: m.eval([1])):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    m.close()  # twice is fine
