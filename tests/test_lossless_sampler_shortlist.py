"""SamplerChain hands libllama a shortlist of candidates (the recent tokens and the highest logits)
instead of the whole vocabulary when that provably samples the same token: the invariant here is
token-for-token agreement with the same chain given every candidate, over rows built to break it
(penalised tokens at the top, ties at the top-k boundary, negative logits, -inf), sampled and
greedy with penalties, over the whole vocabulary and over a draft vocabulary's candidates, and
for a clone as for the chain it was cloned from. No model is needed: the rows are drawn here."""
import numpy as np
import pytest

from river_gguf.llama_sampling import SamplerChain

N_VOCAB = 151936  # Qwen2.5's: the size the shortlist exists for
CONFIGS = {
    "sampled": dict(temp=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1),
    "sampled-all-penalties": dict(temp=0.7, top_k=5, top_p=0.95, min_p=0.05, repeat_penalty=1.2,
                                  frequency_penalty=0.3, presence_penalty=0.2, penalty_last_n=16),
    "greedy-penalised": dict(temp=0.0, repeat_penalty=1.3),
    "no-penalties": dict(temp=0.8, top_k=40, top_p=0.95),
}


def _rows(rng, n_rows: int, n: int):
    """Rows whose top holds the recent tokens (ids below 50), with ties and signs that matter."""
    for i in range(n_rows):
        row = (rng.standard_normal(n) * 2).astype(np.single)
        row[:50] += rng.uniform(3.0, 9.0, 50).astype(np.single)
        if i % 7 == 0:
            row[-60:] = row[:50].max()        # a tie across the top-k boundary: the whole array decides
        if i % 5 == 0:
            row[:30] = -np.abs(row[:30])      # penalised negative logits are multiplied, not divided
        if i % 11 == 0:
            row[100:40000] = -np.inf          # logit_bias-style exclusions
        yield row


def _pair(config: dict, n_vocab: int = N_VOCAB):
    return (SamplerChain(n_vocab, seed=7, **config), SamplerChain(n_vocab, seed=7, shortlist=False, **config))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shortlist_samples_what_the_whole_vocabulary_samples(name):
    rng = np.random.default_rng(3)
    fast, full = _pair(CONFIGS[name])
    with fast, full:
        for t in rng.integers(0, 50, 12):
            fast.accept(int(t))
            full.accept(int(t))
        short = 0
        for row in _rows(rng, 60, N_VOCAB):
            short += fast._shortlist(np.arange(N_VOCAB, dtype=np.intc), row) is not None
            assert fast.sample(row) == full.sample(row)
        # A clone carries the penalties' window: it too samples what its twin samples.
        twin_fast, twin_full = fast.clone(), full.clone()
        with twin_fast, twin_full:
            for row in _rows(rng, 10, N_VOCAB):
                assert twin_fast.sample(row) == twin_full.sample(row)
    # The rows without ties take the shortlist: the comparison above is not of the full path twice.
    assert short >= 30


def test_shortlist_over_a_draft_vocabulary():
    """sample_from (a river draft's candidates, not in token order) agrees the same way."""
    rng = np.random.default_rng(5)
    fast, full = _pair(CONFIGS["sampled"])
    with fast, full:
        for t in rng.integers(0, 50, 12):
            fast.accept(int(t))
            full.accept(int(t))
        for row in _rows(rng, 30, N_VOCAB):
            ids = np.concatenate([rng.permutation(np.arange(20, 32768)), np.arange(20)]).astype(np.intc)
            assert fast.sample_from(ids, row[ids]) == full.sample_from(ids, row[ids])


def test_shortlist_falls_back_when_it_cannot_be_exact():
    rng = np.random.default_rng(9)
    ids = np.arange(N_VOCAB, dtype=np.intc)
    row = rng.standard_normal(N_VOCAB).astype(np.single)
    raising = SamplerChain(N_VOCAB, seed=1, temp=0.8, top_k=40, repeat_penalty=0.9)  # a penalty that raises
    tied = SamplerChain(N_VOCAB, seed=1, temp=0.8, top_k=40)
    wide = SamplerChain(N_VOCAB, seed=1, temp=0.8, top_k=0)                           # no truncation
    with raising, tied, wide:
        raising.accept(3)
        assert raising._shortlist(ids, row) is None
        flat = np.zeros(N_VOCAB, dtype=np.single)
        assert tied._shortlist(ids, flat) is None
        assert wide._shortlist(ids, row) is None
        with_nan = row.copy()
        with_nan[7] = np.nan
        assert tied._shortlist(ids, with_nan) is None
        assert tied._shortlist(ids, row) is not None


# --- sampled drafts stop early as greedy ones do --------------------------------------------------

def test_drawn_probability_is_the_final_distributions():
    logits = np.log(np.array([0.5, 0.2, 0.2, 0.1], dtype=np.single))
    with SamplerChain(4, seed=3, temp=1.0, top_k=0, top_p=1.0, min_p=0.0) as chain:
        for _ in range(20):
            token = chain.sample(logits)
            assert chain.drawn_probability == pytest.approx(float(np.exp(logits[token])), rel=1e-5)
    with SamplerChain(4, seed=3, temp=1.0, top_k=1) as chain:  # top-k 1 leaves one candidate
        assert chain.sample(logits) == 0 and chain.drawn_probability == pytest.approx(1.0)
    with SamplerChain(4, seed=3, temp=0.0, repeat_penalty=1.2) as chain:  # greedy draws no distribution
        assert chain.sample(logits) == 0 and chain.drawn_probability is None


def test_draft_picker_stops_below_p_min_and_reports_probabilities():
    from river_gguf.llama_draft import DraftPicker
    logits = np.log(np.array([0.5, 0.2, 0.2, 0.1], dtype=np.single))
    with SamplerChain(4, seed=11, temp=1.0, top_k=0, top_p=1.0, min_p=0.0) as chain:
        picker = DraftPicker(chain)
        drawn = [picker(logits, None) for _ in range(30)]
        assert len(picker.probs) == 30 and all(t >= 0 for t in drawn)
        assert picker.probs == [pytest.approx(float(np.exp(logits[t])), rel=1e-5) for t in drawn]
        picker.p_min, picker.probs = 0.3, []
        drawn = [picker(logits, None) for _ in range(30)]
        # Only token 0 (p 0.5) passes: the others stop the draft (-1) and are not reported.
        assert set(drawn) == {0, -1} and picker.probs == [pytest.approx(0.5)] * drawn.count(0)


def test_draft_picker_stops_at_a_nan_row():
    """A river that computes NaN (a broken tensor) must end the draft, not hand NaN on to the
    planner's statistics."""
    from river_gguf.llama_draft import DraftPicker
    for row in ([np.nan, 0.0, 0.0, 0.0], [0.0, np.nan, 1.0, 0.0], [np.nan] * 4):
        with SamplerChain(4, seed=11, temp=1.0, top_k=0, top_p=1.0, min_p=0.0) as chain:
            picker = DraftPicker(chain)
            assert picker(np.array(row, dtype=np.single), None) == -1 and picker.probs == []
