"""The engine's batched passes a conversion's calibration makes instead of decoding: the river-only
tails from one pass of their shared river layers (Engine.river_tails), and every token's exit
score in one traced backbone pass (Model.similarity_rows)."""
import numpy as np
import pytest

from river_gguf import Model
from river_gguf.measure.tails import river_tails
from river_gguf.measure.traces import similarity_rows, similarity_trace

from support import PROSE


@pytest.fixture(scope="module")
def tiny_model(tiny):
    # F16 backbone, Q4_0 river, untied head: the river head and the backbone's attention both apply.
    return Model(tiny.river("llama", dict(n_layer=6, dtype="f16", seed=11, tied=False)), n_ctx=256, n_threads=1)


@pytest.mark.parametrize("attention", ["river", "backbone"])
@pytest.mark.parametrize("river_head", [True, False])
def test_river_tails_are_each_tails_own_pass(tiny_model, attention, river_head):
    m = tiny_model
    toks = m.tokenize(PROSE)[:60]
    tails = [3, 0, 1, 5, 3]  # any order, the deepest branch (5: river layer 0 only), one asked twice
    rows = river_tails(m, toks, tails, river_attention=attention, river_head=river_head, first_row=7)
    for t, r in zip(tails, rows):
        want = m.logits(toks, mode="river-only", tail=t, river_attention=attention, river_head=river_head)[7:]
        assert r.shape == want.shape
        np.testing.assert_array_equal(r, want)  # the same graphs, split at the branch: bit for bit


def test_river_tails_refuse_bad_input(tiny_model):
    m = tiny_model
    toks = m.tokenize(PROSE)[:20]
    for kw, what in ((dict(tails=[6]), "tail"), (dict(tails=[0], first_row=20), "first_row"),
                     (dict(tails=[0], river_attention="mixed"), "river_attention")):
        with pytest.raises(ValueError, match=what):
            river_tails(m, toks, **kw)
    with pytest.raises(ValueError, match="no tokens"):
        river_tails(m, [], [0])
    with pytest.raises(ValueError, match="one batch"):
        river_tails(m, m.tokenize(PROSE * 8)[:300], [0])  # n_batch is n_ctx here: 256
    with pytest.raises(ValueError, match="at least one tail"):
        river_tails(m, toks, [])
    # The Model goes on as before.
    assert m.logits(toks, mode="river-only").shape[0] == len(toks)


def test_similarity_rows_are_the_decode_trace(tiny_model):
    m = tiny_model
    toks = m.tokenize(PROSE)[:40]
    rows = similarity_rows(m, toks)
    assert rows.shape == (len(toks), m.n_layer)
    trace = np.array(similarity_trace(m, toks, mode="backbone"))  # one decode step a token, after the first
    np.testing.assert_allclose(rows[1:], trace, atol=2e-3)  # F16 weights: batched and single-token kernels
    assert not np.allclose(rows[1:], np.roll(trace, 1, axis=0))  # row i is token i's, not a neighbour's
