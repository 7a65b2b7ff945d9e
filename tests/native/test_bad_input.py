"""Bad input gets a clear Python exception, and the process survives it."""
import pytest

import river_gguf
from river_gguf import Model
from river_gguf.eval.random_model import write_tiny_model
from river_gguf.greedy import greedy

from support import THREADS, Oracle, oracle_pick, truncate_copy, write_unsupported_arch

def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Model(str(tmp_path / "nope.gguf"))


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is plain text, not a model\n" * 10)
    with pytest.raises(river_gguf.GGUFFormatError, match="not a GGUF"):
        Model(str(p))


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(river_gguf.GGUFFormatError):
        Model(str(p))


@pytest.mark.parametrize("fraction", [0.5, 0.999, 0.0001])
def test_truncated_gguf(q4_1_path, tmp_path, fraction):
    p = truncate_copy(q4_1_path, tmp_path / "cut.gguf", keep_fraction=fraction)
    with pytest.raises(river_gguf.GGUFFormatError, match="truncated|corrupt"):
        Model(str(p))


def test_unsupported_architecture(tmp_path):
    p = write_unsupported_arch(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(river_gguf.UnsupportedModelError, match="mamba.*supported: llama, qwen2, qwen3"):
        Model(str(p))


@pytest.fixture(scope="module")
def small_model(q4_1_path):
    return Model(q4_1_path, n_ctx=64, n_threads=THREADS)


def test_prompt_longer_than_context(small_model):
    before = greedy(small_model, "Hi", max_tokens=2)
    with pytest.raises(river_gguf.ContextOverflowError, match="n_ctx=64"):
        greedy(small_model, "word " * 200, max_tokens=4)
    with pytest.raises(river_gguf.ContextOverflowError, match="n_ctx is 64"):
        small_model.logits(list(range(100, 200)))
    # Still usable afterwards: the same answer as before the errors.
    after = greedy(small_model, "Hi", max_tokens=2)
    assert (after.tokens, after.text, after.finish_reason) == (before.tokens, before.text, before.finish_reason)
    assert (len(after.tokens) == 2) == (after.finish_reason == "length")


def test_generation_stops_at_context_end(small_model, q4_1_path):
    n_ctx = small_model.n_ctx
    texts = ("word " * 50, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,", "The river rose in the hills. " * 6)
    # A prompt whose greedy reply (llama.cpp's) does not reach EOS before the context is full.
    oracle = Oracle(q4_1_path, stop_at_any_eog=True)  # ends at any EOG, as the engine
    try:
        toks, (_, ref) = oracle_pick(
            [small_model.tokenize(t) for t in texts],
            lambda t: (n_ctx - len(t), oracle.greedy(t, n_ctx - len(t))), lambda r: len(r[1]) == r[0],
            f"a greedy reply that fills an n_ctx={n_ctx} context without EOS")
    finally:
        oracle.close()
    g = greedy(small_model, toks, max_tokens=100)
    assert g.finish_reason == "length"
    assert g.tokens == ref
    assert len(toks) + len(g.tokens) == n_ctx


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": -5},
        {"max_tokens": 2.0},
        {"max_tokens": True},
        {"mode": "sideways"},
        {"stop": [3]},
        {"stop": "x"},
        {"temperature": 0.5},  # greedy takes exit options only; sampling is Llama's
    ],
)
def test_invalid_greedy_arguments(small_model, kwargs):
    with pytest.raises(ValueError):
        greedy(small_model, "Hello", **{"max_tokens": 4, **kwargs})


def test_invalid_tokens_and_modes(small_model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        small_model.logits([1, 2, 10**7])
    with pytest.raises(ValueError, match="needs a river"):
        greedy(small_model, "Hi", max_tokens=2, mode="river")
    with pytest.raises(ValueError, match="exit_layer"):
        greedy(small_model, "Hi", max_tokens=2, exit_layer=99)
    with pytest.raises(ValueError, match="empty"):
        greedy(small_model, [], max_tokens=2)


@pytest.mark.parametrize("kwargs", [{"n_ctx": 0}, {"n_threads": 0}, {"n_batch": -1}, {"n_ctx": "big"}])
def test_invalid_load_arguments(q4_1_path, kwargs):
    with pytest.raises(ValueError):
        Model(q4_1_path, **kwargs)


def test_mismatched_river_files_are_refused(tmp_path):
    bb = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=2, seed=1)
    qwen = write_tiny_model(tmp_path / "qwen.gguf", "qwen2", n_layer=2, seed=1)
    narrow = write_tiny_model(tmp_path / "narrow.gguf", "llama", n_layer=2, n_ff=96, seed=1)
    deeper = write_tiny_model(tmp_path / "deeper.gguf", "llama", n_layer=3, seed=1)
    with pytest.raises(river_gguf.RiverMismatchError, match="architecture 'qwen2'.*'llama'"):
        Model(bb, river=qwen)
    with pytest.raises(river_gguf.RiverMismatchError, match="feed_forward_length is 96 in the river but 128"):
        Model(bb, river=narrow)
    with pytest.raises(river_gguf.RiverMismatchError, match="block_count is 3 in the river but 2"):
        Model(bb, river=deeper)
    with pytest.raises(FileNotFoundError):
        Model(bb, river=str(tmp_path / "missing.gguf"))
    assert Model(bb, river=bb, threshold=0.9).has_river  # the same model is accepted


def test_river_gguf_with_a_second_river_is_refused(tmp_path):
    from river_gguf.convert.build import build_river_gguf

    bb = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=2, seed=1)
    rv = tmp_path / "m.river.gguf"
    build_river_gguf(bb, rv, river_type="q8_0", threshold=0.9, progress=False, imatrix=None, presets=False)
    with pytest.raises(river_gguf.RiverMismatchError, match="already holds a river"):
        Model(str(rv), river=bb)
