"""Lossless text is the exact reference's whatever drafts it: every draft length, a river that is
the backbone and one of other random weights, the draft vocabulary on and off, and each stage of
the sampler (temperature, top-k, top-p, min-p, repeat penalty, a grammar, a logits processor).

In the decode steps' kernels (lossless_kernels="decode") the exact reference is plain decoding:
the same backbone decoded one token at a time. In the batched kernels (the default) it is the
backbone decoded in the verify batch's kernels (verify_kernels: each step's token with a throwaway copy in
one batch). Lossless mode must give the reference's tokens at the same seed, and choose each from a
row equal to the reference's bit for bit: the drafts decide only how many rows a batch computes,
never a row's bits (test_lossless_premise) nor the chain's state. Tiny random models of a
2048-token vocabulary keep each run a few milliseconds."""
import hashlib

import numpy as np
import pytest

import llama_cpp
from llama_cpp import LlamaGrammar
from river_gguf.llama import Llama
from river_gguf.llama_sampling import SamplerChain, apply_processors

from lossless_models import small_vocab_model
from support import THREADS

N_TOKENS = 16
N_VOCAB = 2048
PROMPT = [7, 1300, 45, 128, 9, 2011, 77, 3, 260, 18]
DRAFT_MAX = (1, 2, 4, 8)
#: A draft vocabulary of 256 of the 2048 tokens (and up to 512 of the context's others in rows of
#: their own), against the whole vocabulary (0).
DRAFT_VOCABS = (0, 256)
RIVERS = ("backbone", "random")

#: A grammar with no end (right recursion): every token is lowercase letters and spaces.
LETTERS = r'root ::= [a-z ] root'


def _processor(input_ids, scores):
    """A logits processor that reads what it is given: it lowers the last token seen, and raises a
    token picked by how many it sees (a processor shown one token too many or too few moves)."""
    scores = scores.copy()
    scores[input_ids[-1]] -= 2.0
    if len(input_ids) % 3 == 0:
        scores[(len(input_ids) * 7919) % len(scores)] += 6.0
    return scores


SAMPLERS = {
    "greedy": dict(temp=0.0),
    "greedy-repeat-penalty": dict(temp=0.0, repeat_penalty=1.5),
    "temperature": dict(temp=1.2, top_k=0, top_p=1.0, min_p=0.0),
    "top-k": dict(temp=0.8, top_k=4, top_p=1.0, min_p=0.0),
    "top-p": dict(temp=0.8, top_k=0, top_p=0.3, min_p=0.0),
    "min-p": dict(temp=0.8, top_k=0, top_p=1.0, min_p=0.3),
    "repeat-penalty": dict(temp=0.8, top_k=40, top_p=0.95, repeat_penalty=1.3),
    "grammar": dict(temp=0.8, top_k=40, grammar=LETTERS),
    "logits-processor": dict(temp=0.8, top_k=40, logits_processor=[_processor]),
    "grammar-greedy": dict(temp=0.0, grammar=LETTERS),
}


def _llama(path, **kw):
    return Llama(path, n_ctx=128, n_threads=THREADS, verbose=False, **kw)


@pytest.fixture(scope="module", params=[False, True], ids=["attention", "flash-attention"])
def models(built, request):
    """Llamas over one backbone (a random qwen2, F16), with and without flash attention: its plain
    decoding (single-token steps), lossless ones in the decode kernels keyed by (river, draft
    vocabulary), with the backbone's own file as the river or another random model's (whose drafts
    the backbone mostly rejects); and in the batched kernels (the default), the backbone's exact
    reference there and a lossless one (the other river, a draft vocabulary)."""
    shape = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, dtype="f16")
    backbone = small_vocab_model(built, N_VOCAB, seed=21, **shape)
    other = small_vocab_model(built, N_VOCAB, seed=22, **shape)
    rivers = {"backbone": backbone, "random": other}
    fa = request.param  # Llama's default is off (llama_cpp's), Model's and the CLI's on
    lossless = {(r, v): _llama(backbone, river=rivers[r], draft_vocab=v, lossless_kernels="decode", flash_attn=fa)
                for r in RIVERS for v in DRAFT_VOCABS}
    for (r, v), llm in lossless.items():  # as asked (the end of text, id 0, is among the first ids)
        assert len(llm.river_model.draft_vocab) == v
    return dict(plain=_llama(backbone, flash_attn=fa), lossless=lossless,
                batch_reference=_llama(backbone, lossless_kernels="batch", verify_kernels=True, flash_attn=fa),
                batch=_llama(backbone, river=other, draft_vocab=DRAFT_VOCABS[1], lossless_kernels="batch",
                             flash_attn=fa))


def _digest(row) -> str:
    return hashlib.blake2b(np.ascontiguousarray(row, dtype=np.float32).tobytes(), digest_size=8).hexdigest()


def _run(llm, seed, sampler, keep=_digest, **river):
    """The first N_TOKENS tokens generate() samples after PROMPT at `seed`, and keep(row) of each
    row they were chosen from (before the logits processors; a digest unless told), recorded by a
    stopping criterion, which llama_cpp hands the row the token was sampled from."""
    kw = dict(sampler)
    if river.get("mode") == "lossless":
        # River drafts of draft_max each round unless told: the default planner follows the clock.
        river = dict(dict(ngram_draft=False, adaptive_draft=False), **river)
    if "grammar" in kw:
        kw["grammar"] = LlamaGrammar.from_string(kw["grammar"], verbose=False)
    rows = []

    def record(input_ids, row):
        rows.append(keep(row))
        return False

    # From an empty cache: the prompt is one batch in every run. (A call that reuses a cached prompt
    # evaluates its last token again, alone, in the single-token kernels.)
    llm.reset()
    llm.set_seed(seed)
    tokens = []
    for t in llm.generate(PROMPT, stopping_criteria=record, **kw, **river):
        tokens.append(t)
        if len(tokens) == N_TOKENS:
            break
    return tokens, rows


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_lossless_is_the_exact_reference_for_every_drafter(models, sampler):
    lossless = models["lossless"]
    seed = 1000 + list(SAMPLERS).index(sampler)
    want = _run(models["plain"], seed, SAMPLERS[sampler], mode="backbone")
    assert len(want[0]) == N_TOKENS and len(want[1]) == N_TOKENS
    parted, drafted, accepted = [], {}, {}
    for (river, vocab), llm in lossless.items():
        # River drafts of k each round (the counts below assume it), then the n-gram drafter beside
        # the river; neither planner reads the clock (adaptive_draft=False), so a run drafts alike on
        # any machine.
        for k, ngram in [(k, False) for k in DRAFT_MAX] + [(max(DRAFT_MAX), True)]:
            got = _run(llm, seed, SAMPLERS[sampler], mode="lossless", draft_max=k, ngram_draft=ngram,
                       adaptive_draft=False)
            stats = llm.last_stats
            if not ngram:
                drafted[river] = drafted.get(river, 0) + stats["drafted"]
                accepted[river] = accepted.get(river, 0) + stats["accepted"]
            if got != want:
                i = next(j for j in range(N_TOKENS) if got[0][j] != want[0][j] or got[1][j] != want[1][j])
                parted.append(f"river={river} draft_vocab={vocab} k={k} ngram={ngram}: token {i} {got[0][i]} "
                              f"vs {want[0][i]}, rows {'equal' if got[1][i] == want[1][i] else 'differ'}")
    # In the batched kernels, against their own reference.
    want_batch = _run(models["batch_reference"], seed, SAMPLERS[sampler], mode="backbone")
    for k in DRAFT_MAX:
        got = _run(models["batch"], seed, SAMPLERS[sampler], mode="lossless", draft_max=k)
        if got != want_batch:
            i = next(j for j in range(N_TOKENS) if got[0][j] != want_batch[0][j] or got[1][j] != want_batch[1][j])
            parted.append(f"batch kernels k={k}: token {i} {got[0][i]} vs {want_batch[0][i]}, rows "
                          f"{'equal' if got[1][i] == want_batch[1][i] else 'differ'}")
    assert not parted, "\n".join(parted)
    # Both rivers drafted, and drafts were accepted and rejected: the rounds verified several
    # tokens, kept some and threw some away.
    assert drafted["backbone"] > 0 and drafted["random"] > 0, drafted
    assert accepted["backbone"] > 0, accepted
    assert accepted["random"] < drafted["random"], (accepted, drafted)


@pytest.mark.parametrize("kernels", ["decode", "batch"])
@pytest.mark.parametrize("sampler,river", [("temperature", dict(draft_max=0)), ("greedy", dict(draft_p_min=1.0))],
                         ids=["draft_max=0", "draft_p_min=1"])
def test_rounds_without_drafts_stay_in_the_reference_kernels(models, sampler, river, kernels):
    """A round whose river drafts nothing (draft_max 0, or no draft as probable as draft_p_min) is
    a decode step in the decode kernels, and in the batched kernels still verifies its token in a
    batch (with a throwaway copy): either way its row is its reference's."""
    if kernels == "decode":
        llm, reference = models["lossless"]["backbone", 0], models["plain"]
    else:
        llm, reference = models["batch"], models["batch_reference"]
    want = _run(reference, 7, SAMPLERS[sampler], mode="backbone")
    got = _run(llm, 7, SAMPLERS[sampler], mode="lossless", **river)
    assert llm.last_stats["rounds"] >= N_TOKENS - 1 and llm.last_stats["drafted"] == 0, llm.last_stats
    assert got == want
    # The check can fail: the two kernels' rows differ in their last bits (an F16 backbone:
    # test_lossless_premise), so a round in the other kernels would give the other rows.
    other = _run(models["batch_reference" if kernels == "decode" else "plain"], 7, SAMPLERS[sampler], mode="backbone")
    assert other[1][0] == want[1][0]  # the prompt's row: one prompt batch in both
    assert other[1][1:] != want[1][1:]


def _fresh_chain(llm, seed, sampler) -> SamplerChain:
    """A chain as generate() builds one for `sampler` at `seed`, from the public pieces."""
    kw = {k: v for k, v in dict(dict(top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0), **sampler).items()
          if k != "logits_processor"}
    vocab = llama_cpp.llama_model_get_vocab(llm.model) if "grammar" in kw else None
    return SamplerChain(llm.n_vocab(), seed=seed, penalty_last_n=llm.last_n_tokens_size, vocab=vocab, **kw)


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_replaying_the_rows_gives_the_text(models, sampler):
    """A fresh chain at the run's seed, with its processors and grammar, sampling the rows a
    lossless run chose from, in order, gives the run's text: the chain's state (random draws,
    penalties' history, grammar, what processors see) advanced exactly once per token, whatever
    the rounds drafted and threw away."""
    llm = models["lossless"]["random", DRAFT_VOCABS[1]]
    seed = 2000 + list(SAMPLERS).index(sampler)
    tokens, rows = _run(llm, seed, SAMPLERS[sampler], keep=np.array, mode="lossless", draft_max=4)
    assert llm.last_stats["drafted"] > llm.last_stats["accepted"]  # rounds threw drafts away
    procs = SAMPLERS[sampler].get("logits_processor", [])
    with _fresh_chain(llm, seed, SAMPLERS[sampler]) as chain:
        replayed = []
        for row in rows:
            if procs:
                row = apply_processors(procs, np.array(PROMPT + replayed, dtype=np.intc), np.array(row, copy=True))
            replayed.append(chain.sample(row))
    assert replayed == tokens
