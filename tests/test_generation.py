"""Generation behaviour: stop strings, EOS, max_tokens, streaming, seeded sampling, chat, OpenAI shapes.

river_gguf.Model's own generation has no oracle but llama.cpp's greedy tokens, so these tests
assert that agreement or invariants (finish_reason "length" exactly when max_tokens tokens came
and no EOS; "stop" exactly at EOS or a stop string; text is the tokens' text), never what
SmolLM2 happens to say: float rounding differs between CPUs, and so does its output. A stop
string is taken from the model's own output, so it is there on any CPU."""
import pytest

from river_gguf import Model
from river_gguf.testing import LlamaCppOracle

from conftest import oracle_pick


@pytest.fixture(scope="module")
def m(q4_1_path):
    return Model(q4_1_path, n_ctx=512, n_threads=2)


@pytest.fixture(scope="module")
def oracle(q4_1_path):
    """llama.cpp's greedy tokens, ending at any end-of-generation token as the engine does."""
    o = LlamaCppOracle(q4_1_path, stop_at_any_eog=True)
    yield o
    o.close()


PROMPT = "List three colors:\n1."
# Inputs to choose from where a test needs the oracle's greedy reply to have a property.
CANDIDATES = [PROMPT, "Once upon a time", "The river rose in the hills above the town.", "1, 2, 3, 4, 5,"]


def _toks(m, text):
    """The prompt's tokens as generate() makes them (special markers parsed)."""
    return m.tokenize(text, add_special=True, parse_special=True)


def _next_is_eog(m, prompt_tokens, tokens):
    """The greedy token after prompt + tokens is an end-of-generation token."""
    return m.is_eog(int(m.logits(list(prompt_tokens) + list(tokens))[-1].argmax()))


def test_max_tokens(m, oracle):
    # A prompt whose greedy reply (llama.cpp's) does not reach EOS within 7 tokens.
    text, ref = oracle_pick(CANDIDATES, lambda p: oracle.greedy(_toks(m, p), 7), lambda t: len(t) == 7,
                            "a greedy reply of 7 tokens without EOS")
    g = m.generate(text, max_tokens=7)
    assert g.tokens == ref and g.finish_reason == "length"
    assert g.text == m.detokenize(g.tokens)
    assert g.stats["prefill_tokens"] == len(_toks(m, text))
    assert g.stats["decode_tokens"] == 6 and g.stats["decode_tok_s"] > 0


def test_finish_reason_and_length_invariants(m, oracle):
    """Whatever the model says: "length" exactly when max_tokens tokens came, "stop" exactly
    when the next greedy token is EOS; the tokens are llama.cpp's greedy tokens."""
    for text in CANDIDATES:
        prompt = _toks(m, text)
        for n in (1, 5, 24):
            g = m.generate(prompt, max_tokens=n)
            assert g.tokens == oracle.greedy(prompt, n), (text, n)
            assert len(g.tokens) <= n and all(not m.is_eog(t) for t in g.tokens)
            if g.finish_reason == "length":
                assert len(g.tokens) == n
            else:
                assert g.finish_reason == "stop" and len(g.tokens) < n and _next_is_eog(m, prompt, g.tokens)
            assert g.text == m.detokenize(g.tokens)


def test_stop_string_truncates_text(m):
    full = m.generate(PROMPT, max_tokens=40)
    # The stop string comes from the model's own output: "\n" where it wrote one, else a word
    # from its middle. It occurs, so the stopped text ends just before its first occurrence.
    words = full.text.split()
    assert "\n" in full.text or len(words) >= 2, f"40 tokens gave no line break and under two words: {full.text!r}"
    stop = "\n" if "\n" in full.text else words[len(words) // 2]
    stop_at = full.text.index(stop)
    g = m.generate(PROMPT, max_tokens=40, stop=[stop])
    assert g.finish_reason == "stop"
    assert g.text == full.text[:stop_at]
    assert g.tokens == full.tokens[:len(g.tokens)]  # a stop string changes no token before it


def test_eos_ends_generation(m, oracle):
    # llama.cpp's greedy reply ends at EOS (for the first candidate where it does, within 200).
    prompts = [m.chat_prompt([{"role": "user", "content": c}])
               for c in ("Say hello.", "Say hi.", "What is 2+2?", "Name a color.")]
    prompt, ref = oracle_pick(prompts, lambda p: oracle.greedy(_toks(m, p), 200), lambda t: len(t) < 200,
                              "a chat reply that ends at EOS within 200 tokens")
    g = m.generate(prompt, max_tokens=200)
    assert g.tokens == ref
    assert g.finish_reason == "stop"
    assert len(g.tokens) < 200
    assert all(not m.is_eog(t) for t in g.tokens)
    assert _next_is_eog(m, _toks(m, prompt), g.tokens)


def test_stream_pieces_join_to_full_text(m):
    full = m.generate(PROMPT, max_tokens=48, temperature=0.7, seed=3)
    assert len(full.tokens) > 1, f"the sampled reply has {len(full.tokens)} tokens: nothing to stream in pieces"
    # Stop strings from the sampled text itself (a word from its middle, and its last two
    # characters), so each one occurs; and a stop string that never does.
    words = full.text.split()
    stops = [None, ["\x00never\x00"]] + ([[full.text[-2:]]] if len(full.text) >= 2 else []) + \
        ([[words[len(words) // 2]]] if words else [])
    for stop in stops:
        g = m.generate(PROMPT, max_tokens=48, temperature=0.7, seed=3, stop=stop)
        s = m.stream(PROMPT, max_tokens=48, temperature=0.7, seed=3, stop=stop)
        pieces = list(s)
        assert "".join(pieces) == g.text == s.generation.text
        assert s.generation.tokens == g.tokens and s.generation.finish_reason == g.finish_reason
        if stop is None or stop == ["\x00never\x00"]:
            assert g.tokens == full.tokens and g.text == full.text and g.finish_reason == full.finish_reason
            assert len(pieces) > 1  # one piece per token (or per finished character)
        else:
            assert g.finish_reason == "stop" and g.text == full.text[:full.text.index(stop[0])]


def test_seeded_sampling_reproduces(m):
    a = m.generate(PROMPT, max_tokens=32, temperature=1.0, seed=42)
    b = m.generate(PROMPT, max_tokens=32, temperature=1.0, seed=42)
    assert a.tokens == b.tokens
    others = {tuple(m.generate(PROMPT, max_tokens=32, temperature=1.0, seed=s).tokens) for s in range(1, 5)}
    assert len(others | {tuple(a.tokens)}) > 1


def test_detokenize_round_trip(m):
    text = "Rivers flow: 12 bridges, naïve café ☕."
    assert m.detokenize(m.tokenize(text, add_special=False)) == text


def test_create_completion_shapes(m, oracle):
    r = m.create_completion(PROMPT, max_tokens=8, temperature=0.0)
    assert r["object"] == "text_completion"
    # llama.cpp's greedy tokens; "length" exactly when all 8 came (else EOS ended it).
    ref = oracle.greedy(_toks(m, PROMPT), 8)
    assert r["choices"][0]["text"] == m.detokenize(ref)
    assert r["usage"]["completion_tokens"] == len(ref)
    assert r["choices"][0]["finish_reason"] == ("length" if len(ref) == 8 else "stop")
    chunks = list(m.create_completion(PROMPT, max_tokens=8, temperature=0.0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == r["choices"][0]["finish_reason"]


def test_create_chat_completion_shapes(m):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    r = m.create_chat_completion(msgs, max_tokens=16, temperature=0.0)
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["role"] == "assistant"
    chunks = list(m.create_chat_completion(msgs, max_tokens=16, temperature=0.0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == r["choices"][0]["message"]["content"]
