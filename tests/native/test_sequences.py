"""Several sequences in one KV cache, evaluated together in one batch (Engine.eval's seq_ids).

The oracle is stock llama.cpp (llama-cpp-python's low-level API) with n_seq_max sequences in one
unified cache, decoding the same batches: both run the same ggml kernels on batches of the same
size, so every row agrees within support.LOGIT_TOL (on SmolLM2 they are equal to the bit).

Against each sequence decoded alone (a batch of its own tokens only), a row differs by the
rounding of a larger batch's kernels, which llama.cpp's batches share. The bounds, from measured
deviations with room to spare: SEQ_ALONE_TOL for the tiny random models (at most 4e-4 measured,
with and without flash attention); SMOLLM2_ALONE_TOL for SmolLM2's F16 backbone and Q4_0 river
with flash attention (up to 0.09 on random tokens, 0.04 on text). Without flash attention the Q4_0
river's batched rows part from its single-sequence rows by up to 0.8 (llama.cpp's batches by the
same), so no test compares those with the run alone."""
import ctypes

import llama_cpp
import numpy as np
import pytest

from river_gguf import _native as native
from river_gguf.eval.random_model import write_tiny_model

from support import LOGIT_TOL, PROSE, THREADS

SEQ_ALONE_TOL = 1e-2
SMOLLM2_ALONE_TOL = 0.1

# Prompts of mixed lengths per sequence, and decode steps in which some sequences sit out.
PROMPT_LENGTHS = (5, 1, 9, 3, 12, 2, 7, 4)


def _steps(n_seq, n_steps=4):
    """Each step's sequences: all of them, except that sequence s sits out the steps where
    (step + s) % 3 == 2 (so batches mix 1 to n_seq tokens)."""
    out = []
    for step in range(n_steps):
        seqs = [s for s in range(n_seq) if n_seq == 1 or (step + s) % 3 != 2]
        out.append(seqs or [0])
    return out


class LlamaCppSequences:
    """Stock llama.cpp with n_seq_max sequences in one unified KV cache (F16, flash attention), set
    up like the engine; decode() takes (token, seq) pairs appended to their sequences, with a
    logits row for each."""

    def __init__(self, path, n_ctx=256, n_seq_max=8, flash_attn=True):
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        assert self.model, f"llama.cpp could not load {path}"
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_ctx, n_ctx, n_seq_max
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = THREADS
        cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        assert self.ctx
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, n_seq_max)
        self.length = {}

    def decode(self, tokens, seqs, outputs=None):
        """Rows of the tokens `outputs` names (indices into tokens; default: all), in order."""
        outputs = range(len(tokens)) if outputs is None else outputs
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (t, s) in enumerate(zip(tokens, seqs)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, self.length.get(s, 0), 1, i in outputs
            b.seq_id[i][0] = s
            self.length[s] = self.length.get(s, 0) + 1
        assert llama_cpp.llama_decode(self.ctx, b) == 0
        rows = [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()
                for i in outputs]
        return np.array(rows, dtype=np.float32)

    def remove_tail(self, seq, n):
        assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ctx), seq, n, -1)
        self.length[seq] = n

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


@pytest.fixture
def llama_sequences():
    made = []

    def make(path, **kw):
        made.append(LlamaCppSequences(path, **kw))
        return made[-1]

    yield make
    for o in made:
        o.close()


def _texts(n_seq, n_vocab, seed=3):
    """Per sequence: its prompt and the tokens of its decode steps."""
    rng = np.random.default_rng(seed)
    steps = _steps(n_seq)
    prompts = [list(map(int, rng.integers(0, n_vocab, PROMPT_LENGTHS[s]))) for s in range(n_seq)]
    decoded = [list(map(int, rng.integers(0, n_vocab, sum(s in st for st in steps)))) for s in range(n_seq)]
    return prompts, decoded, steps


def _batches(prompts, decoded, steps):
    """The batches (tokens, seq_ids) of one run: every prompt in one interleaved batch, then each
    step's tokens."""
    order = sorted(((i, s) for s in range(len(prompts)) for i in range(len(prompts[s]))))
    out = [([prompts[s][i] for i, s in order], [s for _, s in order])]
    nxt = [0] * len(prompts)
    for seqs in steps:
        toks = []
        for s in seqs:
            toks.append(decoded[s][nxt[s]])
            nxt[s] += 1
        out.append((toks, list(seqs)))
    return out


def _run_batched(engine, batches, **setting):
    """Every token's logits row, per sequence, in its order; and each batch's exit layer."""
    rows, exits = {}, []
    for toks, seqs in batches:
        logits, exit_layer, _ = engine.eval(toks, seq_ids=seqs, all_logits=True, **setting)
        assert logits.shape == (len(toks), engine.hparams["n_vocab"])
        exits.append(exit_layer)
        for r, s in zip(logits, seqs):
            rows.setdefault(s, []).append(r)
    return {s: np.array(r) for s, r in rows.items()}, exits


def _run_alone(engine, prompt, decoded, **setting):
    """One sequence alone in the default sequence: its prompt as one batch, then a token a step."""
    engine.truncate(0)
    rows = [engine.eval(prompt, all_logits=True, **setting)[0]]
    rows += [engine.eval([t], all_logits=True, **setting)[0] for t in decoded]
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def tiny_llama(tiny):
    return tiny.model("llama", n_layer=3, seed=5)


@pytest.fixture(scope="module")
def tiny_river(tiny):
    """The same random model in F16: a river for tiny_llama, and the river-only oracle."""
    return tiny.model("llama", n_layer=3, seed=5, dtype="f16")


RIVER_ONLY = dict(mode="river-only", river_head=True)


def _check_batched(backbone, river, oracle_path, n_seq, flash_attn, make_oracle, alone_tol=SEQ_ALONE_TOL,
                   **setting):
    """Each sequence of a mixed run against itself alone and against llama.cpp's same batches."""
    e = native.Engine(backbone, river, n_ctx=256, n_threads=THREADS, flash_attn=flash_attn)
    prompts, decoded, steps = _texts(n_seq, e.hparams["n_vocab"])
    batches = _batches(prompts, decoded, steps)
    ours, _ = _run_batched(e, batches, **setting)
    assert e.sequences == list(range(n_seq))
    assert e.cache_used == sum(len(p) + len(d) for p, d in zip(prompts, decoded))
    oracle = make_oracle(oracle_path, flash_attn=flash_attn)
    ref = {}
    for toks, seqs in batches:
        for r, s in zip(oracle.decode(toks, seqs), seqs):
            ref.setdefault(s, []).append(r)
    alone_engine = native.Engine(backbone, river, n_ctx=256, n_threads=THREADS, flash_attn=flash_attn)
    for s in range(n_seq):
        assert np.isfinite(ours[s]).all()
        assert np.abs(ours[s] - np.array(ref[s])).max() < LOGIT_TOL, f"sequence {s} against llama.cpp"
        alone = _run_alone(alone_engine, prompts[s], decoded[s], **setting)
        assert np.abs(ours[s] - alone).max() < alone_tol, f"sequence {s} against itself alone"


@pytest.mark.parametrize("n_seq,flash_attn", [(1, True), (3, True), (8, True), (5, False)])
def test_each_sequence_equals_itself_alone_and_llama_cpp(n_seq, flash_attn, tiny_llama, llama_sequences):
    _check_batched(tiny_llama, "", tiny_llama, n_seq, flash_attn, llama_sequences)


@pytest.mark.parametrize("n_seq,flash_attn", [(4, True), (6, False)])
def test_river_only_sequences_equal_the_river_alone_and_llama_cpp(n_seq, flash_attn, tiny_llama, tiny_river,
                                                                   llama_sequences):
    _check_batched(tiny_llama, tiny_river, tiny_river, n_seq, flash_attn, llama_sequences, **RIVER_ONLY)


def test_forced_exit_sequences_equal_alone_and_the_hybrid_in_llama_cpp(tiny_llama, tiny_river, tmp_path,
                                                                        llama_sequences):
    # RIVER.md invariant 2 per sequence: backbone layer 0, river layers 1.. for every token.
    from river_gguf.convert.hybrid import write_hybrid_gguf

    hybrid = write_hybrid_gguf(tiny_llama, tiny_river, str(tmp_path / "hybrid.gguf"), exit_layer=0, river_head=False)
    _check_batched(tiny_llama, tiny_river, hybrid, 4, True, llama_sequences, mode="fixed", exit_layer=0)


@pytest.mark.parametrize("river_only", [False, True])
def test_smollm2_sequences_equal_llama_cpp(river_only, f16_path, q4_0_path, llama_sequences):
    # A real F16 backbone and its Q4_0 river: real kernels in a batch of several sequences.
    setting = RIVER_ONLY if river_only else {}
    _check_batched(f16_path, q4_0_path, q4_0_path if river_only else f16_path, 3, True, llama_sequences,
                   SMOLLM2_ALONE_TOL, **setting)


def test_last_rows_come_back_per_sequence(tiny_llama, llama_sequences):
    e = native.Engine(tiny_llama, n_ctx=256, n_threads=THREADS)
    toks, seqs = [5, 6, 7, 8, 9, 10], [3, 1, 3, 1, 1, 0]
    every, _, _ = e.eval(toks, seq_ids=seqs, all_logits=True)
    for s in (0, 1, 3):
        e.truncate(0, seq=s)
    assert e.sequences == [] and e.cache_used == 0
    last, _, _ = e.eval(toks, seq_ids=seqs)
    # In the order the sequences first appear: 3, 1, 0; each its last token's row.
    assert last.shape == (3, e.hparams["n_vocab"])
    assert np.array_equal(last, every[[2, 4, 5]])
    # llama.cpp computing only those rows (its output ids select them in the last layer).
    oracle = llama_sequences(tiny_llama)
    assert np.abs(last - oracle.decode(toks, seqs, outputs=[2, 4, 5])).max() < LOGIT_TOL
    assert [e.sequence_length(s) for s in (0, 1, 2, 3)] == [1, 3, 0, 2]



def test_last_rows_across_batches(tiny_llama):
    # n_batch 4 splits the request: sequence 1's last token is in the first batch, none is in the
    # second, sequences 2 and 0 end in the third.
    toks = list(range(100, 111))
    seqs = [0, 1, 0, 2, 0, 2, 0, 0, 2, 2, 0]
    every = native.Engine(tiny_llama, n_ctx=64, n_threads=THREADS, n_batch=4)
    rows, _, _ = every.eval(toks, seq_ids=seqs, all_logits=True)
    last = native.Engine(tiny_llama, n_ctx=64, n_threads=THREADS, n_batch=4)
    ours, _, _ = last.eval(toks, seq_ids=seqs)
    assert ours.shape == (3, last.hparams["n_vocab"])
    assert np.abs(ours - rows[[10, 1, 9]]).max() < SEQ_ALONE_TOL
    assert [last.sequence_length(s) for s in (0, 1, 2)] == [6, 1, 4]


def test_removing_a_tail_leaves_the_other_sequences_unchanged(tiny_llama, llama_sequences):
    e = native.Engine(tiny_llama, n_ctx=256, n_threads=THREADS)
    oracle = llama_sequences(tiny_llama)
    prompts, decoded, _ = _texts(4, e.hparams["n_vocab"], seed=9)
    first = _batches(prompts, [[]] * 4, [])[0]
    e.eval(*first[:1], seq_ids=first[1])
    oracle.decode(*first)
    # Sequence 2 loses its last 2 positions and sequence 0 is cleared; then every sequence steps.
    e.truncate(len(prompts[2]) - 2, seq=2)
    e.truncate(0, seq=0)
    oracle.remove_tail(2, len(prompts[2]) - 2)
    oracle.remove_tail(0, 0)
    assert e.sequence_rows(0) == [] and len(e.sequence_rows(2)) == len(prompts[2]) - 2
    step = ([decoded[s][0] for s in range(4)], [0, 1, 2, 3])
    ours, _, _ = e.eval(step[0], seq_ids=step[1], all_logits=True)
    assert np.abs(ours - oracle.decode(*step)).max() < LOGIT_TOL
    alone = native.Engine(tiny_llama, n_ctx=256, n_threads=THREADS)
    kept = {0: [], 1: prompts[1], 2: prompts[2][:-2], 3: prompts[3]}
    for s in range(4):
        row = _run_alone(alone, kept[s] + [decoded[s][0]], [])[-1]
        assert np.abs(ours[s] - row).max() < SEQ_ALONE_TOL, f"sequence {s}"


def test_sliding_window_is_per_sequence(tmp_path, llama_sequences):
    path = write_tiny_model(tmp_path / "gemma2.gguf", "gemma2", n_layer=3, tied=True, sliding_window=4, seed=2)
    e = native.Engine(path, n_ctx=256, n_threads=THREADS)
    prompts, decoded, steps = _texts(3, e.hparams["n_vocab"], seed=4)
    batches = _batches(prompts, decoded, steps)
    ours, _ = _run_batched(e, batches)
    oracle = llama_sequences(path)
    alone = native.Engine(path, n_ctx=256, n_threads=THREADS)
    ref = {}
    for toks, seqs in batches:
        for r, s in zip(oracle.decode(toks, seqs), seqs):
            ref.setdefault(s, []).append(r)
    for s in range(3):
        assert np.abs(ours[s] - np.array(ref[s])).max() < LOGIT_TOL
        assert np.abs(ours[s] - _run_alone(alone, prompts[s], decoded[s])).max() < SEQ_ALONE_TOL


def test_bad_sequence_input_is_refused(tiny_llama):
    e = native.Engine(tiny_llama, n_ctx=16, n_threads=THREADS)
    with pytest.raises(ValueError, match="one sequence id per token"):
        e.eval([1, 2, 3], seq_ids=[0, 1])
    with pytest.raises(ValueError, match="negative"):
        e.eval([1, 2], seq_ids=[0, -1])
    with pytest.raises(ValueError, match="first_row"):
        e.eval([1, 2], seq_ids=[0, 1], all_logits=True, first_row=1)
    e.eval([1] * 10, seq_ids=[0, 1] * 5)
    with pytest.raises(native.ContextOverflowError):
        e.eval([1] * 7, seq_ids=[2] * 7)
    assert e.cache_used == 10 and e.sequence_length(2) == 0  # a refused batch leaves no rows
    with pytest.raises(ValueError, match="out of range"):
        e.truncate(6, seq=1)
    with pytest.raises(ValueError, match=">= 0"):
        e.truncate(0, seq=-1)


def _rolled_back(e, seqs, lengths):
    for s in set(seqs):
        e.truncate(lengths[s], seq=s)


def test_batch_leaves_only_when_every_token_passes(tiny_llama, tiny_river):
    """River's exit for a batch of sequences: one decision per layer, at the first layer whose
    lowest score over the batch passes tau; the logits are those of a forced exit there, and
    every sequence's cache rows are written at every layer (RIVER.md invariant 4, per sequence).

    tau comes from the engine's own scores of each batch (a never-exit trace): just under the
    highest per-layer minimum, so each batch leaves before its last layer."""
    e = native.Engine(tiny_llama, tiny_river, n_ctx=256, n_threads=THREADS)
    n_layer = e.hparams["n_layer"]
    prompts, decoded, steps = _texts(6, e.hparams["n_vocab"], seed=11)
    batches = _batches(prompts, decoded, steps)
    e.eval(batches[0][0], seq_ids=batches[0][1])
    held_back = 0  # layers where some token passed tau but the batch stayed
    for toks, seqs in batches[1:]:
        n = len(toks)
        lengths = {s: e.sequence_length(s) for s in seqs}
        backbone, k_never, trace = e.eval(toks, seq_ids=seqs, all_logits=True, mode="river", threshold=2.0, trace=True)
        assert k_never == n_layer - 1 and len(trace) == n_layer * n
        scores = np.array(trace, dtype=np.float32).reshape(n_layer, n)[: n_layer - 1]  # the river needs a layer
        target = int(scores.min(axis=1).argmax())
        tau = float(np.nextafter(scores[target].min(), np.float32(-1)))
        expected = next(l for l in range(n_layer - 1) if scores[l].min() > tau)
        held_back += sum(scores[l].max() > tau for l in range(expected))
        _rolled_back(e, seqs, lengths)
        dynamic, k, lowest = e.eval(toks, seq_ids=seqs, all_logits=True, mode="river", threshold=tau)
        assert k == expected
        assert np.array_equal(np.array(lowest, dtype=np.float32), scores[: k + 1].min(axis=1))
        _rolled_back(e, seqs, lengths)
        forced, _, _ = e.eval(toks, seq_ids=seqs, all_logits=True, mode="fixed", exit_layer=k)
        assert np.array_equal(dynamic, forced)
        _rolled_back(e, seqs, lengths)
        above_one, k_one, _ = e.eval(toks, seq_ids=seqs, all_logits=True, mode="river", threshold=1.01)
        assert k_one == n_layer - 1 and np.array_equal(above_one, backbone)  # invariant 1
        _rolled_back(e, seqs, lengths)
        e.eval(toks, seq_ids=seqs, mode="river", threshold=tau)  # the rows the next step reads
    assert held_back > 0, "no batch had a token that passed alone: the test shows nothing of the min rule"
    used = sorted(r for s in e.sequences for r in e.sequence_rows(s))
    assert used == list(range(e.cache_used))
    for layer in range(n_layer):
        for values in (False, True):
            rows = e.cache_rows(layer, values, e.cache_used + 1)
            assert np.isfinite(rows[:-1]).all(), f"hole in layer {layer} {'V' if values else 'K'}"
            assert np.isnan(rows[-1]).all()  # the row after them still holds the poison: the check can fail


PROMPTS = ["Once upon a time, in a small village by the sea,", PROSE, "The history of the bridge begins",
           "Chapter 1\n\nThe rain had not stopped for three days."]


@pytest.mark.parametrize("options", [dict(mode="backbone"), dict(mode="river-only")])
def test_greedy_sequences_equal_each_prompt_alone(options, f16_path, q4_0_path):
    """Each prompt's greedy text decoded with the others equals its text alone, or parts at a
    near-tie: the two tokens' logits there (a third evaluation, the prompt batch of the text up
    to the parting) are within twice SmolLM2's batched-kernel rounding bound of each other."""
    from river_gguf import Model
    from river_gguf.greedy import greedy
    from river_gguf.sequences import greedy_sequences

    # threshold given: no similarity profile runs at load.
    m = Model(f16_path, river=q4_0_path, n_ctx=512, n_threads=THREADS, threshold=0.97)
    prompts = [m.tokenize(p) for p in PROMPTS]
    together = greedy_sequences(m, prompts, max_tokens=12, **options)
    assert m.cache_used == 0
    assert [len(t.exit_layers) for t in together] == [len(t.tokens) for t in together]
    for p, t in zip(prompts, together):
        alone = greedy(m, p, max_tokens=12, **options)
        if t.tokens == alone.tokens:
            assert t.finish_reason == alone.finish_reason
            continue
        i = next(i for i, (a, b) in enumerate(zip(alone.tokens, t.tokens)) if a != b)
        row = m.logits(p + alone.tokens[:i], **options)[-1]
        margin = abs(row[alone.tokens[i]] - row[t.tokens[i]])
        assert margin < 2 * SMOLLM2_ALONE_TOL, f"parted at {i} with a margin of {margin}: not a near-tie"


def test_dynamic_steps_of_sequences_reuse_their_graphs(tiny_llama, tiny_river):
    # tau -1: every batch leaves after layer 0, so each step runs the backbone graph with its exit
    # nodes, then the river graph; both are kept and run again, not rebuilt.
    e = native.Engine(tiny_llama, tiny_river, n_ctx=256, n_threads=THREADS)
    e.eval([1, 2, 3, 4, 5, 6], seq_ids=[0, 1, 2, 0, 1, 2])
    built = []
    for t in range(4):
        _, k, _ = e.eval([7 + t] * 3, seq_ids=[0, 1, 2], mode="river", threshold=-1.0)
        assert k == 0
        built.append(e.graphs_built)
    assert built[1:] == [built[0]] * 3
