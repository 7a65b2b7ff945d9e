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


@pytest.fixture(scope="module")
def llm(q4_1_path):
    m = Llama(q4_1_path, n_ctx=1024, n_threads=1, verbose=False)
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
    json.dumps(a)


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
    with Llama(q4_1_path, n_ctx=256, n_threads=1, chat_handler=handler, verbose=False) as ours:
        monkeypatch.setattr(ref, "chat_handler", handler)
        a = ours.create_chat_completion([{"role": "user", "content": "Hello, world!"}], max_tokens=6, temperature=0.0)
        b = ref.create_chat_completion([{"role": "user", "content": "Hello, world!"}], max_tokens=6, temperature=0.0)
    assert scrub(a) == scrub(b)


@pytest.mark.parametrize("question", ['Answer in JSON with the key "answer": what is 2+2?',
                                      'Return {"city": ...} as JSON for the capital of France.'])
def test_json_object_response_format(llm, ref, question):
    msgs = [{"role": "user", "content": question}]
    a = llm.create_chat_completion(msgs, response_format={"type": "json_object"}, max_tokens=48, temperature=0.0)
    b = ref.create_chat_completion(msgs, response_format={"type": "json_object"}, max_tokens=48, temperature=0.0)
    assert a["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(a["choices"][0]["message"]["content"]), dict)
    assert scrub(a) == scrub(b)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def test_json_schema_response_format(llm, ref):
    msgs = [{"role": "user", "content": "Give me a JSON object with the name and age of a person."}]
    # OpenAI's form, which llama_cpp 0.3.36 ignores: converted with llama_cpp's json_schema_to_gbnf.
    a = llm.create_chat_completion(msgs, response_format={"type": "json_schema", "json_schema": {"name": "person",
                                                                                                "schema": PERSON}},
                                   max_tokens=48, temperature=0.0)
    person = json.loads(a["choices"][0]["message"]["content"])
    assert set(person) == {"name", "age"} and isinstance(person["age"], int) and isinstance(person["name"], str)
    # llama_cpp's own form: json_object with a schema.
    kw = dict(response_format={"type": "json_object", "schema": PERSON}, max_tokens=48, temperature=0.0)
    b, c = llm.create_chat_completion(msgs, **kw), ref.create_chat_completion(msgs, **kw)
    assert set(json.loads(b["choices"][0]["message"]["content"])) == {"name", "age"}
    assert scrub(b) == scrub(c)
    with pytest.raises(ValueError, match="schema"):
        llm.create_chat_completion(msgs, response_format={"type": "json_schema"})


def test_tool_call_forced(llm, ref, chat_format):
    chat_format("chatml-function-calling")
    choice = {"type": "function", "function": {"name": "get_weather"}}
    a = llm.create_chat_completion(TOOL_MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=48, temperature=0.0)
    b = ref.create_chat_completion(TOOL_MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=48, temperature=0.0)
    assert shape(a) == shape(b) and scrub(a) == scrub(b)
    call = a["choices"][0]["message"]["tool_calls"][0]
    assert a["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    # Streamed, the same call arrives in chunks of llama_cpp's shapes.
    sa = list(llm.create_chat_completion(TOOL_MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=48,
                                         temperature=0.0, stream=True))
    sb = list(ref.create_chat_completion(TOOL_MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=48,
                                         temperature=0.0, stream=True))
    assert [shape(c) for c in sa] == [shape(c) for c in sb] and scrub(sa) == scrub(sb)
    streamed = "".join(c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                       for c in sa if c["choices"][0]["delta"].get("tool_calls"))
    assert json.loads(streamed) == args


def test_tool_call_auto_and_legacy_functions(llm, ref, chat_format):
    chat_format("chatml-function-calling")
    a = llm.create_chat_completion(TOOL_MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=48, temperature=0.0)
    b = ref.create_chat_completion(TOOL_MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=48, temperature=0.0)
    assert scrub(a) == scrub(b)
    assert a["choices"][0]["finish_reason"] == "tool_calls"
    json.loads(a["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    functions = [t["function"] for t in TOOLS]
    a = llm.create_chat_completion(TOOL_MESSAGES, functions=functions, function_call={"name": "get_weather"},
                                   max_tokens=48, temperature=0.0)
    b = ref.create_chat_completion(TOOL_MESSAGES, functions=functions, function_call={"name": "get_weather"},
                                   max_tokens=48, temperature=0.0)
    assert scrub(a) == scrub(b)
    assert json.loads(a["choices"][0]["message"]["function_call"]["arguments"])["city"]


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
