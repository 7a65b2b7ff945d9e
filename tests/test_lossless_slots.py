"""Lossless decoding on any sequence of a Model's KV cache (a server slot): the river drafts on the
session's own sequence, the backbone verifies there, the rejected drafts leave that sequence
alone, and each round runs alone under the Model's lock.

The exact reference is the one of tests/test_lossless.py: the backbone decoding in the verify
batch's kernels (verify_kernels: each step's token with a throwaway copy in one batch). A
lossless session on sequence 2, with other sessions' text on sequences 0 and 1 in the cache,
must give the tokens it gives on sequence 0 alone and the reference's, each chosen from a row
equal to its alone row: with flash attention bit for bit (the CPU kernel walks a token's
visible rows in order and skips masked ones, so other sequences' rows in between change no
bit), without it within ROUNDING_TOL (the padded attention's sums span the masked rows too, which
sit elsewhere when other sequences hold rows; measured equal to the bit on this machine, and
within 1.2e-6 with a sequence's rows out of position order).

Slots decoding at once from threads take and free rows in turn (rejected drafts leave), so a
sequence's rows may sit out of position order; ggml's CPU flash attention accumulates V in F16 in
row order, which moves a row by up to 8e-3 (measured over 20 runs) from its alone value: within
ALONE_TOL, a reply parts from its alone reply only where that rounding shows.
"""
import threading

import numpy as np
import pytest

from river_gguf import Llama, Model

from support import THREADS

ROUNDING_TOL = 1e-4
ALONE_TOL = 3e-2
JOIN_S = 120  # far above what the threads need (about a second): only a hang reaches it
N_TOKENS = 32
PROMPT = list(range(40, 160, 7))
#: Other sequences' text: each prefilled, then a few decode steps of its own.
OTHERS = {0: ([5, 6, 7, 8, 9, 10, 11], dict(mode="backbone"), 3), 1: ([100, 200, 300], dict(mode="river"), 5)}
#: River drafts of draft_max each round (the default planner follows the clock).
LOSSLESS = dict(mode="lossless", ngram_draft=False, adaptive_draft=False, draft_max=4)


@pytest.fixture(scope="module")
def tiny_river(tiny):
    """A random qwen2 as a River GGUF with a Q4_0 river (tests/test_lossless.py's): its drafts are
    accepted often and rejected often."""
    return tiny.river("qwen2", dict(seed=5, n_layer=3))


def _argmax(row, seen):
    return int(row.argmax())


def _greedy(session, prompt, n):
    """(tokens, the rows they were chosen from) of n greedy tokens after `prompt`."""
    session.prefill(prompt)
    tokens, rows = [], []
    for step in session.decode(_argmax, limit=n):
        tokens.append(step.token)
        rows.append(step.row.copy())
    return tokens, np.array(rows)


def _others(m):
    """Sessions on sequences 0 and 1 holding their text, each having decoded a few steps."""
    sessions = {}
    for seq, (prompt, options, steps) in OTHERS.items():
        sessions[seq] = m.session(seq=seq, **options)
        _greedy(sessions[seq], prompt, steps)
    return sessions


def _cache(m, n):
    """K and V of every layer, cache rows [0, n)."""
    return [m.cache_rows(layer, values, n) for layer in range(m.n_layer) for values in (False, True)]


def _next_rows(sessions):
    """The row of one more greedy decode step of each session."""
    out = {}
    for seq, s in sessions.items():
        row = s.row(s.n_past - 1)
        out[seq] = s.extend([int(row.argmax())], decode=True).copy()
    return out


@pytest.mark.parametrize("flash_attn", [False, True], ids=["attention", "flash-attention"])
def test_lossless_on_sequence_two_is_its_text_alone(tiny_river, flash_attn):
    m = Model(tiny_river, n_ctx=256, n_threads=THREADS, flash_attn=flash_attn)
    with m.session(seq=0, **LOSSLESS) as s:
        alone = _greedy(s, PROMPT, N_TOKENS)
    with m.session(seq=0, mode="backbone", verify_kernels=True) as s:
        reference = _greedy(s, PROMPT, N_TOKENS)
    assert alone[0] == reference[0] and np.array_equal(alone[1], reference[1])

    others = _others(m)
    texts = {seq: s.tokens for seq, s in others.items()}
    used = m.cache_used
    before = _cache(m, used)
    with m.session(seq=2, **LOSSLESS) as s2:
        got = _greedy(s2, PROMPT, N_TOKENS)
        c = s2.counters
        # Rounds verified several tokens, kept some drafts and threw some away.
        assert c.rounds > 0 and 0 < c.accepted < c.drafted, (c.rounds, c.accepted, c.drafted)
        # The other sequences hold what they held: tokens, row count and every K/V bit.
        assert {seq: s.tokens for seq, s in others.items()} == texts
        assert all(m.holds_cache(s) for s in others.values())
        assert m.cache_used == used + len(s2.tokens)
        for a, b in zip(_cache(m, used), before):
            assert np.array_equal(a, b)
    assert got[0] == alone[0]
    if flash_attn:
        assert np.array_equal(got[1], alone[1])
    else:
        np.testing.assert_allclose(got[1], alone[1], atol=ROUNDING_TOL, rtol=0)
    assert m.cache_used == used  # closing it freed sequence 2's rows

    # The other sequences' next steps equal the ones a cache where no lossless session ran gives.
    control = Model(tiny_river, n_ctx=256, n_threads=THREADS, flash_attn=flash_attn)
    control_others = _others(control)
    want = _next_rows(control_others)
    for seq, row in _next_rows(others).items():
        assert np.array_equal(row, want[seq]), f"sequence {seq}'s next step"
    for s in list(others.values()) + list(control_others.values()):
        s.close()


def _completion(llm, prompt, **kw):
    """The reply's tokens of one completion, the rows they were sampled from (recorded by a
    stopping criterion, which gets the row before any processor) and the call's statistics."""
    rows = []

    def record(input_ids, row):
        rows.append(np.array(row, dtype=np.float32))
        return False

    llm.create_completion(prompt, max_tokens=N_TOKENS, stopping_criteria=record, **kw)
    return llm.input_ids[len(prompt):llm.n_tokens].tolist(), rows, dict(llm.last_stats)


def _assert_alone_text(got, alone, greedy: bool, slot: int):
    """A slot's reply is its reply alone, up to the rounding of rows that sit in another order in
    the shared cache: every row up to the first parting is within ALONE_TOL of its alone row, and a
    parting is where that rounding shows (its rows are not equal; greedy: a near-tie)."""
    tokens, rows = got[0], got[1]
    want, want_rows = alone[0], alone[1]
    i = next((j for j, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
    n = len(rows) if i is None else i + 1
    assert len(rows) >= n and len(want_rows) >= n
    np.testing.assert_allclose(np.array(rows[:n]), np.array(want_rows[:n]), atol=ALONE_TOL, rtol=0,
                               err_msg=f"slot {slot}")
    if i is None:
        assert tokens == want, f"slot {slot}"
        return
    assert not np.array_equal(rows[i], want_rows[i]), f"slot {slot} parted at {i} from an equal row"
    if greedy:
        margin = want_rows[i][want[i]] - want_rows[i][tokens[i]]
        assert margin < 2 * ALONE_TOL, f"slot {slot} parted at {i}, top-2 margin {margin}"


def test_lossless_slots_from_threads_each_give_their_text_alone(tiny_river):
    """Slot 1 greedy and slot 2 sampled in lossless mode, slot 0 decoding plain steps, each in a
    thread of its own, with flash attention as the server runs: each gives its reply alone (up to
    the rounding of rows that concurrent slots leave out of position order in the shared cache,
    which ggml's CPU flash attention accumulates in that order), and no batch of the step batcher
    held more than one step (a lossless slot's rounds are never joined with other steps)."""
    llm = Llama(tiny_river, n_ctx=256, n_threads=THREADS, flash_attn=True, verbose=False)
    calls = {0: ([3, 9, 27, 81], dict(temperature=0.0, mode="backbone")),
             1: (PROMPT, dict(temperature=0.0, **LOSSLESS)),
             2: ([300, 17, 4000, 12, 250], dict(temperature=0.8, top_k=40, seed=7, **LOSSLESS))}
    try:
        alone = {k: _completion(llm, p, **kw) for k, (p, kw) in calls.items()}
        for k in (1, 2):
            stats = alone[k][2]
            assert stats["mode"] == "lossless" and stats["rounds"] > 0 and stats["accepted"] > 0, stats
        slots = llm.slots(3)
        got, errors = {}, []

        def run(k):
            try:
                got[k] = _completion(slots[k], calls[k][0], **calls[k][1])
            except Exception as e:  # reported by the main thread
                errors.append(e)

        before = llm.river_model.step_counts
        threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join(JOIN_S)
        assert not any(t.is_alive() for t in threads), "a slot's thread hung"
        assert not errors, errors
        after = llm.river_model.step_counts
        for k in calls:
            assert slots[k].session.seq == k
            _assert_alone_text(got[k], alone[k], greedy=calls[k][1]["temperature"] == 0.0, slot=k)
        assert got[1][2]["rounds"] > 0 and got[2][2]["rounds"] > 0
        assert after["steps"] - before["steps"] > 0  # slot 0's plain steps went through the batcher
        assert after["batches"] - before["batches"] == after["steps"] - before["steps"]
    finally:
        llm.close()
