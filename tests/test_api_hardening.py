"""Misuse of the Python API (issue 8): other calls on a Llama's Model mid-stream, NaN logits, the
tau profile's own context, and strict argument checks. Each finding gets a clear exception."""
import gguf
import numpy as np
import pytest

import river_gguf
from river_gguf import Llama, Model, NumericalError
from river_gguf.greedy import greedy
from river_gguf.gguf.reader import GGUFReader
from river_gguf.measure.teacher import score
from river_gguf.measure.traces import similarity_trace

PROMPT_A = [1, 310, 2048, 77, 901]
PROMPT_B = [1, 52, 4000, 13, 615, 9]


@pytest.fixture(scope="module")
def tiny_path(tiny):
    return tiny.model("llama", n_layer=4, seed=3)


@pytest.fixture(scope="module")
def plain(tiny_path):
    return Model(tiny_path, n_ctx=128, n_threads=1)


@pytest.fixture(scope="module")
def pair(tiny_path):
    """The tiny model as its own river (threshold given: no profile)."""
    return Model(tiny_path, river=tiny_path, n_ctx=128, n_threads=1, threshold=0.5)


# ----- a Llama and other calls on its Model ---------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_path):
    llm = Llama(tiny_path, n_ctx=128, n_threads=1, verbose=False)
    yield llm
    llm.close()


@pytest.mark.parametrize("other", ["logits", "score", "similarity_trace", "session", "greedy", "truncate"])
def test_a_stream_survives_other_calls_on_its_model(llm, other):
    """Another call on the Llama's Model (river_model) between two chunks takes the KV cache; the
    stream's session finds itself displaced, evaluates its tokens again, and its text is the text
    it gives alone."""
    m = llm.river_model
    alone = llm.create_completion(PROMPT_A, max_tokens=8, temperature=0.0)["choices"][0]["text"]
    chunks = llm.create_completion(PROMPT_A, max_tokens=8, temperature=0.0, stream=True)
    text = next(chunks)["choices"][0]["text"]
    assert m.holds_cache(llm.session)
    calls = {
        "logits": lambda: m.logits(PROMPT_B),
        "score": lambda: score(m, PROMPT_B, prefix=2),
        "similarity_trace": lambda: similarity_trace(m, PROMPT_B),
        "session": lambda: m.session().extend(PROMPT_B),
        "greedy": lambda: greedy(m, PROMPT_B, 2),
        "truncate": lambda: m.session().truncate(0),
    }
    calls[other]()
    assert not m.holds_cache(llm.session)  # the cache no longer holds the stream's tokens
    text += "".join(c["choices"][0]["text"] for c in chunks)
    assert text == alone


def test_numerical_error_is_a_runtime_error():
    assert issubclass(NumericalError, RuntimeError)
    assert "NumericalError" in river_gguf.__all__


# ----- NaN / inf logits -----------------------------------------------------------------
POISON = 4242  # a token whose embedding row we overwrite


def _poisoned_copy(src, dst, value):
    """Copy a tiny F32 model and set token POISON's embedding row to `value` everywhere."""
    dst.write_bytes(open(src, "rb").read())
    t = next(t for t in GGUFReader(str(dst)).tensors if t.name == "token_embd.weight")
    n_embd = int(t.shape[0])
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    with open(dst, "r+b") as f:
        f.seek(int(t.data_offset) + POISON * n_embd * 4)
        f.write(np.full(n_embd, value, dtype=np.float32).tobytes())
    return str(dst)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_logits_raise(tiny_path, tmp_path, value):
    m = Model(_poisoned_copy(tiny_path, tmp_path / "poison.gguf", value), n_ctx=64, n_threads=1)
    clean = greedy(m, PROMPT_A, 6)
    assert clean.tokens and np.isfinite(m.logits(PROMPT_A)).all()
    bad = PROMPT_A[:2] + [POISON] + PROMPT_A[2:]
    with pytest.raises(NumericalError, match="NaN or infinite logits"):
        greedy(m, bad, 6)  # was: '' with finish_reason='stop'
    with pytest.raises(NumericalError):
        m.logits(bad)
    with pytest.raises(NumericalError):
        score(m, bad, prefix=1)  # the poisoned token is fed on the decode path; was: NaN scores
    with pytest.raises(NumericalError):
        m.session().extend(bad)
    with pytest.raises(NumericalError):
        similarity_trace(m, bad)
    with Llama(m.model_path, n_ctx=64, n_threads=1, verbose=False) as llm:
        with pytest.raises(NumericalError):
            llm.create_completion(bad, max_tokens=4)
    # The Model stays usable and gives the same answers as before.
    assert greedy(m, PROMPT_A, 6).tokens == clean.tokens


# ----- the tau profile has its own context ------------------------------------------------
def test_profile_runs_in_its_own_context(tiny_path):
    # Two plain files, no stored tau: the constructor profiles 256 tokens of built-in text.
    ref = Model(tiny_path, river=tiny_path, n_ctx=1024, n_threads=1)
    for n_ctx in (240, 16):  # 240 raised ContextOverflowError before
        m = Model(tiny_path, river=tiny_path, n_ctx=n_ctx, n_threads=1)
        assert m.n_ctx == n_ctx
        assert m.exit_options.threshold == ref.exit_options.threshold
        assert greedy(m, PROMPT_A, max_tokens=4).tokens == greedy(ref, PROMPT_A, max_tokens=4).tokens


def test_profile_leaves_the_models_cache_alone(tiny_path):
    from river_gguf.measure.profile import similarity_profile

    m = Model(tiny_path, river=tiny_path, n_ctx=32, n_threads=1, threshold=0.5)
    alone = greedy(m, PROMPT_A, 6)
    s = m.session()
    s.extend(PROMPT_A)
    n_past = m.n_past
    sims = similarity_profile(m)
    assert sims.shape[0] > m.n_ctx and sims.shape[1] == m.n_layer  # longer than this Model's context
    assert m.n_past == n_past and m.holds_cache(s)  # the cache is still the caller's
    row = s.extend([alone.tokens[0]], decode=True)
    assert int(row.argmax()) == alone.tokens[1]


# ----- argument types and ranges ------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"n_ctx": 2**31}, r"n_ctx must be an int in \[1, 1048576\]"),  # was TypeError from pybind
        ({"n_ctx": True}, "n_ctx"),
        ({"n_ctx": 64.0}, "n_ctx"),
        ({"n_threads": 10**6}, "n_threads must be an int in"),  # was MemoryError after loading
        ({"n_threads": True}, "n_threads"),
        ({"n_threads": 1.0}, "n_threads"),
        ({"n_batch": 2**40}, "n_batch"),
        ({"n_gpu_layers": 0.5}, "n_gpu_layers"),
        ({"n_gpu_layers": False}, "n_gpu_layers"),
        ({"verbose": "yes"}, "verbose"),
        ({"river": 3.5}, "river must be a path"),
        # River options on a model without a river were ignored.
        ({"threshold": 0.9}, "threshold=0.9 is a river option, but .* has no river"),
        ({"river_head": False}, "river_head=False is a river option"),
        ({"tail": 0}, "tail=0 is a river option"),
        ({"min_exit_layer": 1}, "min_exit_layer=1 is a river option"),
        ({"prefill": "river"}, "prefill='river' is a river option"),
        ({"preset": "fast"}, "preset"),
    ],
)
def test_bad_load_arguments_plain(tiny_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Model(tiny_path, **{"n_ctx": 64, "n_threads": 1, **kwargs})


def test_bad_model_path_type():
    with pytest.raises(ValueError, match="model_path must be a path"):
        Model(12345)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"threshold": True}, "threshold must be a finite number"),
        ({"threshold": float("inf")}, "threshold must be a finite number"),
        ({"threshold": "0.9"}, "threshold"),
        ({"river_head": "no"}, "river_head must be a bool"),  # was: True
        ({"river_head": 1}, "river_head must be a bool"),
        ({"min_exit_layer": True}, "min_exit_layer"),
        ({"tail": 1.0}, "tail"),
        ({"mode": ["river"]}, "mode must be one of"),
        ({"prefill": None, "preset": 3}, "preset must be a str"),
    ],
)
def test_bad_load_arguments_pair(tiny_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Model(tiny_path, river=tiny_path, n_ctx=64, n_threads=1, **kwargs)


def test_threads_and_batch_are_bounded_not_refused(tiny_path):
    m = Model(tiny_path, n_ctx=32, n_threads=np.int64(1), n_batch=4096)  # numpy ints are ints
    assert m.logits(PROMPT_A).shape == (len(PROMPT_A), m.n_vocab)


ENTRY_POINTS = {
    "options": lambda m, **kw: m.options(**kw),
    "greedy": lambda m, **kw: greedy(m, PROMPT_A, 2, **kw),
    "logits": lambda m, **kw: m.logits(PROMPT_A, **kw),
    "score": lambda m, **kw: score(m, PROMPT_A, prefix=2, **kw),
    "similarity_trace": lambda m, **kw: similarity_trace(m, PROMPT_A, **kw),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"exit_layer": True}, "exit_layer must be an int"),  # was: exit after layer 1
        ({"exit_layer": 1.0}, "exit_layer must be an int"),
        ({"threshold": False}, "threshold must be a finite number"),
        ({"river_head": "no"}, "river_head must be a bool"),
        ({"tail": True}, "tail must be an int"),
        ({"min_exit_layer": 0.0}, "min_exit_layer"),
        ({"mode": 1}, "mode must be one of"),
        ({"preset": 1}, "preset must be a str"),
        ({"echo": True}, "unknown option 'echo'"),
    ],
)
def test_bad_call_options(pair, entry, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ENTRY_POINTS[entry](pair, **kwargs)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("kwargs", [{"threshold": 0.9}, {"river_head": True}, {"tail": 0}, {"prefill": "river"},
                                    {"min_exit_layer": 0}, {"preset": "fast"}])
def test_river_options_on_a_plain_model(plain, entry, kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"{name}={value!r} is a river option"):
        ENTRY_POINTS[entry](plain, **kwargs)
    # Options that ask for nothing river-specific still work.
    assert ENTRY_POINTS[entry](plain, mode="backbone") is not None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.session().extend([1, 1.7]), "token ids must be ints"),  # was: used as 1
        (lambda m: m.session().extend([1, True]), "token ids must be ints"),
        (lambda m: m.session().extend([1, m.n_vocab]), "outside the vocabulary"),
        (lambda m: m.session().extend([]), "no tokens"),
        (lambda m: m.session().prefill([1, -1]), "outside the vocabulary"),
        (lambda m: m.session().extend([1, 2], decode=True), "a decode step takes one token"),
        (lambda m: m.session({"mode": "backbone"}), "options must be ExitOptions"),
        (lambda m: m.session().extend([1] * 200), "n_ctx"),
        (lambda m: m.session().draft(m.n_vocab), "outside the vocabulary"),
        (lambda m: m.session().truncate(10**6), "n must be an int"),
        (lambda m: m.session().truncate(True), "n must be an int"),
        (lambda m: m.logits([1.0, 2.0]), "token ids must be ints"),
        (lambda m: m.logits(np.array([1.5, 2.0])), "1-D array of ints"),
        (lambda m: m.logits(np.array([[1, 2]])), "1-D array of ints"),
        (lambda m: m.logits({1, 2}), "tokens must be a list"),
        (lambda m: m.logits(7), "tokens must be a list"),
        (lambda m: score(m, [1, 2, 3], prefix=True), "prefix must be an int"),
        (lambda m: score(m, [1, 2, 3], prefix=1.0), "prefix must be an int"),
        (lambda m: score(m, [1, 2.5, 3]), "token ids must be ints"),
        (lambda m: similarity_trace(m, []), "no tokens"),
        (lambda m: m.detokenize([1.7]), "token ids must be ints"),
        (lambda m: m.detokenize("abc"), "tokens must be a list"),
        (lambda m: m.detokenize([1], special="yes"), "special must be a bool"),
        (lambda m: m.token_to_piece(1.7), "token id must be an int"),
        (lambda m: m.token_to_piece(True), "token id must be an int"),
        (lambda m: m.token_to_piece(10**9), "outside the vocabulary"),
        (lambda m: m.is_eog(2.0), "token id must be an int"),
        (lambda m: m.tokenize(5), "text must be str or bytes"),
        (lambda m: m.tokenize("a", add_special="yes"), "add_special must be a bool"),
        (lambda m: m.tokenize("a", parse_special=None), "parse_special must be a bool"),
    ],
)
def test_bad_call_arguments(plain, call, match):
    with pytest.raises(ValueError, match=match):
        call(plain)


def test_integer_like_arguments_still_accepted(plain):
    a = plain.logits(PROMPT_A)
    assert np.array_equal(plain.logits(np.array(PROMPT_A, dtype=np.int32)), a)
    assert np.array_equal(plain.logits([np.int64(t) for t in PROMPT_A]), a)
    assert np.array_equal(plain.logits(tuple(PROMPT_A)), a)
    assert greedy(plain, PROMPT_A, np.int64(3)).tokens
    assert plain.token_to_piece(np.int32(PROMPT_A[1])) == plain.token_to_piece(PROMPT_A[1])
    assert plain.tokenize(b"hello", add_special=np.bool_(False)) == plain.tokenize("hello", add_special=False)
