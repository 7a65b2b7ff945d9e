"""Lossless decoding's draft vocabulary (native/draft_vocab.h): a draft's head runs the rows of
the tokens the file ranks first, the end-of-generation tokens and the context's tokens, and the
text stays the backbone's."""
import numpy as np
import pytest

from river_gguf import Model
from river_gguf._loader import native
from river_gguf.convert.build import draft_token_ranking
from river_gguf.gguf.meta import set_river_metadata
from river_gguf.llama import Llama

from test_lossless import _assert_lossless

from support import PROSE, THREADS
from river_gguf.gguf.reader import GGUFReader

# Padded past 65536 tokens, so that the default restricts the draft (SmolLM2 has 49152).
BIG_VOCAB = 70000
CONTEXT_ROWS = 512  # kDraftContextRows


@pytest.fixture(scope="module")
def big_vocab_river(tiny):
    model = dict(seed=3, n_layer=2, n_vocab=BIG_VOCAB)
    return tiny.model("qwen2", **model), tiny.river("qwen2", model)


def _ranking(path):
    field = GGUFReader(path).fields.get(native.DRAFT_TOKENS_KEY)
    return None if field is None else [int(t) for t in field.contents()]


def test_the_converter_ranks_the_calibration_text(big_vocab_river):
    plain, river = big_vocab_river
    ranking = _ranking(river)
    assert ranking == draft_token_ranking(plain)
    counts = {}
    for t in ranking:
        counts[t] = counts.get(t, 0) + 1
    assert len(counts) == len(ranking) > 100  # each token once


def test_draft_vocabulary_rule(big_vocab_river, tmp_path):
    """The file's ranking first, then ascending ids, plus the end-of-generation tokens; the default
    for a vocabulary of 65536 or more is 32768 tokens; 0 is the whole vocabulary."""
    _, river = big_vocab_river
    copy = tmp_path / "ranked.gguf"
    copy.write_bytes(open(river, "rb").read())
    ranking = [60000, 5, 65000, 5, 69999, 7]  # a repeat, and ids past the first N
    set_river_metadata(str(copy), {native.DRAFT_TOKENS_KEY: ranking})
    m = Model(str(copy), n_ctx=64, n_threads=THREADS, draft_vocab=8)
    eog = [t for t in range(m.n_vocab) if m.is_eog(t)]
    assert eog, "the vocabulary has an end-of-generation token"
    want = {60000, 5, 65000, 69999, 7, 0, 1, 2}  # the ranking, then the lowest ids left
    assert m.draft_vocab == sorted(want | set(eog))  # the end-of-generation tokens are pinned
    assert len(Model(str(copy), n_ctx=64, n_threads=THREADS).draft_vocab) == 32768
    assert Model(str(copy), n_ctx=64, n_threads=THREADS, draft_vocab=0).draft_vocab == []
    assert Model(str(copy), n_ctx=64, n_threads=THREADS, draft_vocab=BIG_VOCAB).draft_vocab == []


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_bad_draft_vocab_is_refused(big_vocab_river, bad):
    with pytest.raises(ValueError, match="draft_vocab"):
        Model(big_vocab_river[1], n_ctx=64, n_threads=THREADS, draft_vocab=bad)


def test_context_tokens_join_the_draft_vocabulary(big_vocab_river):
    """Every evaluated token outside the vocabulary takes a context row; the oldest gives way."""
    m = Model(big_vocab_river[1], n_ctx=1024, n_threads=THREADS, draft_vocab=64)
    vocab = set(m.draft_vocab)
    rotating = CONTEXT_ROWS - (len(vocab) - 64)  # less the pinned end-of-generation tokens' rows
    outside = [t for t in range(1000, BIG_VOCAB) if t not in vocab][:rotating + 40]
    s = m.session(mode="backbone")
    s.extend(outside[:10] + outside[:3])
    assert m.draft_context == outside[:10]
    s.extend(outside[10:])
    assert m.draft_context == outside[-rotating:]
    assert set(m.draft_vocab) == vocab  # pinned tokens never give way


def _has_draft_vocab(model, size) -> bool:
    """`size` ranked tokens, plus the end-of-generation tokens outside them, pinned."""
    vocab = set(model.draft_vocab)
    eog = {t for t in range(model.n_vocab) if model.is_eog(t)}
    return eog <= vocab and size <= len(vocab) <= size + len(eog)


def _allowed_best(logits, allowed):
    allowed = np.array(sorted(allowed))
    return float(logits[allowed].max())


@pytest.mark.parametrize("size", [200, 4096])
def test_a_draft_is_the_rivers_best_token_of_its_vocabulary(river_gguf_path, size):
    """Each draft is the river's greedy token among the draft vocabulary and the context's tokens:
    its logit under the whole head is the highest of theirs (to rounding: the rows run in another
    mul_mat)."""
    restricted = Model(river_gguf_path, n_ctx=256, n_threads=THREADS, draft_vocab=size)
    full = Model(river_gguf_path, n_ctx=256, n_threads=THREADS, draft_vocab=0)
    opts = restricted.options(mode="lossless", draft_max=6)
    prompt = restricted.tokenize(PROSE)[:40]
    with restricted.session(opts) as s:  # lossless: the prompt runs the backbone
        s.extend(prompt[:-1])
        drafts, probs = s.draft(prompt[-1], with_probs=True)
    assert len(drafts) == 6 and len(probs) == 6
    allowed = set(restricted.draft_vocab) | set(restricted.draft_context)
    assert _has_draft_vocab(restricted, size) and prompt[-1] in allowed
    # The draft's steps, by hand: river-only, the river's head, one token at a time.
    step = full.options(mode="river-only", river_head=opts.river_head)
    by_hand = full.session(mode="backbone")
    by_hand.extend(prompt[:-1])
    cur = prompt[-1]
    for d in drafts:
        assert d in allowed
        logits = by_hand.extend([cur], decode=True, options=step)
        assert logits[d] >= _allowed_best(logits, allowed) - 1e-3
        cur = d


def test_greedy_lossless_with_a_draft_vocabulary_is_the_backbone(river_gguf_path):
    llm = Llama(river_gguf_path, n_ctx=256, n_threads=THREADS, flash_attn=True, verbose=False, draft_vocab=1024)
    assert _has_draft_vocab(llm.river_model, 1024)
    _assert_lossless(llm, PROSE, temp=0.0)


def test_greedy_lossless_default_vocabulary_is_the_backbone(big_vocab_river):
    llm = Llama(big_vocab_river[1], n_ctx=256, n_threads=THREADS, flash_attn=True, verbose=False)
    assert _has_draft_vocab(llm.river_model, 32768)
    _assert_lossless(llm, PROSE, temp=0.0)
