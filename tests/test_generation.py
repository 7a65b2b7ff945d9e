"""The greedy loop on Model.eval (river_gguf.greedy, what evaluation and task accuracy decode
with): stop strings, EOS, max_tokens. Sampling, streaming and the OpenAI shapes are
river_gguf.Llama's (tests/test_llama.py).

These tests assert agreement with llama.cpp's greedy tokens or invariants (finish_reason
"length" exactly when max_tokens tokens came and no EOS; "stop" exactly at EOS or a stop string;
text is the tokens' text), never what SmolLM2 happens to say: float rounding differs between
CPUs, and so does its output. A stop string is taken from the model's own output, so it is there
on any CPU."""
import pytest

from river_gguf import Model
from river_gguf.chat import format_chat
from river_gguf.greedy import greedy
from river_gguf.measure.teacher import score

from support import Oracle, THREADS, oracle_pick

@pytest.fixture(scope="module")
def m(q4_1_path):
    return Model(q4_1_path, n_ctx=512, n_threads=THREADS)


@pytest.fixture(scope="module")
def oracle(q4_1_path):
    """llama.cpp's greedy tokens, ending at any end-of-generation token as the engine does."""
    o = Oracle(q4_1_path, stop_at_any_eog=True)
    yield o
    o.close()


PROMPT = "List three colors:\n1."
# Inputs to choose from where a test needs the oracle's greedy reply to have a property.
CANDIDATES = [PROMPT, "Once upon a time", "The river rose in the hills above the town.", "1, 2, 3, 4, 5,"]


def _toks(m, text):
    """The prompt's tokens as greedy() makes them (special markers parsed)."""
    return m.tokenize(text, add_special=True, parse_special=True)


def _next_is_eog(m, prompt_tokens, tokens):
    """The greedy token after prompt + tokens is an end-of-generation token."""
    return m.is_eog(int(m.logits(list(prompt_tokens) + list(tokens))[-1].argmax()))


def test_max_tokens(m, oracle):
    # A prompt whose greedy reply (llama.cpp's) does not reach EOS within 7 tokens.
    text, ref = oracle_pick(CANDIDATES, lambda p: oracle.greedy(_toks(m, p), 7), lambda t: len(t) == 7,
                            "a greedy reply of 7 tokens without EOS")
    g = greedy(m, text, 7)
    assert g.tokens == ref and g.finish_reason == "length"
    assert g.text == m.detokenize(g.tokens)
    assert g.decode_steps == 6 and g.decode_tok_s > 0
    assert g.exit_layers == [m.n_layer - 1] * 7  # a plain file: every token from the whole backbone


def test_finish_reason_and_length_invariants(m, oracle):
    """Whatever the model says: "length" exactly when max_tokens tokens came, "stop" exactly
    when the next greedy token is EOS; the tokens are llama.cpp's greedy tokens."""
    for text in CANDIDATES:
        prompt = _toks(m, text)
        for n in (1, 5, 24):
            g = greedy(m, prompt, n)
            assert g.tokens == oracle.greedy(prompt, n), (text, n)
            assert len(g.tokens) <= n and all(not m.is_eog(t) for t in g.tokens)
            if g.finish_reason == "length":
                assert len(g.tokens) == n
            else:
                assert g.finish_reason == "stop" and len(g.tokens) < n and _next_is_eog(m, prompt, g.tokens)
            assert g.text == m.detokenize(g.tokens)


def test_stop_string_truncates_text(m):
    full = greedy(m, PROMPT, 40)
    # The stop string comes from the model's own output: "\n" where it wrote one, else a word
    # from its middle. It occurs, so the stopped text ends just before its first occurrence.
    words = full.text.split()
    assert "\n" in full.text or len(words) >= 2, f"40 tokens gave no line break and under two words: {full.text!r}"
    stop = "\n" if "\n" in full.text else words[len(words) // 2]
    stop_at = full.text.index(stop)
    g = greedy(m, PROMPT, 40, stop=[stop])
    assert g.finish_reason == "stop"
    assert g.text == full.text[:stop_at]
    assert g.tokens == full.tokens[:len(g.tokens)]  # a stop string changes no token before it


def test_eos_ends_generation(m, oracle):
    # llama.cpp's greedy reply ends at EOS (for the first candidate where it does, within 200).
    template = m.metadata["tokenizer.chat_template"]
    prompts = [format_chat(template, [{"role": "user", "content": c}])
               for c in ("Say hello.", "Say hi.", "What is 2+2?", "Name a color.")]
    prompt, ref = oracle_pick(prompts, lambda p: oracle.greedy(_toks(m, p), 200), lambda t: len(t) < 200,
                              "a chat reply that ends at EOS within 200 tokens")
    g = greedy(m, prompt, 200)
    assert g.tokens == ref
    assert g.finish_reason == "stop"
    assert len(g.tokens) < 200
    assert all(not m.is_eog(t) for t in g.tokens)
    assert _next_is_eog(m, _toks(m, prompt), g.tokens)


def test_detokenize_round_trip(m):
    text = "Rivers flow: 12 bridges, naïve café ☕."
    assert m.detokenize(m.tokenize(text, add_special=False)) == text


def test_greedy_exits_are_the_decode_steps(river_gguf_path):
    """On a River GGUF the loop's decode steps run with exits, as Model.score's do: the exit
    layers it reports are those of teacher-forcing its own tokens."""
    m = Model(river_gguf_path, n_ctx=256, n_threads=THREADS)
    g = greedy(m, PROMPT, 12, mode="river", threshold=0.95, tail=0)
    prompt = _toks(m, PROMPT)
    r = score(m, prompt + g.tokens, prefix=len(prompt), mode="river", threshold=0.95, tail=0)
    assert [int(e) for e in r.exit_layers] == g.exit_layers
