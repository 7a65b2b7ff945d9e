"""Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, untied head, 896 wide): the engine against stock
llama.cpp on the shipped Q4_K_M file and on its F16, and River early exit on it.

Tolerance as in tests/native/test_engine_parity.py: both sides run the same ggml kernels on the same graph
(F16 KV cache, flash attention), so logits agree to the bit in practice; LOGIT_TOL only leaves room
for reduction order, far below the logit gaps that decide tokens.

Greedy comparisons run on a prompt whose oracle reply does not end early (the first candidate
that does not, on this CPU), and River runs use exit settings fixed here, not the file's default
preset (chosen at conversion)."""
import gguf
import numpy as np
import pytest

from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.convert.build import sha256_file

from river_gguf.eval import model_zoo

from conftest import QWEN, oracle_pick

LOGIT_TOL = 2e-3
N_GREEDY = 32

# About 40 tokens of code: the model's own domain, with indentation and punctuation tokens.
CODE = (
    "def merge_sorted(a, b):\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    out = []\n"
    "    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n"
)
GREEDY_PROMPT = "# Return the n-th Fibonacci number, iteratively.\ndef fibonacci(n):\n"
RIVER_PROMPT = "def is_prime(n: int) -> bool:\n"
PROMPTS = [GREEDY_PROMPT, RIVER_PROMPT, CODE, "class Stack:\n    def __init__(self):\n"]


def _long_greedy(m, oracle, prompts=PROMPTS, n=N_GREEDY):
    """(prompt tokens, oracle's greedy tokens) for the first prompt (text or tokens) whose greedy
    reply runs n tokens on llama.cpp without ending early."""
    def run(p):
        toks = p if isinstance(p, list) else m.tokenize(p)
        return toks, oracle.greedy(toks, n)

    _, (prompt, ref) = oracle_pick(prompts, run, lambda r: len(r[1]) == n,
                                   f"a greedy reply of {n} tokens that does not end early")
    return prompt, ref


def test_fetched_file_is_the_published_model(qwen_source):
    assert sha256_file(qwen_source) == model_zoo.MODELS[QWEN].split_source.sha256
    r = gguf.GGUFReader(qwen_source)
    assert r.fields["general.architecture"].contents() == "qwen2"
    assert r.fields["qwen2.block_count"].contents() == 24
    assert "output.weight" in {t.name for t in r.tensors}  # untied head: a second big matrix


@pytest.fixture(scope="module", params=["qwen_source", "qwen_f16"])
def model_path(request):
    return request.getfixturevalue(request.param)


def test_logits_match_llama_cpp(model_path, oracle_factory):
    m = Model(model_path, n_ctx=512, n_threads=2)
    toks = m.tokenize(CODE)
    assert 35 <= len(toks) <= 60
    ours = m.logits(toks)
    ref = oracle_factory(model_path).logits(toks)
    assert ours.shape == ref.shape == (len(toks), m.n_vocab)
    assert np.isfinite(ours).all()
    assert np.abs(ours - ref).max() < LOGIT_TOL
    assert (ours.argmax(1) == ref.argmax(1)).all()


def test_greedy_tokens_match_llama_cpp(model_path, oracle_factory):
    m = Model(model_path, n_ctx=512, n_threads=2)
    prompt, ref = _long_greedy(m, oracle_factory(model_path))  # the prompt must not end early on the oracle
    g = greedy(m, prompt, max_tokens=N_GREEDY)
    assert g.tokens == ref and g.finish_reason == "length"


def _profiled_tau(path):
    """The tau the converter profiled and stored (river.threshold): a quantile of the backbone's
    similarities, read here and passed explicitly."""
    return float(gguf.GGUFReader(path).fields["river.threshold"].contents())


@pytest.fixture(scope="module")
def river_model(qwen_river):
    # Every exit option given: no preset the conversion chose sets any of them.
    return Model(qwen_river, n_ctx=512, n_threads=2, mode="river", threshold=_profiled_tau(qwen_river),
                 min_exit_layer=0, river_head=True, prefill="backbone", tail=0)


def test_river_generation_exits_early(river_model):
    m = river_model
    assert m.n_layer == 24
    assert m.exit_options.tail == 0 and m.exit_options.exit_layer is None
    # The profiled tau of the file must let tokens leave the backbone before its last layer (on
    # the first prompt whose reply has any token to leave: replies differ between CPUs).
    prompt, g = oracle_pick([RIVER_PROMPT] + PROMPTS, lambda p: greedy(m, p, max_tokens=N_GREEDY),
                            lambda g: g.stats["mean_exit_layer"] < m.n_layer - 1,
                            "a reply with a token that exits before the last layer", oracle="the River engine")
    n = len(g.tokens)
    assert (n == N_GREEDY) == (g.finish_reason == "length")
    assert g.stats["decode_tokens"] == (n - 1 if g.finish_reason == "length" else n)
    assert len(g.stats["exit_layers"]) == n and g.text == m.detokenize(g.tokens)
    assert 0.0 < g.stats["river_layer_share"] <= 1.0


def test_river_only_equals_q4_0_in_llama_cpp(qwen_f16, qwen_q4_0, oracle_factory):
    # RIVER.md invariant 3, as tests/native/test_river.py checks it for SmolLM2: with the river head,
    # river-only runs exactly the river file (embeddings, layers, head), which llama.cpp can load.
    m = Model(qwen_f16, river=qwen_q4_0, n_ctx=512, n_threads=2, threshold=0.97)
    oracle = oracle_factory(qwen_q4_0)
    toks = m.tokenize(CODE)
    ours = m.logits(toks, mode="river-only", river_head=True)
    assert np.abs(ours - oracle.logits(toks)).max() < LOGIT_TOL
    prompt, ref = _long_greedy(m, oracle, [toks[:12]] + PROMPTS)
    g = greedy(m, prompt, max_tokens=N_GREEDY, mode="river-only", river_head=True)
    assert g.tokens == ref
