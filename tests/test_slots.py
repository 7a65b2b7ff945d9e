"""Sessions over different sequences of one Model's KV cache, and their decode steps batched
(river_gguf.batching): each sequence decodes what it decodes alone, up to the rounding of a larger
batch's kernels (tests/native/test_sequences.py bounds it: SEQ_ALONE_TOL on the tiny random
models, SMOLLM2_ALONE_TOL on SmolLM2, where a greedy text may part only at a near-tie); threads
decoding at once share batches; a session that stops, raises or fails mid-batch releases the
others (every thread is joined with a timeout, so a hang fails instead of stalling)."""
import os
import pathlib
import threading

import numpy as np
import pytest

from river_gguf import Llama, Model, NumericalError
from river_gguf import _native as native
from river_gguf.session import STOP

from support import THREADS, package_digest

SEQ_ALONE_TOL = 1e-2
SMOLLM2_ALONE_TOL = 0.1
JOIN_S = 60  # far above what the threads need (well under a second each): only a hang reaches it

PROMPTS = [[1, 17, 243, 99, 4, 51], [1, 300, 12], [1, 88, 7, 640, 23, 9, 311, 45, 2], [1, 5]]
MODES = [dict(mode="backbone"), dict(mode="river-only"), dict(mode="river", threshold=0.3)]


@pytest.fixture(scope="module")
def tiny_pair(tiny):
    """A tiny random model with itself as its river (threshold given: no profile at load)."""
    path = tiny.model("llama", n_layer=4, seed=3)
    return Model(path, river=path, n_ctx=128, n_threads=THREADS, threshold=0.5)


def _rows_alone(m, prompt, tokens, **options):
    """The rows after the prompt and after each token, decoded alone on sequence 0."""
    with m.session(**options) as s:
        rows = [s.extend(prompt)]
        rows += [s.extend([t], decode=True) for t in tokens]
    return np.array(rows)


def _run_threads(targets):
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a decode thread hung"


@pytest.mark.parametrize("options", MODES)
def test_sessions_on_sequences_interleaved_equal_each_alone(tiny_pair, options):
    """Sessions on sequences 0-3 take turns step by step from one thread: none displaces
    another, and each one's rows equal its rows alone."""
    m = tiny_pair
    rng = np.random.default_rng(1)
    tokens = [list(map(int, rng.integers(0, m.n_vocab, 5))) for _ in PROMPTS]
    alone = [_rows_alone(m, p, t, **options) for p, t in zip(PROMPTS, tokens)]
    sessions = [m.session(seq=k, **options) for k in range(len(PROMPTS))]
    try:
        rows = [[s.extend(p)] for s, p in zip(sessions, PROMPTS)]
        for i in range(5):
            for k, s in enumerate(sessions):
                rows[k].append(s.extend([tokens[k][i]], decode=True))
        for k, s in enumerate(sessions):
            assert m.holds_cache(s) and s.tokens == PROMPTS[k] + tokens[k]
            np.testing.assert_allclose(np.array(rows[k]), alone[k], atol=SEQ_ALONE_TOL, rtol=0)
        assert m.cache_used == sum(len(p) + 5 for p in PROMPTS)
    finally:
        for s in sessions:
            s.close()
    assert m.cache_used == len(PROMPTS[0]) + 5  # closing frees sequences 1-3; sequence 0 stays


@pytest.mark.parametrize("options", MODES[:2])
def test_threads_decoding_at_once_share_batches(tiny_pair, options):
    """Four threads, each a session's argmax loop: their steps share batches, and each sequence's
    rows equal its rows alone (the greedy tokens too, or the parting is a near-tie)."""
    m = tiny_pair
    n = 8
    alone = {}
    for k, p in enumerate(PROMPTS):
        with m.session(**options) as s:
            s.extend(p)
            alone[k] = [st.token for st in s.decode(lambda row, seen: int(np.argmax(row)), limit=n)]
    got, rows = {}, {}
    before = m.step_counts
    m.step_window = 0.5  # long, so that a slow thread's step still joins its batch

    # Each thread's first token comes after its session joined the step batcher and before any
    # step runs: past the barrier, no thread's steps can all run before another thread starts.
    start = threading.Barrier(len(PROMPTS))

    def run(k):
        with m.session(seq=k, **options) as s:
            s.extend(PROMPTS[k])
            got[k], rows[k] = [], []
            for st in s.decode(lambda row, seen: int(np.argmax(row)), limit=n):
                got[k].append(st.token)
                rows[k].append(st.row.copy())
                if len(got[k]) == 1:
                    start.wait(JOIN_S)

    try:
        _run_threads([lambda k=k: run(k) for k in range(len(PROMPTS))])
    finally:
        m.step_window = 0.005
    after = m.step_counts
    assert after["steps"] - before["steps"] == len(PROMPTS) * (n - 1)
    assert after["batches"] - before["batches"] < after["steps"] - before["steps"]  # some shared a batch
    for k, p in enumerate(PROMPTS):
        if got[k] == alone[k]:
            np.testing.assert_allclose(np.array(rows[k]), _rows_alone(m, p, got[k][:-1], **options),
                                       atol=SEQ_ALONE_TOL, rtol=0)
            continue
        i = next(i for i, (a, b) in enumerate(zip(alone[k], got[k])) if a != b)
        row = m.logits(p + alone[k][:i], **options)[-1]
        assert abs(row[alone[k][i]] - row[got[k][i]]) < 2 * SEQ_ALONE_TOL, f"sequence {k} parted at {i}"


def test_a_session_that_stops_or_raises_releases_the_others(tiny_pair):
    """With a long window, a step waits for every session in a decode loop: one that stops early,
    one whose choose raises and one closed mid-loop leave it, and the others go on at once."""
    m = tiny_pair
    m.step_window = 5.0  # a hang of a step per token would take minutes: the join timeout fails first
    done, errors = {}, {}

    def argmax(row, seen):
        return int(np.argmax(row))

    def run(k, how):
        try:
            with m.session(seq=k, mode="backbone") as s:
                s.extend(PROMPTS[k])
                steps = s.decode(argmax, limit=None if how == "close" else 40)
                for i, st in enumerate(steps):
                    if how == "stop" and i == 2:
                        break
                    if how == "raise" and i == 2:
                        raise KeyError("the caller's own error")
                    if how == "close" and i == 3:
                        steps.close()
                        break
                done[k] = i
        except KeyError as e:
            errors[k] = e

    try:
        _run_threads([lambda: run(0, "stop"), lambda: run(1, "raise"), lambda: run(2, "close"),
                      lambda: run(3, "all")])
    finally:
        m.step_window = 0.005
    assert done == {0: 2, 2: 3, 3: 39} and isinstance(errors[1], KeyError)
    assert m.step_counts["members"] == 0


def test_sessions_on_one_sequence_take_turns(tiny_pair):
    """Three threads decode three sessions on sequence 0 at once: each step displaces the others,
    which evaluate their tokens again inside the batch that holds their next step, so every
    session finishes (none is displaced forever) with its greedy tokens alone."""
    m = tiny_pair
    argmax = lambda row, seen: int(np.argmax(row))  # noqa: E731
    alone = {}
    for k in range(3):
        with m.session(mode="backbone") as s:
            s.extend(PROMPTS[k])
            alone[k] = [st.token for st in s.decode(argmax, limit=6)]
    got = {}

    def run(k):
        with m.session(mode="backbone") as s:
            s.extend(PROMPTS[k])
            got[k] = [st.token for st in s.decode(argmax, limit=6)]

    _run_threads([lambda k=k: run(k) for k in range(3)])
    assert got == alone


def _poisoned_copy(src, dst, token):
    """A copy of a tiny F32 model whose `token` embeds as NaN."""
    from river_gguf.gguf.reader import GGUFReader

    dst.write_bytes(pathlib.Path(src).read_bytes())
    t = next(t for t in GGUFReader(str(dst)).tensors if t.name == "token_embd.weight")
    n_embd = int(t.shape[0])
    with open(dst, "r+b") as f:
        f.seek(int(t.data_offset) + token * n_embd * 4)
        f.write(np.full(n_embd, np.nan, dtype=np.float32).tobytes())
    return str(dst)


def test_a_failing_step_raises_in_its_own_session(tiny, built):
    """A step whose token gives NaN logits raises NumericalError in its session only; the session
    batched with it decodes on, its text that of the session alone."""
    poison = 4242
    src = tiny.model("llama", n_layer=4, seed=3)
    # Built once and kept.
    path = built.get("tiny-llama-nan-token", lambda out: _poisoned_copy(src, out, poison),
                     [os.path.basename(src), poison], package_digest())
    m = Model(path, n_ctx=128, n_threads=THREADS)
    with m.session() as s:
        s.extend(PROMPTS[1])
        clean = [st.token for st in s.decode(lambda row, seen: int(np.argmax(row)), limit=10)]
    m.step_window = 0.5
    out = {}

    def run(k, poisoned):
        try:
            with m.session(seq=k) as s:
                s.extend(PROMPTS[1])
                out[k] = [st.token for st in s.decode(
                    lambda row, seen: poison if poisoned and seen >= len(PROMPTS[1]) + 2 else int(np.argmax(row)),
                    limit=10)]
        except NumericalError as e:
            out[k] = e

    _run_threads([lambda: run(0, True), lambda: run(1, False)])
    assert isinstance(out[0], NumericalError) and out[1] == clean
    assert m.cache_used == len(PROMPTS[1]) + 2  # sequence 0's clean rows (it stays); sequence 1 freed


def test_a_full_cache_cuts_the_steps_that_do_not_fit(tiny):
    """A batch with more steps than free cache rows: those beyond raise ContextOverflowError in
    their own sessions, the rest are evaluated."""
    m = Model(tiny.model("llama", n_layer=4, seed=3), n_ctx=20, n_threads=THREADS)
    m.step_window = 0.5
    results = {}
    sessions = [m.session(seq=k, mode="backbone") for k in range(2)]
    for k, s in enumerate(sessions):
        s.extend([1] + [5 + k] * 8)  # 9 rows each: 2 left for the decode steps of both

    def run(k):
        n = 0
        try:
            for _ in sessions[k].decode(lambda row, seen: int(np.argmax(row))):
                n += 1
        except native.ContextOverflowError:
            results[k] = n

    _run_threads([lambda: run(0), lambda: run(1)])
    assert sorted(results) == [0, 1] and sum(results.values()) == 2 + 2  # each yields one more than it evaluates


def test_session_sequence_is_checked(tiny_pair):
    with pytest.raises(ValueError, match="seq must be an int"):
        tiny_pair.session(seq=-1)
    with tiny_pair.session(seq=1, mode="lossless") as s:  # lossless on any sequence: tests/test_lossless_slots.py
        assert s.seq == 1


@pytest.mark.parametrize("options", [dict(mode="backbone"), dict(mode="river", threshold=0.3)])
def test_llama_slots_complete_at_once_as_alone(tiny, options):
    """Three Llama slots over one loaded model, each completing greedily in a thread of its own
    (one streaming): each gives the tokens and text it gives alone, or parts at a near-tie."""
    path = tiny.model("llama", n_layer=4, seed=3)
    # The river is the backbone's own file: a batch's exit (the lowest score's) may differ from a
    # sequence's alone, and then changes its rows by rounding only.
    llm = Llama(path, n_ctx=128, n_threads=THREADS, verbose=False, river=path, **options)
    prompts = PROMPTS[:3]
    try:
        alone, alone_text = [], []
        for p in prompts:
            alone_text.append(llm.create_completion(p, max_tokens=10, temperature=0.0)["choices"][0]["text"])
            alone.append(llm.input_ids[:llm.n_tokens].tolist())
        slots = llm.slots(len(prompts))
        llm.river_model.step_window = 0.5
        texts, ids = {}, {}

        def run(k):
            if k == 1:
                chunks = slots[k].create_completion(prompts[k], max_tokens=10, temperature=0.0, stream=True)
                texts[k] = "".join(c["choices"][0]["text"] for c in chunks)
            else:
                texts[k] = slots[k].create_completion(prompts[k], max_tokens=10, temperature=0.0)["choices"][0]["text"]
            ids[k] = slots[k].input_ids[:slots[k].n_tokens].tolist()

        before = llm.river_model.step_counts
        _run_threads([lambda k=k: run(k) for k in range(len(prompts))])
        after = llm.river_model.step_counts
        assert after["batches"] - before["batches"] < after["steps"] - before["steps"]  # some shared a batch
        m = llm.river_model
        for k, p in enumerate(prompts):
            assert slots[k].session.seq == k
            if ids[k] == alone[k]:
                assert texts[k] == alone_text[k]
                continue
            i = next(i for i, (a, b) in enumerate(zip(alone[k], ids[k])) if a != b)
            row = m.logits(alone[k][:i], **options)[-1]
            assert abs(row[alone[k][i]] - row[ids[k][i]]) < 2 * SEQ_ALONE_TOL, f"slot {k} parted at {i}"
        chat = slots[2].create_chat_completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                               temperature=0.0)
        assert chat["choices"][0]["message"]["role"] == "assistant" and slots[2].session.seq == 2
    finally:
        llm.close()
    assert all(s.session is None for s in slots)
