"""Where lossless text parts from the plain backbone's (single-token decode steps, not the exact
reference), the rows decide it, never the bookkeeping.

A verify batch's row and a decode step's row for the same prefix differ in their last bits on an
F16 backbone (test_lossless_premise), and a draw that falls between them parts the two texts.
Every parting is attributed: a chain rebuilt from the seed by replaying the rows before the
parting is cloned twice; one clone draws the plain run's token from the decode step's row, the
other the lossless run's token from the verify row that run actually used. Were the two draws
the same, the rows would not explain the parting, and the test fails. Each run's recorded rows,
replayed by a fresh chain, give its text (the chain advanced once per token, as in backbone
mode)."""
import numpy as np
import pytest

from river_gguf.llama import Llama
from river_gguf.llama_sampling import SamplerChain

from support import THREADS

N_TOKENS = 32
PROMPTS = ("Once upon a time", "The three most important rivers of Europe are", "def fibonacci(n):")
SAMPLED = dict(temp=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1)
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def plain_and_lossless(river_gguf_path):
    """SmolLM2's River GGUF twice: plain backbone decoding, and lossless mode."""
    kw = dict(n_ctx=128, n_threads=THREADS, flash_attn=True, verbose=False)
    return Llama(river_gguf_path, **kw), Llama(river_gguf_path, **kw)


def _recorded(llm, prompt, seed, sampler, mode):
    """The first N_TOKENS tokens of a generation, and the row each was sampled from (a stopping
    criterion sees it)."""
    rows = []

    def record(input_ids, row):
        rows.append(np.array(row, copy=True))
        return False

    llm.reset()  # the prompt in one batch (a reused prompt's last token is evaluated again alone)
    llm.set_seed(seed)
    tokens = []
    for t in llm.generate(llm.tokenize(prompt.encode()), stopping_criteria=record, mode=mode, **sampler):
        tokens.append(t)
        if len(tokens) == N_TOKENS:
            break
    return tokens, rows


def _chain(llm, seed, sampler) -> SamplerChain:
    return SamplerChain(llm.n_vocab(), seed=seed, penalty_last_n=llm.last_n_tokens_size, **sampler)


def _replay(chain, rows):
    return [chain.sample(row) for row in rows]


def test_every_sampled_parting_from_plain_decoding_is_the_rows(plain_and_lossless):
    plain, lossless = plain_and_lossless
    kw = SAMPLED
    runs, partings = 0, []
    for prompt in PROMPTS:
        for seed in SEEDS:
            ref, ref_rows = _recorded(plain, prompt, seed, kw, "backbone")
            # River drafts every round (the default planner's choices follow the clock).
            got, got_rows = _recorded(lossless, prompt, seed, dict(kw, ngram_draft=False, adaptive_draft=False),
                                      "lossless")
            assert lossless.last_stats["drafted"] > 0
            runs += 1
            for tokens, rows in ((ref, ref_rows), (got, got_rows)):
                with _chain(plain, seed, kw) as chain:
                    assert _replay(chain, rows) == tokens, f"{prompt!r} seed {seed}: replaying the rows"
            if got == ref:
                continue
            i = next(j for j, (a, b) in enumerate(zip(got, ref)) if a != b)
            with _chain(plain, seed, kw) as chain:
                _replay(chain, got_rows[:i])  # the tokens before the parting, which both runs share
                with chain.clone() as alone, chain.clone() as batched:
                    from_step, from_verify = alone.sample(ref_rows[i]), batched.sample(got_rows[i])
            top = np.sort(ref_rows[i])[-2:]
            where = (f"{prompt!r} seed {seed} token {i}: plain {ref[i]}, lossless {got[i]}; top-2 margin "
                     f"{top[1] - top[0]:.3g}, largest |decode step - verify row| "
                     f"{np.abs(ref_rows[i] - got_rows[i]).max():.3g}")
            assert (from_step, from_verify) == (ref[i], got[i]) and from_step != from_verify, where
            partings.append(where)
    print(f"{len(partings)} of {runs} runs part from plain decoding, each at rows that draw apart:",
          *partings, sep="\n  ")
