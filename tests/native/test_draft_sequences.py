"""Engine.draft on a sequence other than 0 (lossless decoding in a slot): the draft runs from that
sequence's length, sees that sequence's rows alone, and removes its own rows again, so every
sequence's cells (rows, lengths) and every kept row's K/V are as before the draft.

The oracle is the same draft on sequence 0 of an engine holding nothing else: with flash
attention the CPU kernel walks a token's visible rows in order and skips the masked ones, so the
other sequences' rows between them change no bit, and the drafts and their probabilities are
equal."""
import numpy as np
import pytest

from river_gguf import _native as native
from river_gguf.eval.random_model import write_tiny_model

from support import THREADS

OTHERS = {0: [11, 12, 13, 14, 15, 16, 17], 1: [300, 301, 302]}
PROMPT = [5, 40, 41, 42, 43, 44, 45, 46, 47]
DRAFTS = 6


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A random llama backbone and a river of other random weights of the same shape."""
    d = tmp_path_factory.mktemp("draft-seq")
    shape = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128)
    return (write_tiny_model(str(d / "backbone.gguf"), "llama", seed=1, **shape),
            write_tiny_model(str(d / "river.gguf"), "llama", seed=2, **shape))


def _engine(pair):
    return native.Engine(pair[0], pair[1], n_ctx=128, n_threads=THREADS, flash_attn=True)


def _cells(e):
    """Every sequence's rows (which give its length), and the K/V of every row in use."""
    rows = {s: list(e.sequence_rows(s)) for s in e.sequences}
    kv = [e.cache_rows(layer, values, e.cache_used) for layer in range(e.hparams["n_layer"]) for values in (False, True)]
    return rows, kv


def _assert_same_cells(before, after):
    assert after[0] == before[0]
    for a, b in zip(after[1], before[1]):
        assert np.array_equal(a, b)


def test_a_draft_on_sequence_two_equals_its_draft_alone_and_leaves_every_cell(pair):
    alone = _engine(pair)
    alone.eval(PROMPT[:-1], mode="backbone")
    want = alone.draft(PROMPT[-1], DRAFTS, mode="river-only")
    assert alone.n_past == len(PROMPT) - 1 and alone.cache_used == len(PROMPT) - 1

    e = _engine(pair)
    for s, tokens in OTHERS.items():
        e.eval(tokens, seq_ids=[s] * len(tokens), mode="backbone")
    e.eval(PROMPT[:-1], seq_ids=[2] * (len(PROMPT) - 1), mode="backbone")
    before = _cells(e)
    got = e.draft(PROMPT[-1], DRAFTS, seq=2, mode="river-only")
    assert len(got[0]) == DRAFTS  # p_min 0: the draft ran its whole length
    assert list(got[0]) == list(want[0]) and np.array_equal(got[1], want[1])
    _assert_same_cells(before, _cells(e))
    assert e.sequence_length(2) == len(PROMPT) - 1 and e.n_past == len(OTHERS[0])

    # A draft on a sequence the cache does not hold yet starts at its position 0, and leaves it empty.
    e.draft(PROMPT[0], 2, seq=5, mode="river-only")
    assert 5 not in e.sequences
    _assert_same_cells(before, _cells(e))


def test_a_draft_step_on_any_sequence_is_a_decode_step_of_sequence_0(pair):
    # The draft's first step on sequence 2 runs in the graph a one-token eval of sequence 0 built
    # (none is built for it), and its logits are that token's decode step alone, bit for bit.
    alone = _engine(pair)
    alone.eval(PROMPT[:-1], mode="backbone")
    want = alone.eval([PROMPT[-1]], mode="river-only")[0].reshape(-1)

    e = _engine(pair)
    for s, tokens in OTHERS.items():
        e.eval(tokens, seq_ids=[s] * len(tokens), mode="backbone")
    e.eval(PROMPT[:-1], seq_ids=[2] * (len(PROMPT) - 1), mode="backbone")
    e.eval([18], mode="river-only")  # a decode step of sequence 0 builds the one-token graph
    built = e.graphs_built
    seen = []

    def pick(logits, tokens):
        seen.append(np.array(logits))
        return -1  # one step only

    assert list(e.draft(PROMPT[-1], DRAFTS, seq=2, pick=pick, mode="river-only")[0]) == []
    assert e.graphs_built == built
    assert len(seen) == 1 and np.array_equal(seen[0], want)
    assert e.sequence_length(2) == len(PROMPT) - 1


def test_a_draft_that_fails_on_a_sequence_leaves_every_cell(pair):
    e = _engine(pair)
    for s, tokens in {**OTHERS, 3: PROMPT[:-1]}.items():
        e.eval(tokens, seq_ids=[s] * len(tokens), mode="backbone")
    before = _cells(e)
    calls = []

    def pick(logits, tokens):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("picker failed")
        return int(np.argmax(logits))

    with pytest.raises(RuntimeError, match="picker failed"):
        e.draft(PROMPT[-1], DRAFTS, seq=3, pick=pick, mode="river-only")
    assert len(calls) == 3  # two drafts' rows were on sequence 3 when it failed
    _assert_same_cells(before, _cells(e))


def test_draft_sequence_is_checked(pair):
    e = _engine(pair)
    e.eval(PROMPT, mode="backbone")
    with pytest.raises(ValueError, match="sequence id must be >= 0"):
        e.draft(PROMPT[-1], 2, seq=-1, mode="river-only")
    assert e.n_past == len(PROMPT)
