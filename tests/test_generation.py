"""Generation behaviour: stop strings, EOS, max_tokens, streaming, seeded sampling, chat, OpenAI shapes."""
import pytest

from river_gguf import Model


@pytest.fixture(scope="module")
def m(q4_1_path):
    return Model(q4_1_path, n_ctx=512, n_threads=2)


PROMPT = "List three colors:\n1."


def test_max_tokens(m):
    g = m.generate(PROMPT, max_tokens=7)
    assert len(g.tokens) == 7 and g.finish_reason == "length"
    assert g.stats["prefill_tokens"] == len(m.tokenize(PROMPT))
    assert g.stats["decode_tokens"] == 6 and g.stats["decode_tok_s"] > 0


def test_stop_string_truncates_text(m):
    full = m.generate(PROMPT, max_tokens=40)
    assert "\n" in full.text
    stop_at = full.text.index("\n")
    g = m.generate(PROMPT, max_tokens=40, stop=["\n"])
    assert g.finish_reason == "stop"
    assert g.text == full.text[:stop_at]


def test_eos_ends_generation(m):
    msgs = [{"role": "user", "content": "Say hello."}]
    g = m.generate(m.chat_prompt(msgs), max_tokens=200)
    assert g.finish_reason == "stop"
    assert len(g.tokens) < 200
    assert all(not m.is_eog(t) for t in g.tokens)


def test_stream_pieces_join_to_full_text(m):
    for stop in (None, ["blue"], [". "]):
        g = m.generate(PROMPT, max_tokens=48, temperature=0.7, seed=3, stop=stop)
        s = m.stream(PROMPT, max_tokens=48, temperature=0.7, seed=3, stop=stop)
        pieces = list(s)
        assert len(pieces) > 1
        assert "".join(pieces) == g.text == s.generation.text
        assert s.generation.tokens == g.tokens


def test_seeded_sampling_reproduces(m):
    a = m.generate(PROMPT, max_tokens=32, temperature=1.0, seed=42)
    b = m.generate(PROMPT, max_tokens=32, temperature=1.0, seed=42)
    assert a.tokens == b.tokens
    others = {tuple(m.generate(PROMPT, max_tokens=32, temperature=1.0, seed=s).tokens) for s in range(1, 5)}
    assert len(others | {tuple(a.tokens)}) > 1


def test_detokenize_round_trip(m):
    text = "Rivers flow: 12 bridges, naïve café ☕."
    assert m.detokenize(m.tokenize(text, add_special=False)) == text


def test_create_completion_shapes(m):
    r = m.create_completion(PROMPT, max_tokens=8, temperature=0.0)
    assert r["object"] == "text_completion"
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    assert r["usage"]["completion_tokens"] == 8
    chunks = list(m.create_completion(PROMPT, max_tokens=8, temperature=0.0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_create_chat_completion_shapes(m):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    r = m.create_chat_completion(msgs, max_tokens=16, temperature=0.0)
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["role"] == "assistant"
    chunks = list(m.create_chat_completion(msgs, max_tokens=16, temperature=0.0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == r["choices"][0]["message"]["content"]
