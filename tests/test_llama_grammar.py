"""GBNF grammars and JSON schemas through river_gguf.Llama (libllama's grammar sampler on the
engine's logits), with llama_cpp.Llama on the same file (SmolLM2-135M-Instruct Q4_1) as the oracle.

llama-cpp-python 0.3.36's tests/test_llama_grammar.py builds three grammars and checks nothing
about them (its assertions are commented out): test_grammar_from_string (a tree grammar),
test_composed_pydantic_grammar (a schema with $defs/$ref) and test_grammar_anyof (anyOf with
null). Here each is built the same way and used for generation: the output must be in the
grammar's language (parsed, or matched against the tree), and equal llama_cpp's. All of them fit
a single-sequence text model, so none is left out.

What the model makes of a grammar (a whole tree, a JSON value that closes within max_tokens) is
asserted on the oracle first, for the first of a few candidate prompts where it holds
(support.oracle_pick); ours must then equal the oracle's: float rounding differs between CPUs,
so what SmolLM2 generates for one fixed prompt does too.
"""
import json

import pytest

import llama_cpp
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

import river_gguf.llama as rl
from river_gguf.llama import Llama, LlamaGrammar

from support import oracle_pick

TREE = """
leaf ::= "."
node ::= leaf | "(" node node ")"
root ::= node
"""

COMPOSED = {
    "$defs": {"A": {"properties": {"a": {"title": "A", "type": "integer"}}, "required": ["a"], "title": "A",
                    "type": "object"}},
    "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"title": "B", "type": "integer"}},
    "required": ["a", "b"],
    "title": "B",
    "type": "object",
}

ANYOF = {
    "properties": {
        "temperature": {"description": "The temperature mentioned", "type": "number"},
        "unit": {"anyOf": [{"description": "Unit for temperature", "enum": ["celsius", "fahrenheit"],
                            "type": "string"}, {"type": "null"}]},
    },
    "type": "object",
}


@pytest.fixture(scope="module")
def llm(q4_1_path):
    m = Llama(q4_1_path, n_ctx=512, n_threads=1, flash_attn=True, verbose=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def ref(q4_1_path):
    m = llama_cpp.Llama(q4_1_path, n_ctx=512, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    yield m
    m.close()


def both(llm, ref, prompt, grammar, **kw):
    """The same completion on both objects; returns our choice after checking it equals theirs."""
    a = llm(prompt, grammar=grammar, **kw)
    b = ref(prompt, grammar=grammar, **kw)
    assert a["choices"][0] == {**b["choices"][0], "logprobs": None}
    return a["choices"][0]


def oracle_first(llm, ref, prompts, grammar, has, what, **kw):
    """The first prompt whose oracle completion has the property; ours must equal it there.
    Returns our choice."""
    prompt, b = oracle_pick(prompts, lambda p: ref(p, grammar=grammar, **kw)["choices"][0], has, what)
    a = llm(prompt, grammar=grammar, **kw)
    assert a["choices"][0] == {**b, "logprobs": None}
    return a["choices"][0]


def parses(check=lambda v: True):
    """A choice that ended by itself and whose text is JSON that check accepts."""
    def has(choice):
        if choice["finish_reason"] != "stop":
            return False
        try:
            return bool(check(json.loads(choice["text"])))
        except ValueError:
            return False
    return has


def tree_parse(s: str):
    """Parse s against node ::= "." | "(" node node ")": the symbols still expected after it, or
    None when s is not a prefix of any tree."""
    expected = ["node"]
    for ch in s:
        if not expected:
            return None
        top = expected.pop()
        if top == "node" and ch == "(":
            expected += [")", "node", "node"]
        elif not ((top == "node" and ch == ".") or (top == ")" and ch == ")")):
            return None
    return expected


def is_tree(s: str) -> bool:
    return tree_parse(s) == []


def is_tree_prefix(s: str) -> bool:
    return tree_parse(s) is not None


def test_llama_grammar_is_llama_cpps():
    assert LlamaGrammar is llama_cpp.LlamaGrammar
    assert rl.LlamaGrammar.from_string(TREE)._grammar == TREE


TREE_PROMPTS = ["Tree: (..) or ((..).) or ", "A binary tree written with dots and parentheses: ", "Tree: (.(..)) ",
                "Another tree: ", "Trees: . (..) ((..).) ", "Write a deep tree: ((((", "Tree: "]


def test_grammar_from_string(llm, ref):
    # A whole tree (the grammar's end, so the completion stops by itself) ...
    g = LlamaGrammar.from_string(TREE)
    out = oracle_first(llm, ref, TREE_PROMPTS, g, lambda c: c["finish_reason"] == "stop" and is_tree(c["text"]),
                       "a completion that is a whole tree within 24 tokens", max_tokens=24, temperature=0.0)
    assert is_tree(out["text"])
    # ... and one cut by max_tokens: a prefix of a tree, not yet a tree.
    long = oracle_first(llm, ref, TREE_PROMPTS[1:] + TREE_PROMPTS[:1], g,
                        lambda c: c["finish_reason"] == "length" and is_tree_prefix(c["text"]) and not is_tree(c["text"]),
                        "a completion still inside a tree after 24 tokens", max_tokens=24, temperature=0.0)
    assert is_tree_prefix(long["text"]) and not is_tree(long["text"])
    sampled = both(llm, ref, "Another tree: ", LlamaGrammar.from_string(TREE), max_tokens=24, temperature=0.9,
                   seed=5)
    assert is_tree(sampled["text"]) if sampled["finish_reason"] == "stop" else is_tree_prefix(sampled["text"])
    assert not is_tree_prefix("(.))") and not is_tree_prefix("..") and is_tree_prefix("((.")


def test_grammar_as_string(llm, ref):
    """A GBNF string works where llama_cpp needs a LlamaGrammar object."""
    prompt = "Is the sky blue? Answer yes or no: "
    c = ref(prompt, grammar=LlamaGrammar.from_string('root ::= "yes" | "no"'), max_tokens=3, temperature=0.0)
    assert c["choices"][0]["text"] in ("yes", "no")  # the grammar's language
    a = llm(prompt, grammar='root ::= "yes" | "no"', max_tokens=3, temperature=0.0)
    b = llm(prompt, grammar=LlamaGrammar.from_string('root ::= "yes" | "no"'), max_tokens=3, temperature=0.0)
    assert a["choices"][0]["text"] == b["choices"][0]["text"] == c["choices"][0]["text"]


def test_composed_pydantic_grammar(llm, ref):
    grammar = LlamaGrammar.from_json_schema(json.dumps(COMPOSED))
    assert grammar._grammar == json_schema_to_gbnf(json.dumps(COMPOSED))

    def composed(v):
        return isinstance(v["a"]["a"], int) and isinstance(v["b"], int)

    out = oracle_first(llm, ref, ["Here is the object as JSON: ", "JSON: ", 'The object {"a": {"a": 1}, "b": 2} as JSON: ',
                                  "Two small numbers as JSON: "], grammar, parses(composed),
                       "a completion that closes the schema's JSON within 40 tokens", max_tokens=40, temperature=0.0)
    assert composed(json.loads(out["text"]))


def test_grammar_anyof(llm, ref):
    grammar = LlamaGrammar.from_json_schema(json.dumps(ANYOF))

    def in_schema(value):
        return (isinstance(value, dict) and set(value) <= {"temperature", "unit"}
                and value.get("unit") in (None, "celsius", "fahrenheit")
                and ("temperature" not in value or isinstance(value["temperature"], (int, float))))

    out = oracle_first(llm, ref, ["It is 21 degrees celsius outside. As JSON: ", "The weather as JSON: ",
                                  "Temperature 30, unit fahrenheit. JSON: ", "JSON: "], grammar, parses(in_schema),
                       "a completion that closes the schema's JSON within 40 tokens", max_tokens=40, temperature=0.0)
    assert in_schema(json.loads(out["text"]))


def test_json_grammar_stream(llm, ref):
    """The generic JSON grammar, streamed: the chunks join to JSON and equal llama_cpp's chunks."""
    kw = dict(max_tokens=32, temperature=0.0, stream=True)

    def theirs(prompt):
        chunks = list(ref(prompt, grammar=llama_cpp.LlamaGrammar.from_string(JSON_GBNF), **kw))
        return {"finish_reason": chunks[-1]["choices"][0]["finish_reason"],
                "text": "".join(c["choices"][0]["text"] for c in chunks), "chunks": chunks}

    prompt, b = oracle_pick(['A JSON object with the key "answer" for 2+2: ', 'JSON {"x": 1}: ', "A small JSON object: ",
                             'The answer as JSON, {"answer": ...}: '], theirs, parses(),
                            "a streamed JSON completion that closes within 32 tokens")
    a = [c["choices"][0]["text"] for c in llm(prompt, grammar=LlamaGrammar.from_string(JSON_GBNF), **kw)]
    assert a == [c["choices"][0]["text"] for c in b["chunks"]]
    json.loads("".join(a))


def test_invalid_grammar_is_a_value_error(llm, ref):
    for bad in ('root ::= "unterminated', "root ::= undefined_rule", "", LlamaGrammar.from_string("root ::= (")):
        with pytest.raises(ValueError):
            llm("Hi", grammar=bad, max_tokens=2)
    with pytest.raises(TypeError):
        llm("Hi", grammar=42, max_tokens=2)
    # The Llama is still usable afterwards: the answer llama_cpp gives.
    a, b = llm("Hi", max_tokens=1, temperature=0.0), ref("Hi", max_tokens=1, temperature=0.0)
    assert a["choices"][0] == {**b["choices"][0], "logprobs": None} and a["usage"] == b["usage"]
