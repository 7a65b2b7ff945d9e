"""Lossless mode samples the backbone's distribution: over 20,000 seeds, the joint distribution of
the next three tokens after a prompt is the same in lossless mode as in backbone mode (a G-test
of homogeneity at alpha = 1e-3), sampled plainly (temperature 1, nothing else) and with every
stage of the chain (repeat penalty, top-k, top-p, min-p, temperature).

The seeded tests show each run equal to the reference token for token; this one shows what no
single run can: that keeping a draft while it equals the sampled token changes no probability,
whatever the river proposes. The model has a vocabulary of 8 tokens (512 joint outcomes of three
tokens) and its river is another random model, so drafts are often rejected, at every place.

20,000 runs on the engine would take minutes, so the runs replay recorded rows: every row a run
of three tokens can meet (the backbone's after each prefix, evaluated as a verify batch evaluates
it; the river's after each prefix of a round's drafts, drafted from where the round starts) is
computed once on the engine, and a Session decodes on an engine that serves those rows. The
Session's rounds, its acceptance rule and the chains (the run's own, and the clone that draws the
drafts, as Llama draws them) are the real ones; a check first shows the replay giving the
engine's own lossless runs token for token. Backbone runs sample the same backbone rows with a
fresh chain per seed, as backbone mode does."""
import contextlib
import itertools
import math
import threading

import numpy as np
import pytest

from river_gguf import Model
from river_gguf.llama_sampling import SamplerChain, SamplingError
from river_gguf.session import STOP, Session

from lossless_models import small_vocab_model
from support import THREADS

N_VOCAB = 8
N_NEXT = 3
DRAFT_MAX = 2
SEEDS = 20_000
ALPHA = 1e-3
PROMPT = [3, 6, 4, 7, 5]
SAMPLERS = {
    "plain": dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "every-stage": dict(temp=0.7, top_k=5, top_p=0.9, min_p=0.05, repeat_penalty=1.3),
}


@pytest.fixture(scope="module")
def model(built):
    shape = dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, dtype="f16")
    backbone = small_vocab_model(built, N_VOCAB, seed=31, **shape)
    river = small_vocab_model(built, N_VOCAB, seed=32, **shape)
    return Model(backbone, river=river, n_ctx=32, n_threads=THREADS)


def _chain(seed, sampler) -> SamplerChain:
    return SamplerChain(N_VOCAB, seed=seed, **sampler)


def _picker(chain):
    """What Llama drafts with: a clone of the run's chain in its current state draws each draft."""
    @contextlib.contextmanager
    def pick():
        with chain.clone() as twin:
            def draw(logits, tokens):
                try:
                    return twin.sample(logits) if tokens is None else twin.sample_from(tokens, logits)
                except SamplingError:
                    return -1
            yield draw
    return pick


def _row_after(s, prefix) -> np.ndarray:
    """The row after PROMPT + prefix: session `s` decodes the prefix (choosing each of its tokens),
    and the last row it is given is the one after them."""
    last = []
    wanted = iter(tuple(prefix) + (STOP,))

    def choose(row, seen):
        last[:] = [np.array(row, copy=True)]
        return next(wanted)

    s.prefill(PROMPT)
    for _ in s.decode(choose):
        pass
    return last[0]


def _recorded_rows(m):
    """The rows a lossless run of N_NEXT tokens can meet: {prefix: backbone row after it} for
    prefixes of up to N_NEXT - 1 tokens (decode steps in the verify batch's kernels), and
    {(n_verified, prefix): river logits after it} for the drafts of a round that starts after
    n_verified verified tokens (the river writes the K/V of its round's tokens, the backbone's
    are below)."""
    backbone = {}
    with m.session(m.options(mode="backbone"), verify_kernels=True) as s:
        for n in range(N_NEXT):
            for prefix in itertools.product(range(N_VOCAB), repeat=n):
                backbone[prefix] = _row_after(s, prefix)
    river = {}
    opts = m.options(mode="lossless", draft_max=DRAFT_MAX, ngram_draft=False, adaptive_draft=False)
    with m.session(opts) as s:
        for verified in range(N_NEXT - 1):
            for prefix in itertools.product(range(N_VOCAB), repeat=verified + 1):
                for path in itertools.product(range(N_VOCAB), repeat=DRAFT_MAX - 1):
                    # From an empty cache, the prefix in one backbone prompt batch, as each run had it.
                    s.truncate(0)
                    s.extend(PROMPT + list(prefix[:-1]), options=m.options(mode="backbone"))
                    s.draft(prefix[-1], pick=_recorder(river, verified, prefix, path))
    return backbone, river


def _recorder(river: dict, verified: int, prefix: tuple, path: tuple):
    """A draft's pick that records the river's logits at each draft and drafts `path`."""
    drafted = []

    def pick(logits, tokens):
        river[verified, prefix + tuple(drafted)] = np.array(logits, copy=True)
        drafted.append(path[len(drafted)] if len(drafted) < len(path) else 0)
        return drafted[-1]
    return pick


class ReplayedEngine:
    """An engine that serves recorded rows (rows it was not given are zeros: never chosen from
    in a run of N_NEXT tokens, and a bug that chose from one would show in the distribution)."""

    def __init__(self, backbone: dict, river: dict, n_ctx: int):
        self.backbone, self.river, self.n_ctx = backbone, river, n_ctx
        self.tokens = []
        self._zeros = np.zeros(N_VOCAB, dtype=np.float32)

    @property
    def n_past(self):
        return len(self.tokens)

    cache_used = n_past  # one sequence: every used row is sequence 0's

    def sequence_length(self, seq):
        return len(self.tokens) if seq == 0 else 0

    def truncate(self, n, seq=0):
        assert seq == 0, "the replay holds sequence 0 only"
        del self.tokens[n:]

    def eval(self, tokens, all_logits=False, trace=False, first_row=0, **engine_args):
        rows = []
        for t in tokens:
            self.tokens.append(int(t))
            rows.append(self.backbone.get(tuple(self.tokens[len(PROMPT):]), self._zeros))
        return np.stack(rows if all_logits else rows[-1:]), 0, []

    def draft(self, token, n_max, pick=None, **args):
        verified = len(self.tokens) - len(PROMPT)
        prefix = tuple(self.tokens[len(PROMPT):]) + (int(token),)
        drafts = []
        for _ in range(n_max):
            logits = self.river.get((verified, prefix + tuple(drafts)), self._zeros)
            t = int(np.argmax(logits)) if pick is None else pick(logits, None)
            if t < 0:
                break
            drafts.append(t)
        return drafts, []


class _Shape:
    """What a Session asks of its model."""

    def __init__(self, m):
        self.n_layer, self.has_river, self.n_vocab, self.model_path = m.n_layer, m.has_river, m.n_vocab, m.model_path
        self.check_token, self.check_tokens = m.check_token, m.check_tokens


def _lossless(session, seeds, sampler):
    """The next N_NEXT tokens of a lossless run per seed (drafts drawn by a clone of the run's
    chain), from the prompt's kept row."""
    out = []
    for seed in seeds:
        session.truncate(len(PROMPT))
        with _chain(seed, sampler) as chain:
            steps = session.decode(lambda row, seen: chain.sample(row), pick=_picker(chain))
            out.append(tuple(st.token for st in itertools.islice(steps, N_NEXT)))
            steps.close()
    return out


def _sessions(m, recorded):
    """A lossless Session on the engine and one on the replayed engine, each holding the prompt."""
    opts = m.options(mode="lossless", draft_max=DRAFT_MAX, ngram_draft=False, adaptive_draft=False)
    real = m.session(opts, keep_rows=True)
    replay = Session(_Shape(m), ReplayedEngine(*recorded, m.n_ctx), threading.RLock(), opts, keep_rows=True,
                     own_cache=True)
    for s in (real, replay):
        s.prefill(PROMPT, all_logits=True)
    return real, replay


def _backbone(rows, seeds, sampler):
    out = []
    for seed in seeds:
        with _chain(seed, sampler) as chain:
            drawn = ()
            for _ in range(N_NEXT):
                drawn += (chain.sample(rows[drawn]),)
            out.append(drawn)
    return out


def _g_test(a, b) -> tuple:
    """Two samples' G-test of homogeneity over their outcomes: (G, degrees of freedom, p). Cells
    whose expected count is below 5 in either sample are pooled into one. p from the
    Wilson-Hilferty approximation of the chi-square tail (accurate at these degrees of freedom)."""
    cells = sorted(set(a) | set(b))
    counts = np.array([[a.count(c) for c in cells], [b.count(c) for c in cells]], dtype=np.float64)
    n = counts.sum(1, keepdims=True)
    expected = n * counts.sum(0) / n.sum()
    small = (expected < 5).any(0)
    if small.any():
        counts = np.concatenate([counts[:, ~small], counts[:, small].sum(1, keepdims=True)], 1)
        expected = n * counts.sum(0) / n.sum()
    seen = counts > 0
    g = 2.0 * float((counts[seen] * np.log(counts[seen] / expected[seen])).sum())
    df = counts.shape[1] - 1
    z = ((g / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return g, df, 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="module")
def recorded(model):
    return _recorded_rows(model)


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_lossless_samples_the_backbones_distribution(model, recorded, sampler):
    real, replay = _sessions(model, recorded)
    with real:
        # The replay is the engine's lossless mode: the same runs, token for token.
        assert _lossless(replay, range(300), SAMPLERS[sampler]) == _lossless(real, range(300), SAMPLERS[sampler])
    got = _lossless(replay, range(SEEDS), SAMPLERS[sampler])
    c = replay.counters
    # Drafts were both kept and thrown away.
    assert 0 < c.accepted < c.drafted, (c.accepted, c.drafted)
    # Other seeds: the two samples are independent (at the same seeds they are the same runs).
    rows = recorded[0]
    want = _backbone(rows, range(SEEDS, 2 * SEEDS), SAMPLERS[sampler])
    g, df, p = _g_test(got, want)
    assert p > ALPHA, f"G = {g:.1f} on {df} degrees of freedom, p = {p:.2g}"
    # The test can fail: the backbone at a temperature 10% higher (its logits times 0.9) is told
    # apart from the backbone.
    warmer = _backbone({k: v * 0.9 for k, v in rows.items()}, range(SEEDS), SAMPLERS[sampler])
    assert _g_test(warmer, want)[2] < ALPHA
