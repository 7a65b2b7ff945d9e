"""The premise of lossless mode's exactness: a backbone row's bits do not depend on how the verify
batch that computes it is made up.

In the decode steps' kernels (lossless_kernels "decode", where the engine can), every
row of a batch is bit for bit the row a decode step at its position gives: each weight product
reads its activations converted as a decode step's does, in padded rows that keep ggml's batched
kernels out, and each row attends alone over the cache rows a decode step would. So lossless text
is plain decoding's. Where the engine cannot (a repacked backbone weight has kernels of its own for
one column and for several), the rows take the batched kernels.

In the batched kernels (lossless_kernels "batch", the default), a verify batch holds the round's token and its
drafts (2 to draft_max + 1 tokens), so the row that decides a token comes from batches of every
size from 2 to 9 and at every position in them; the exact reference (verify_kernels) evaluates
each token in a batch of 2. They agree bit for bit only where the row for token t, evaluated after
the same cache in a batch of n (2 <= n <= 9) at any position, equals the row a batch of 2 gives.
That holds where every mat-mul of a batch of 2 or more goes through one kernel whose reduction
order per output does not depend on the batch's width (llamafile's tinyBLAS for F16 on x86), and
flash attention reduces each query row alone below 64 rows. Where it fails is stated per type
below, so that a change of kernels shows as a failing test either way."""
import numpy as np
import pytest

from river_gguf import Model
from river_gguf._loader import native

from support import PROSE, THREADS

#: Targets: the rows for these positions are evaluated in every batch size and at every place.
TARGETS = range(12, 20)
SIZES = range(2, 10)
#: The backbone types the converter writes (river-gguf convert --backbone-type): whether a row's
#: bits are the same in every batch of 2 to 9 (the verify batch's premise), and whether a token
#: evaluated alone (a plain decode step) gets those bits too, at this test's short context. F16:
#: a decode step's mat-muls take ggml_vec_dot_f16 and a batch's take tinyBLAS, which sum in
#: another order. Q8_0 on x86: both kernels add the blocks' scaled integer dot products into the
#: same 8 lanes in block order, so a short context's decode step gets the batch's row; once the
#: attended length pads to 512 or more, a decode step on several threads splits its attention
#: over them and rounds otherwise (a batch's rows never split).
BACKBONES = [
    pytest.param("f16", True, False, id="f16"),
    pytest.param("q8_0", True, True, id="q8_0"),
]


@pytest.fixture(scope="module")
def backbones(tiny):
    """A random qwen2 model with an F16 backbone, and the same model's Q8_0 backbone. Shapes whose
    rows are multiples of the CPU's repacked tile widths, so a repacking kernel would apply."""
    model = dict(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, dtype="f16", seed=11)
    return {"f16": tiny.model("qwen2", **model), "q8_0": tiny.river("qwen2", model, backbone_type="q8_0")}


#: Batches at positions whose decode steps attend over 256 padded rows, over 256 and then 512
#: within the batch, and over 768 (from 512 rows, flash attention splits a lone row's attention
#: across the threads and reduces the parts).
DECODE_STARTS = (20, 252, 700)


@pytest.mark.parametrize("flash_attn", [True, False], ids=["flash-attention", "attention"])
@pytest.mark.parametrize("backbone", ["f16", "q8_0"])
def test_decode_kernels_give_every_row_a_decode_steps_bits(backbones, backbone, flash_attn):
    # Two threads whatever the worker: the split attention's parts are per thread.
    kw = dict(n_ctx=1024, n_threads=2, flash_attn=flash_attn)
    m = Model(backbones[backbone], lossless_kernels="decode", **kw)
    assert m.lossless_kernels == "decode"
    batched = Model(backbones[backbone], lossless_kernels="batch", **kw)
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, m.n_vocab, 720)]
    differ, batched_differ, checked = [], 0, 0
    for start in DECODE_STARTS:
        for n in (2, 5, 9):
            with m.session(mode="backbone") as s:
                s.prefill(tokens[:start])
                steps = [np.array(s.extend([t], decode=True)) for t in tokens[start:start + n]]
                s.truncate(start)
                rows = s.verify(tokens[start:start + n])
            with batched.session(mode="backbone") as b:
                b.prefill(tokens[:start])
                other = b.verify(tokens[start:start + n])
            for i in range(n):
                checked += 1
                if not np.array_equal(rows[i], steps[i]):
                    differ.append(f"start {start} n={n} row {i}: |diff| {np.abs(rows[i] - steps[i]).max():.3g}")
                batched_differ += not np.array_equal(other[i], steps[i])
    assert not differ, f"{len(differ)} of {checked} rows differ from decode steps':\n" + "\n".join(differ[:20])
    if backbone == "f16":
        # The check can fail: the batched kernels round an F16 backbone's rows otherwise.
        assert batched_differ, "every batched row equals a decode step's"


def test_a_long_batch_in_the_decode_kernels_is_decode_steps(backbones):
    """A verify batch of an n-gram's 16 drafts and more: a graph larger than a decode step's
    scheduler holds (an attention per row), still each row a decode step's."""
    m = Model(backbones["f16"], n_ctx=128, n_threads=THREADS, lossless_kernels="decode")
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, m.n_vocab, 60)]
    with m.session(mode="backbone") as s:
        s.prefill(tokens[:20])
        steps = [np.array(s.extend([t], decode=True)) for t in tokens[20:60]]
        s.truncate(20)
        rows = s.verify(tokens[20:60])
    assert all(np.array_equal(r, st) for r, st in zip(rows, steps))


@pytest.mark.parametrize("repack,kernels", [(True, "batch"), (False, "decode")])
def test_a_repacked_backbone_verifies_in_the_batched_kernels(q4_0_path, repack, kernels):
    """A Q4_0 model repacked for the CPU has one kernel for a column and another for several,
    which padded activations do not reach: its verify batches take the batched kernels, and the
    engine refuses decode kernels. Left in its plain layout, it verifies in the decode kernels."""
    path = q4_0_path
    assert Model(path, n_ctx=64, n_threads=THREADS, repack=repack, lossless_kernels="decode").lossless_kernels == kernels
    engine = native.Engine(path, n_ctx=64, n_threads=THREADS, repack=repack)
    assert engine.decode_kernels_exact == (kernels == "decode")
    if kernels == "batch":
        with pytest.raises(ValueError, match="decode_kernels"):
            engine.eval([1, 2, 3], all_logits=True, decode_kernels=True)
        assert engine.n_past == 0
    else:
        assert engine.eval([1, 2, 3], all_logits=True, decode_kernels=True)[0].shape[0] == 3


def _rows_in_batches(m: Model, tokens, n: int) -> dict:
    """{(t, place): row} for each target t, evaluated at each place in a batch of n tokens after
    the same cache (tokens before the batch, written by one prompt batch)."""
    rows = {}
    with m.session(mode="backbone") as s:
        s.extend(tokens[:max(TARGETS) + n])
        # Descending starts: a batch rewrites only positions at or after its start, which the batches
        # after it (starting earlier) rewrite themselves before reading, so every batch reads the
        # prompt batch's cache below its start.
        for start in range(max(TARGETS), min(TARGETS) - n, -1):
            s.truncate(start)
            out = s.extend(tokens[start:start + n], all_logits=True)
            for place in range(n):
                if start + place in TARGETS:
                    rows[start + place, place] = np.array(out[place])
    return rows


@pytest.mark.parametrize("backbone,invariant,alone_equal", BACKBONES)
def test_a_rows_bits_do_not_depend_on_its_verify_batch(backbones, backbone, invariant, alone_equal):
    m = Model(backbones[backbone], n_ctx=64, n_threads=THREADS)
    tokens = m.tokenize(PROSE)[:40]
    ref = {t: row for (t, place), row in _rows_in_batches(m, tokens, 2).items() if place == 0}
    differ, checked = [], 0
    for n in SIZES:
        rows = _rows_in_batches(m, tokens, n)
        assert len(rows) == len(TARGETS) * n  # every target at every place
        checked += len(rows)
        for (t, place), row in rows.items():
            if not np.array_equal(row, ref[t]):
                differ.append(f"n={n} place={place} token {t}: |diff| {np.abs(row - ref[t]).max():.3g}")
    if invariant:
        assert not differ, f"{len(differ)} of {checked} rows differ from a batch of 2's:\n" + "\n".join(differ[:20])
    else:
        # Stated so that a kernel change that makes it hold shows up: the list above then moves.
        assert differ, f"every one of {checked} rows equals a batch of 2's: {backbone} is batch-invariant now"
    # Why the exact reference is a batch of 2 and not a decode step: for F16, a token evaluated
    # alone takes the single-token kernels, whose rows round otherwise.
    alone = []
    with m.session(mode="backbone") as s:
        s.extend(tokens[:max(TARGETS) + 2])
        for t in reversed(TARGETS):
            s.truncate(t)
            alone.append(np.array_equal(s.extend(tokens[t:t + 1], decode=True).reshape(-1)[-m.n_vocab:], ref[t]))
    if alone_equal:
        assert all(alone), f"{backbone}: {alone.count(False)} single-token rows differ from the batched ones"
    else:
        assert not all(alone), f"{backbone}: the single-token rows equal the batched ones bit for bit"
