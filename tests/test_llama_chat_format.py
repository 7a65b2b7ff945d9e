"""Chat through river_gguf.Llama: llama_cpp's chat handlers (the GGUF's template, named chat
formats, chat_handler objects, tools and functions) driving our create_completion, with
llama_cpp.Llama on the same file (SmolLM2-135M-Instruct Q4_1) as the oracle.

llama-cpp-python 0.3.36's tests/test_llama_chat_format.py has two cases, both about llama_cpp's
own formatters: test_mistral_instruct and test_hf_tokenizer_config_str_to_chat_formatter. Both are
kept here (the formatter checks are the upstream ones) and extended to generation: the same
chat_format / chat_handler on river_gguf.Llama and on llama_cpp.Llama must give the same text.
Beyond upstream: the default template, dict shapes key by key (stream and non-stream, logprobs),
JSON mode (json_object, json_object with a schema, OpenAI's json_schema), tool calls (forced,
automatic, streamed) and legacy functions through the chatml-function-calling handler.
Model behaviour (a JSON-mode reply that parses, a tool call whose arguments parse) is asserted on
the oracle first, for the first of a few candidate inputs that gives it (support.oracle_pick),
then ours must equal the oracle's: float rounding differs between CPUs, so what SmolLM2 generates
for one fixed prompt does too.
Not covered: the multimodal handlers (Llava15ChatHandler and kin) and functionary's HF-tokenizer
handlers: they need image models, or drive llama.cpp's own context directly (`llama._ctx`).
"""
import json

import jinja2
import pytest

import llama_cpp
import llama_cpp.llama_chat_format as llama_chat_format
import llama_cpp.llama_types as llama_types
from llama_cpp import ChatCompletionRequestUserMessage
from llama_cpp.llama_chat_format import hf_tokenizer_config_to_chat_formatter

from river_gguf.llama import Llama

from support import oracle_pick

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}]
TOOL_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "What is the weather in Paris?"}]
# Candidates for the tool-call tests, TOOL_MESSAGES first (see oracle_pick).
TOOL_CANDIDATES = [TOOL_MESSAGES] + [
    [TOOL_MESSAGES[0], {"role": "user", "content": q}]
    for q in ("What is the weather in Berlin, in celsius?", "Tell me the weather in Tokyo.",
              "Use the get_weather tool for London in fahrenheit.", "Is it raining in Madrid today?")]


@pytest.fixture(scope="module")
def llm(q4_1_path):
    m = Llama(q4_1_path, n_ctx=1024, n_threads=1, flash_attn=True, verbose=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def ref(q4_1_path):
    m = llama_cpp.Llama(q4_1_path, n_ctx=1024, n_threads=1, n_threads_batch=1, logits_all=True, flash_attn=True,
                        verbose=False)
    yield m
    m.close()


@pytest.fixture
def chat_format(llm, ref, monkeypatch):
    """Set the same chat_format on both objects for one test."""
    def use(name):
        monkeypatch.setattr(llm, "chat_format", name)
        monkeypatch.setattr(ref, "chat_format", name)
    return use


def shape(x, key=None):
    """Dict keys in order, list lengths and value types (see test_llama.shape)."""
    if isinstance(x, dict):
        if key == "top_logprobs":
            return len(x)
        return [(k, shape(v, k)) for k, v in x.items()]
    if isinstance(x, list):
        return [shape(v, key) for v in x]
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, (int, float)) or type(x).__module__ == "numpy":
        return "number"
    return "str" if isinstance(x, str) else (None if x is None else type(x).__name__)


def scrub(x):
    """The response without what differs by construction: ids (random uuids) and timestamps."""
    if isinstance(x, dict):
        return {k: scrub(v) for k, v in x.items() if k not in ("id", "created")}
    if isinstance(x, list):
        return [scrub(v) for v in x]
    return x


def test_default_template_is_chosen_like_llama_cpp(llm, ref):
    assert llm.chat_format == ref.chat_format == "chat_template.default"
    assert set(llm._chat_handlers) == set(ref._chat_handlers)


def test_chat_completion_matches(llm, ref):
    a = llm.create_chat_completion(MESSAGES, max_tokens=12, temperature=0.0)
    b = ref.create_chat_completion(MESSAGES, max_tokens=12, temperature=0.0)
    assert shape(a) == shape(b)
    assert scrub(a) == scrub(b)
    assert a["object"] == "chat.completion" and a["id"].startswith("chatcmpl-")
    sa = list(llm.create_chat_completion(MESSAGES, max_tokens=12, temperature=0.0, stream=True))
    sb = list(ref.create_chat_completion(MESSAGES, max_tokens=12, temperature=0.0, stream=True))
    assert [shape(c) for c in sa] == [shape(c) for c in sb]
    assert scrub(sa) == scrub(sb)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in sa) == a["choices"][0]["message"]["content"]


def test_chat_logprobs_shape(llm, ref):
    a = llm.create_chat_completion(MESSAGES, max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2)
    b = ref.create_chat_completion(MESSAGES, max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2)
    assert shape(a) == shape(b)
    ca, cb = a["choices"][0]["logprobs"]["content"], b["choices"][0]["logprobs"]["content"]
    assert [t["token"] for t in ca] == [t["token"] for t in cb]
    assert all(abs(x["logprob"] - y["logprob"]) < 0.05 for x, y in zip(ca, cb))
    assert [type(x["logprob"]) for x in ca] == [type(y["logprob"]) for y in cb]  # llama_cpp's own types


def test_mistral_instruct(llm, ref, chat_format):
    # Upstream's formatter check ...
    template = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
                "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] "
                "== 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
                "roles are supported!') }}{% endif %}{% endfor %}")
    messages = [
        llama_types.ChatCompletionRequestUserMessage(role="user", content="Instruction"),
        llama_types.ChatCompletionRequestAssistantMessage(role="assistant", content="Model answer"),
        llama_types.ChatCompletionRequestUserMessage(role="user", content="Follow-up instruction"),
    ]
    response = llama_chat_format.format_mistral_instruct(messages=messages)
    prompt = ("" if response.added_special else "<s>") + response.prompt
    assert prompt == jinja2.Template(template).render(messages=messages, bos_token="<s>", eos_token="</s>")
    # ... and the format driving generation on both objects.
    chat_format("mistral-instruct")
    a = llm.create_chat_completion(messages, max_tokens=8, temperature=0.0)
    b = ref.create_chat_completion(messages, max_tokens=8, temperature=0.0)
    assert scrub(a) == scrub(b)


MISTRAL_TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "chat_template": "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                     "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
                     "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}"
                     "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}",
}


def test_hf_tokenizer_config_chat_handler(q4_1_path, ref, monkeypatch):
    formatter = hf_tokenizer_config_to_chat_formatter(MISTRAL_TOKENIZER_CONFIG)
    response = formatter(messages=[ChatCompletionRequestUserMessage(role="user", content="Hello, world!")])
    assert response.prompt == "<s>[INST] Hello, world! [/INST]</s>"
    handler = llama_chat_format.hf_tokenizer_config_to_chat_completion_handler(MISTRAL_TOKENIZER_CONFIG)
    with Llama(q4_1_path, n_ctx=256, n_threads=1, chat_handler=handler, flash_attn=True, verbose=False) as ours:
        monkeypatch.setattr(ref, "chat_handler", handler)
        a = ours.create_chat_completion([{"role": "user", "content": "Hello, world!"}], max_tokens=6, temperature=0.0)
        b = ref.create_chat_completion([{"role": "user", "content": "Hello, world!"}], max_tokens=6, temperature=0.0)
    assert scrub(a) == scrub(b)


JSON_QUESTIONS = ['Answer in JSON with the key "answer": what is 2+2?',
                  'Return {"city": ...} as JSON for the capital of France.',
                  'Reply with a JSON object {"color": ...} for the color of the sky.',
                  'Give me a JSON object with the key "name" set to a fruit.',
                  'As a JSON object: how many legs does a cat have?']


def _content(r):
    return r["choices"][0]["message"]["content"]


def _ends_as_json(r, check=lambda v: isinstance(v, dict)):
    """The reply ended by itself (not at max_tokens) and its content parses to what check accepts."""
    if r["choices"][0]["finish_reason"] != "stop":
        return False
    try:
        return bool(check(json.loads(_content(r))))
    except (TypeError, ValueError):
        return False


@pytest.mark.parametrize("first", [0, 1])
def test_json_object_response_format(llm, ref, first):
    """JSON mode: the oracle's reply ends and parses as an object (for the first candidate
    question, from `first` on, where it does on this CPU), and ours equals it key by key."""
    kw = dict(response_format={"type": "json_object"}, max_tokens=48, temperature=0.0)
    questions = JSON_QUESTIONS[first:] + JSON_QUESTIONS[:first]
    question, b = oracle_pick(questions, lambda q: ref.create_chat_completion([{"role": "user", "content": q}], **kw),
                              _ends_as_json, "a JSON-mode reply that ends within 48 tokens and parses as an object")
    a = llm.create_chat_completion([{"role": "user", "content": question}], **kw)
    assert scrub(a) == scrub(b)
    assert isinstance(json.loads(_content(a)), dict)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
PERSON_QUESTIONS = ["Give me a JSON object with the name and age of a person.",
                    "A person as JSON, with name and age.",
                    "Describe Alice, who is 30, as JSON with her name and age.",
                    "JSON for a person named Bob aged 42."]


def _is_person(v):
    return (isinstance(v, dict) and set(v) == {"name", "age"} and isinstance(v["age"], int)
            and isinstance(v["name"], str))


def test_json_schema_response_format(llm, ref):
    # llama_cpp's own form, json_object with a schema: the oracle's reply ends and is a person.
    kw = dict(response_format={"type": "json_object", "schema": PERSON}, max_tokens=48, temperature=0.0)
    question, c = oracle_pick(PERSON_QUESTIONS,
                              lambda q: ref.create_chat_completion([{"role": "user", "content": q}], **kw),
                              lambda r: _ends_as_json(r, _is_person),
                              "a schema-constrained reply that ends within 48 tokens and parses as the schema")
    msgs = [{"role": "user", "content": question}]
    b = llm.create_chat_completion(msgs, **kw)
    assert scrub(b) == scrub(c)
    # OpenAI's form, which llama_cpp 0.3.36 ignores: converted with llama_cpp's json_schema_to_gbnf,
    # the same grammar as llama_cpp's json_object + schema, so the same reply as the oracle's.
    a = llm.create_chat_completion(msgs, response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                                                "schema": PERSON}},
                                   max_tokens=48, temperature=0.0)
    assert scrub(a) == scrub(c)
    assert _is_person(json.loads(_content(a)))
    with pytest.raises(ValueError, match="schema"):
        llm.create_chat_completion(msgs, response_format={"type": "json_schema"})


def _tool_args(r, key="tool_calls"):
    """The parsed arguments of the reply's (first) call, or None."""
    msg = r["choices"][0]["message"]
    try:
        call = msg["tool_calls"][0]["function"] if key == "tool_calls" else msg["function_call"]
        return json.loads(call["arguments"]) if call["name"] == "get_weather" else None
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def _is_weather_call(r):
    args = _tool_args(r)
    return (r["choices"][0]["finish_reason"] == "tool_calls" and isinstance(args, dict)
            and isinstance(args.get("city"), str) and args.get("unit") in ("celsius", "fahrenheit"))


def test_tool_call_forced(llm, ref, chat_format):
    chat_format("chatml-function-calling")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(tools=TOOLS, tool_choice=choice, max_tokens=48, temperature=0.0)
    # The oracle's forced call must end within max_tokens with arguments that parse.
    msgs, b = oracle_pick(TOOL_CANDIDATES, lambda m: ref.create_chat_completion(m, **kw), _is_weather_call,
                          "a forced get_weather call whose arguments end within 48 tokens and parse")
    a = llm.create_chat_completion(msgs, **kw)
    assert shape(a) == shape(b) and scrub(a) == scrub(b)
    args = _tool_args(a)
    # Streamed, the same call arrives in chunks of llama_cpp's shapes.
    sa = list(llm.create_chat_completion(msgs, stream=True, **kw))
    sb = list(ref.create_chat_completion(msgs, stream=True, **kw))
    assert [shape(c) for c in sa] == [shape(c) for c in sb] and scrub(sa) == scrub(sb)
    streamed = "".join(c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                       for c in sa if c["choices"][0]["delta"].get("tool_calls"))
    assert json.loads(streamed) == args


def test_tool_call_auto_and_legacy_functions(llm, ref, chat_format):
    chat_format("chatml-function-calling")
    kw = dict(tools=TOOLS, tool_choice="auto", max_tokens=48, temperature=0.0)
    # tool_choice="auto": the oracle chooses the tool (for the first candidate where it does).
    msgs, b = oracle_pick(TOOL_CANDIDATES, lambda m: ref.create_chat_completion(m, **kw), _is_weather_call,
                          'a get_weather call chosen under tool_choice="auto", with arguments that parse')
    a = llm.create_chat_completion(msgs, **kw)
    assert scrub(a) == scrub(b)
    functions = [t["function"] for t in TOOLS]
    kw = dict(functions=functions, function_call={"name": "get_weather"}, max_tokens=48, temperature=0.0)
    msgs, b = oracle_pick(TOOL_CANDIDATES, lambda m: ref.create_chat_completion(m, **kw),
                          lambda r: bool((_tool_args(r, "function_call") or {}).get("city")),
                          "a legacy function_call whose arguments parse and name a city")
    a = llm.create_chat_completion(msgs, **kw)
    assert scrub(a) == scrub(b)
    assert _tool_args(a, "function_call")["city"]


def test_bad_chat_arguments(llm):
    with pytest.raises(ValueError):
        llm.create_chat_completion("not a list of messages")
    with pytest.raises(ValueError):
        llm.create_chat_completion(MESSAGES, response_format="json")
    with pytest.raises(TypeError):
        llm.create_chat_completion(MESSAGES, max_tokens=1, warp_speed=9)


def test_openai_v1_objects(llm):
    import openai  # the server's tests need it too

    r = llm.create_chat_completion_openai_v1(messages=MESSAGES, max_tokens=4, temperature=0.0)
    assert isinstance(r, openai.types.chat.ChatCompletion) and r.choices[0].message.role == "assistant"
    chunks = list(llm.create_chat_completion_openai_v1(messages=MESSAGES, max_tokens=4, temperature=0.0, stream=True))
    assert all(isinstance(c, openai.types.chat.ChatCompletionChunk) for c in chunks)
