"""GBNF grammars and JSON schemas through river_gguf.Llama (libllama's grammar sampler on the
engine's logits), with llama_cpp.Llama on the same file (SmolLM2-135M-Instruct Q4_1) as the oracle.

llama-cpp-python 0.3.36's tests/test_llama_grammar.py builds three grammars and checks nothing
about them (its assertions are commented out): test_grammar_from_string (a tree grammar),
test_composed_pydantic_grammar (a schema with $defs/$ref) and test_grammar_anyof (anyOf with
null). Here each is built the same way and used for generation: the output must be in the
grammar's language (parsed, or matched against the tree), and equal llama_cpp's. All of them fit
a single-sequence text model, so none is left out.
"""
import json
import re

import pytest

import llama_cpp
from llama_cpp.llama_grammar import JSON_GBNF, json_schema_to_gbnf

import river_gguf.llama as rl
from river_gguf.llama import Llama, LlamaGrammar

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
    m = Llama(q4_1_path, n_ctx=512, n_threads=1, verbose=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def ref(q4_1_path):
    m = llama_cpp.Llama(q4_1_path, n_ctx=512, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    yield m
    m.close()


def both(llm, ref, prompt, grammar, **kw):
    """The same completion on both objects; returns our text after checking it equals theirs."""
    a = llm(prompt, grammar=grammar, **kw)
    b = ref(prompt, grammar=grammar, **kw)
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    return a["choices"][0]


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


def test_grammar_from_string(llm, ref):
    out = both(llm, ref, "Tree: (..) or ((..).) or ", LlamaGrammar.from_string(TREE), max_tokens=24, temperature=0.0)
    assert out["finish_reason"] == "stop" and is_tree(out["text"])
    long = both(llm, ref, "A binary tree written with dots and parentheses: ", LlamaGrammar.from_string(TREE),
                max_tokens=24, temperature=0.0)
    assert long["finish_reason"] == "length" and is_tree_prefix(long["text"]) and not is_tree(long["text"])
    sampled = both(llm, ref, "Another tree: ", LlamaGrammar.from_string(TREE), max_tokens=24, temperature=0.9,
                   seed=5)
    assert is_tree(sampled["text"]) if sampled["finish_reason"] == "stop" else is_tree_prefix(sampled["text"])
    assert not is_tree_prefix("(.))") and not is_tree_prefix("..") and is_tree_prefix("((.")


def test_grammar_as_string(llm):
    """A GBNF string works where llama_cpp needs a LlamaGrammar object."""
    a = llm("Is the sky blue? Answer yes or no: ", grammar='root ::= "yes" | "no"', max_tokens=3, temperature=0.0)
    b = llm("Is the sky blue? Answer yes or no: ", grammar=LlamaGrammar.from_string('root ::= "yes" | "no"'),
            max_tokens=3, temperature=0.0)
    assert a["choices"][0]["text"] == b["choices"][0]["text"] in ("yes", "no")


def test_composed_pydantic_grammar(llm, ref):
    grammar = LlamaGrammar.from_json_schema(json.dumps(COMPOSED))
    assert grammar._grammar == json_schema_to_gbnf(json.dumps(COMPOSED))
    out = both(llm, ref, "Here is the object as JSON: ", grammar, max_tokens=40, temperature=0.0)
    value = json.loads(out["text"])
    assert isinstance(value["a"]["a"], int) and isinstance(value["b"], int)


def test_grammar_anyof(llm, ref):
    grammar = LlamaGrammar.from_json_schema(json.dumps(ANYOF))
    out = both(llm, ref, "It is 21 degrees celsius outside. As JSON: ", grammar, max_tokens=40, temperature=0.0)
    value = json.loads(out["text"])
    assert isinstance(value, dict) and set(value) <= {"temperature", "unit"}
    assert value.get("unit") in (None, "celsius", "fahrenheit")
    if "temperature" in value:
        assert isinstance(value["temperature"], (int, float))


def test_json_grammar_stream(llm, ref):
    """The generic JSON grammar, streamed: the chunks join to JSON and equal llama_cpp's chunks."""
    prompt = 'A JSON object with the key "answer" for 2+2: '
    kw = dict(max_tokens=32, temperature=0.0, stream=True)
    a = [c["choices"][0]["text"] for c in llm(prompt, grammar=LlamaGrammar.from_string(JSON_GBNF), **kw)]
    b = [c["choices"][0]["text"] for c in ref(prompt, grammar=llama_cpp.LlamaGrammar.from_string(JSON_GBNF), **kw)]
    assert a == b
    json.loads("".join(a))


def test_invalid_grammar_is_a_value_error(llm):
    for bad in ('root ::= "unterminated', "root ::= undefined_rule", "", LlamaGrammar.from_string("root ::= (")):
        with pytest.raises(ValueError):
            llm("Hi", grammar=bad, max_tokens=2)
    with pytest.raises(TypeError):
        llm("Hi", grammar=42, max_tokens=2)
    # The Llama is still usable afterwards.
    assert llm("Hi", max_tokens=1, temperature=0.0)["usage"]["completion_tokens"] == 1
