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


@pytest.mark.parametrize("attention", ["river", "backbone"])
def test_river_tails_go_on_from_a_kept_branch(tiny_model, attention):
    # A later round of a calibration's search starts from a hidden state an earlier pass kept:
    # the rows are the whole pass's bit for bit, and the state is the river's at that layer.
    m = tiny_model
    toks = m.tokenize(PROSE)[:50]
    _, kept = river_tails(m, toks, [4, 1], river_attention=attention, first_row=5, keep=True)
    assert sorted(kept) == [m.n_layer - 4, m.n_layer - 1]
    assert all(h.shape == (len(toks), m.n_embd) and h.dtype == np.float32 for h in kept.values())
    for layer, tails in ((m.n_layer - 4, [2, 3, 0, 4]), (m.n_layer - 1, [1, 0])):
        rows = river_tails(m, toks, tails, river_attention=attention, first_row=5, start=(layer, kept[layer]))
        for t, r in zip(tails, rows):
            np.testing.assert_array_equal(r, m.logits(toks, mode="river-only", tail=t, river_attention=attention)[5:])
    # A state from elsewhere changes the rows: the pass did start from it.
    other = river_tails(m, toks, [2], river_attention=attention, first_row=5,
                        start=(m.n_layer - 4, kept[m.n_layer - 4] * 0.5))[0]
    assert not np.array_equal(other, river_tails(m, toks, [2], river_attention=attention, first_row=5)[0])
    bad = kept[m.n_layer - 4]
    for start, what in (((m.n_layer - 1, kept[m.n_layer - 1]), "layer"), ((0, bad), "layer"),
                        ((m.n_layer - 4, bad[:-1]), "hidden state"), ((m.n_layer - 4, bad[:, :-1]), "hidden state")):
        with pytest.raises(ValueError, match=what):
            river_tails(m, toks, [2, 4], river_attention=attention, start=start)


def test_repacking_the_river_alone(tiny, tiny_model):
    # The converter's presets (repack="river"): the river on the kernels a loaded file runs it
    # with, the backbone read in place, as the file's plain layout gives it.
    path = tiny_model.model_path
    toks = tiny_model.tokenize(PROSE)[:40]
    models = {rp: Model(path, n_ctx=64, n_threads=1, repack=rp) for rp in (True, False, "river")}
    logits = {rp: {mode: m.logits(toks, mode=mode) for mode in ("backbone", "river-only")} for rp, m in models.items()}
    np.testing.assert_array_equal(logits["river"]["river-only"], logits[True]["river-only"])
    np.testing.assert_array_equal(logits["river"]["backbone"], logits[False]["backbone"])
    for bad in ("backbone", "yes", 1.5, None):
        with pytest.raises(ValueError, match="repack"):
            Model(path, n_ctx=64, n_threads=1, repack=bad)


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


def test_a_trace_without_all_logits_scores_every_row(tiny_model):
    """A traced batch keeps every row through every layer whatever rows its head runs: the
    scores are the all-logits pass's bit for bit, and the logits its last row's (up to the head's
    kernels for one row against many)."""
    m = tiny_model
    toks = m.tokenize(PROSE)[:40]
    with m.lock, m.session(m.options(mode="backbone")) as s:
        every = s.extend(toks, all_logits=True, trace=True)
        scores_every = list(s.scores)
    with m.lock, m.session(m.options(mode="backbone")) as s:
        last = s.extend(toks, trace=True)
        scores_last = list(s.scores)
    assert len(scores_last) == len(scores_every) == m.n_layer * len(toks)
    assert scores_last == scores_every
    np.testing.assert_allclose(last, every[-1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(similarity_rows(m, toks).T.ravel(), np.asarray(scores_every, dtype=np.float32))
