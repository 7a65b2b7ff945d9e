"""`river-gguf serve`: the real server in a subprocess on a free port, driven by the official
openai client (and by raw HTTP where a client would refuse to send the request).

Answers are compared with the same requests on an in-process Llama at temperature 0, so a
server that mixed up requests, or interleaved two of them on one KV cache, fails here. Where a
test needs a property of the model's output (a reply that runs to the end of the context, a
JSON-mode reply that parses), it picks an input for which the in-process model (or, for JSON
mode, llama_cpp.Llama) has it on this CPU, never a prompt assumed to have it."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from llama_cpp.server.types import CreateCompletionRequest
from pydantic import ValidationError

import river_gguf
from river_gguf import Llama
from river_gguf.greedy import greedy
from river_gguf.serve import served_model
from river_gguf.serve.protocol import accepts
from river_gguf.serve.schemas import CompletionRequest
from river_gguf.serve.settings import API_KEY_ENV

from support import oracle_pick

API_KEY = "test-key-123"
ALIAS = "smol"
N_CTX = 512
PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name three fruits."}]
# Counting has no natural end: without a disconnect this runs until the context is full. The
# `endless` fixture checks that on the in-process model and takes the first that does.
ENDLESS_CANDIDATES = ["1, 2, 3, 4, 5, 6, 7, 8,", "1 2 3 4 5 6 7 8 9 10", "a, b, c, d, e, f, g,",
                      "2, 4, 6, 8, 10, 12,", "one, two, three, four, five,"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    """The test's own river_gguf (a dev overlay or the installed one) for the subprocess."""
    env = dict(os.environ)
    # abspath, not resolve: a dev overlay is a folder of symlinks beside its own _native .so
    root = os.path.dirname(os.path.dirname(os.path.abspath(river_gguf.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop(API_KEY_ENV, None)
    return env


def _serve_cmd(*args) -> list:
    return [sys.executable, "-m", "river_gguf.cli", "serve", *args]


# Straight to 127.0.0.1: a proxy set in the environment must not carry these requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _client(base, key=API_KEY, timeout=60):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=timeout,
                         http_client=openai.DefaultHttpxClient(trust_env=False))


def _http(base, method, path, body=None, key=API_KEY, raw=None):
    """(status, parsed JSON) of one request, errors included."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with _OPENER.open(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Server:
    def __init__(self, base, proc, log):
        self.base, self.proc, self.log = base, proc, log

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-4000:]


@contextlib.contextmanager
def _running_server(args, folder):
    """`river-gguf serve ARGS` in a subprocess on a free port, once /health answers; stopped after."""
    port = _free_port()
    log = folder / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(_serve_cmd(*args, "--port", str(port)), stdout=f, stderr=subprocess.STDOUT,
                                env=_env(), cwd=folder)
    s = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{s.output()}"
            try:
                if _http(s.base, "GET", "/health", key=None)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, f"no /health after 90 s:\n{s.output()}"
            time.sleep(0.2)
        yield s
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(q4_1_path, tmp_path_factory):
    # One slot: the tests below show the queue (a second request waits for the first).
    args = [q4_1_path, "--threads", "1", "--n-ctx", str(N_CTX), "--parallel", "1", "--api-key", API_KEY,
            "--alias", ALIAS, "--log-level", "warning"]
    with _running_server(args, tmp_path_factory.mktemp("server")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return _client(server.base)


@pytest.fixture(scope="module")
def local(q4_1_path):
    """The same file in-process, in the class the server runs: what the server must answer."""
    llm = Llama(q4_1_path, n_ctx=N_CTX, n_threads=1, flash_attn=True, verbose=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def endless(local):
    """A prompt whose greedy reply fills the whole context (no EOS before it) on this CPU."""
    prompt, _ = oracle_pick(ENDLESS_CANDIDATES, lambda p: greedy(local.river_model, p, N_CTX),
                            lambda g: g.finish_reason == "length", "a greedy reply that runs to the end of the context",
                            oracle="the in-process model")
    return prompt


def _alive(server, client, local) -> float:
    """The server still runs and still answers correctly; returns how long its answer took."""
    assert server.proc.poll() is None, server.output()
    want = local.create_completion(PROMPT, max_tokens=4, temperature=0)["choices"][0]["text"]
    t0 = time.perf_counter()
    r = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=4, temperature=0)
    took = time.perf_counter() - t0
    assert r.choices[0].text == want
    return took


def _stream_text(stream, field):
    parts, finish = [], None
    for chunk in stream:
        c = chunk.choices[0]
        piece = c.text if field == "text" else c.delta.content
        parts.append(piece or "")
        finish = c.finish_reason or finish
    return "".join(parts), finish


# ----- endpoints -----------------------------------------------------------------------
def test_health_and_models(server, client):
    status, body = _http(server.base, "GET", "/health", key=None)  # no key needed for health
    assert status == 200 and body["status"] == "ok" and body["model"] == ALIAS
    assert (body["slots_idle"], body["slots_processing"], body["waiting"]) == (1, 0, 0)
    assert [m.id for m in client.models.list().data] == [ALIAS]


def test_tokenize(server, local):
    want = local.tokenize(PROMPT.encode())
    assert _http(server.base, "POST", "/extras/tokenize", {"input": PROMPT}) == (200, {"tokens": want})
    assert _http(server.base, "POST", "/extras/tokenize/count", {"input": PROMPT}) == (200, {"count": len(want)})


def test_embeddings(server, client, q4_1_path):
    """/v1/embeddings answers what Llama(embedding=True).create_embedding gives in-process."""
    with Llama(q4_1_path, n_ctx=N_CTX, n_threads=1, flash_attn=True, embedding=True, verbose=False) as llm:
        want = llm.create_embedding([PROMPT, "second"])
    got = client.embeddings.create(model=ALIAS, input=[PROMPT, "second"], encoding_format="float")
    assert [d.embedding for d in got.data] == [d["embedding"] for d in want["data"]]
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"] and got.model == ALIAS
    status, body = _http(server.base, "POST", "/v1/embeddings", {"input": 3})
    assert status == 400 and _is_openai_error(body, 400)


def test_completion_stream_and_not(client, local):
    want = local.create_completion(PROMPT, max_tokens=12, temperature=0)
    r = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == ALIAS
    assert r.choices[0].text == want["choices"][0]["text"]
    assert r.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert (r.usage.completion_tokens == 12) == (r.choices[0].finish_reason == "length")
    assert r.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert r.usage.completion_tokens == want["usage"]["completion_tokens"]

    text, finish = _stream_text(
        client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=12, temperature=0, stream=True), "text")
    assert text == r.choices[0].text and finish == r.choices[0].finish_reason


def test_completion_from_token_ids(client, local):
    toks = local.tokenize(PROMPT.encode(), add_bos=True, special=True)
    r = client.completions.create(model=ALIAS, prompt=toks, max_tokens=6, temperature=0)
    assert r.choices[0].text == local.create_completion(PROMPT, max_tokens=6, temperature=0)["choices"][0]["text"]


def test_chat_stream_and_not(client, local):
    want = local.create_chat_completion(CHAT, max_tokens=12, temperature=0)
    r = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == ALIAS
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == want["choices"][0]["message"]["content"]
    assert r.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert (r.usage.completion_tokens == 12) == (r.choices[0].finish_reason == "length")

    chunks = list(client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.model == ALIAS for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_two_concurrent_clients(server, client, local):
    """Two streams sent at once: the second waits for the first; both answers are complete and
    equal to the same requests run alone (and to the in-process model's)."""
    def chat():
        s = client.chat.completions.create(model=ALIAS, messages=CHAT, max_tokens=24, temperature=0, stream=True)
        return _stream_text(s, "delta")

    def completion():
        s = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
        return _stream_text(s, "text")

    alone = {"chat": chat(), "completion": completion()}
    want_chat = local.create_chat_completion(CHAT, max_tokens=24, temperature=0)["choices"][0]
    want_completion = local.create_completion(PROMPT, max_tokens=24, temperature=0)["choices"][0]
    assert alone == {"chat": (want_chat["message"]["content"], want_chat["finish_reason"]),
                     "completion": (want_completion["text"], want_completion["finish_reason"])}

    together, errors = {}, []
    barrier = threading.Barrier(2)

    def run(name, fn):
        try:
            barrier.wait(timeout=30)
            together[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=a) for a in (("chat", chat), ("completion", completion))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert together == alone


# ----- bad requests --------------------------------------------------------------------
def _is_openai_error(body, status, param=None):
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == "invalid_request_error", err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_malformed_requests_get_json_errors_and_server_stays_up(server, client, local):
    base = server.base
    cases = [
        # (path, raw body or JSON body, expected param)
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", {"prompt": PROMPT, "bogus": 1}, "bogus"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": -5}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 4}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "n": 2}, "n"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ("/v1/completions", {"prompt": "hello " * N_CTX}, None),  # longer than the context
        # The same in a stream: still a JSON error, not a 200 stream (even from a model class
        # whose stream is a lazy generator that raises only when first advanced).
        ("/v1/completions", {"prompt": "hello " * N_CTX, "stream": True}, None),
    ]
    for path, body, param in cases:
        raw = body if isinstance(body, bytes) else None
        status, answer = _http(base, "POST", path, None if raw else body, raw=raw)
        assert status == 400, (path, body, status, answer)
        _is_openai_error(answer, status, param)
    status, answer = _http(base, "GET", "/v1/nothing-here")
    assert status == 404 and answer["error"]["message"]

    # The official client sees them as BadRequestError with the same error object.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=4, extra_body={"bogus": 1})
    assert e.value.status_code == 400 and "bogus" in e.value.message
    _alive(server, client, local)


@pytest.mark.parametrize("name,value", [("response_format", {"type": "json_object"}), ("presence_penalty", 0.5)])
def test_parameters_the_model_lacks_get_400(server, client, local, q4_1_path, name, value):
    """Known OpenAI parameters are passed on only to a model class that takes them; the served
    class decides (river_gguf.Model has no grammar sampler and no presence penalty)."""
    kw = dict(model=ALIAS, messages=CHAT, max_tokens=8, temperature=0, **{name: value})
    if accepts(served_model.model_class().create_chat_completion, name):
        content = client.chat.completions.create(**kw).choices[0].message.content
        assert content is not None
        if name == "response_format":  # JSON mode through the grammar sampler
            _json_mode_matches_llama_cpp(client, q4_1_path)
        return
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert name in e.value.message and "not supported" in e.value.message
    assert e.value.body["param"] == name
    _alive(server, client, local)


JSON_CHATS = [CHAT] + [[{"role": "user", "content": q}] for q in (
    'Answer in JSON with the key "answer": what is 2+2?', 'Return {"city": ...} as JSON for the capital of France.',
    'Give me a JSON object with the key "name" set to a fruit.')]


def _json_mode_matches_llama_cpp(client, model_path):
    """JSON mode: llama_cpp.Llama on the same file gives a reply that ends and parses (for the
    first candidate chat where it does on this CPU); the server's reply is the same text."""
    import llama_cpp

    def parses(choice):
        try:
            return choice["finish_reason"] == "stop" and json.loads(choice["message"]["content"]) is not None
        except ValueError:
            return False

    ref = llama_cpp.Llama(model_path, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    try:
        msgs, want = oracle_pick(
            JSON_CHATS, lambda m: ref.create_chat_completion(m, response_format={"type": "json_object"},
                                                             max_tokens=48, temperature=0)["choices"][0],
            parses, "a JSON-mode reply that ends within 48 tokens and parses")
    finally:
        ref.close()
    r = client.chat.completions.create(model=ALIAS, messages=msgs, max_tokens=48, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content == want["message"]["content"]
    assert r.choices[0].finish_reason == want["finish_reason"]
    json.loads(r.choices[0].message.content)


def test_wrong_or_missing_api_key_gets_401(server, client, local):
    bad = _client(server.base, key="wrong-key")
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=4)
    assert e.value.status_code == 401
    for key in ("wrong-key", None):
        status, body = _http(server.base, "POST", "/v1/completions", {"prompt": PROMPT}, key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    status, _ = _http(server.base, "GET", "/v1/models", key="wrong-key")
    assert status == 401
    _alive(server, client, local)


# ----- disconnects ---------------------------------------------------------------------
@pytest.mark.alone  # compares a request's time with a token's
def test_client_disconnecting_mid_stream_frees_the_model(server, client, local, endless):
    """A client that stops reading and closes its connection mid-stream: the server stops that
    generation and serves the next request at once instead of generating to the end."""
    n_prompt = len(local.tokenize(endless.encode(), add_bos=True, special=True))
    alone = _alive(server, client, local)  # the next request's own time, on an idle server
    stream = client.completions.create(model=ALIAS, prompt=endless, max_tokens=N_CTX, temperature=0,
                                       stream=True)
    times = []
    for chunk in stream:
        assert chunk.choices[0].finish_reason is None  # still generating
        times.append(time.perf_counter())
        if len(times) == 8:
            break
    stream.close()  # drops the connection
    per_token = (times[-1] - times[0]) / (len(times) - 1)
    left = N_CTX - n_prompt - len(times)  # tokens the server would still generate had it not stopped

    waited = _alive(server, client, local)
    # Generating what was left would take left * per_token (~480 tokens); the next request
    # needs its own few tokens (plus at most the one step in flight at the disconnect).
    assert waited < max(left * per_token / 4, 3 * alone + 0.5), (waited, alone, left, per_token)
    status, body = _http(server.base, "GET", "/health", key=None)
    assert status == 200 and body["busy"] is False and body["waiting"] == 0


def test_clients_leaving_the_queue_cost_nothing(server, client, local, endless):
    """Requests queued behind a stream whose clients hang up before their turn are skipped, not
    generated for nobody: once the stream ends, the next request is served at once."""
    alone = _alive(server, client, local)
    stream = client.completions.create(model=ALIAS, prompt=endless, max_tokens=N_CTX, temperature=0,
                                       stream=True)
    next(iter(stream))  # the stream now holds the model
    port = int(server.base.rsplit(":", 1)[1])
    socks = []
    for streamed in (False, True):  # one of each kind, each asking for ~480 tokens
        body = json.dumps({"prompt": endless, "max_tokens": N_CTX, "temperature": 0, "stream": streamed}).encode()
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        socks.append(s)
    deadline = time.monotonic() + 10
    while _http(server.base, "GET", "/health", key=None)[1]["waiting"] < 2:
        assert time.monotonic() < deadline, "the two requests never queued"
        time.sleep(0.02)
    for s in socks:
        s.close()
    time.sleep(0.2)  # the server notices the closed connections
    stream.close()
    waited = _alive(server, client, local)
    # Either queued request, had it run, would take ~480 tokens before this one starts.
    assert waited < 3 * alone + 1.0, (waited, alone)


# ----- the command line ----------------------------------------------------------------
def test_bad_command_line_fails_cleanly(q4_1_path, tmp_path):
    for args, needle in ((["--port", "70000"], "port"), (["--preset", "fast"], "preset")):
        r = subprocess.run(_serve_cmd(q4_1_path, "--port", str(_free_port()), *args), env=_env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "river-gguf: error:" in r.stderr and needle in r.stderr, r.stderr


# ----- one text surface: the CLI, Llama and the server ---------------------------------------
def test_cli_llama_and_server_sample_the_same_text(server, client, local, q4_1_path, tmp_path):
    """At temperature > 0 with a seed, `river-gguf generate`, an in-process Llama and the server
    run the same sampler chain on the same logits: the same text, token for token."""
    kw = dict(max_tokens=24, temperature=0.9, seed=7)
    want = local.create_completion(PROMPT, **kw)["choices"][0]["text"]
    assert want != local.create_completion(PROMPT, **{**kw, "seed": 8})["choices"][0]["text"] or \
        want != local.create_completion(PROMPT, **{**kw, "seed": 9})["choices"][0]["text"], \
        "three seeds gave one text: the check below would not see a sampler that ignores the seed"
    r = client.completions.create(model=ALIAS, prompt=PROMPT, **kw)
    assert r.choices[0].text == want
    cli = subprocess.run([sys.executable, "-m", "river_gguf.cli", "generate", q4_1_path, "-p", PROMPT, "-n", "24",
                          "--temp", "0.9", "--seed", "7", "-c", str(N_CTX), "-t", "1"],
                         env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == want + "\n"
    chat = dict(max_tokens=16, temperature=0.9, seed=3)
    want_chat = local.create_chat_completion(CHAT, **chat)["choices"][0]["message"]["content"]
    got = client.chat.completions.create(model=ALIAS, messages=CHAT, **chat).choices[0].message.content
    assert got == want_chat


def test_chat_template_limits_guard_the_server(tmp_path):
    """A file whose chat template never ends: the server answers 400 naming the limit, in about
    the time limit, and keeps serving."""
    from river_gguf import chat
    from river_gguf.gguf.meta import set_river_metadata
    from river_gguf.eval.random_model import write_tiny_model

    path = write_tiny_model(tmp_path / "hostile.gguf", "llama", n_layer=2)
    endless_loop = "{% for i in range(10**5) %}{% for j in range(10**5) %}{{ '' }}{% endfor %}{% endfor %}"
    set_river_metadata(path, {"tokenizer.chat_template": endless_loop})
    with _running_server([str(path), "--threads", "1", "--n-ctx", "64", "--parallel", "1", "--log-level", "warning"],
                         tmp_path) as s:
        t0 = time.monotonic()
        status, body = _http(s.base, "POST", "/v1/chat/completions",
                             {"messages": CHAT, "max_tokens": 2}, key=None)
        assert status == 400, body
        assert "limit" in json.dumps(body)
        assert time.monotonic() - t0 < chat.MAX_RENDER_SECONDS + 10
        status, _ = _http(s.base, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, key=None)
        assert status == 200  # the server still serves


@pytest.mark.parametrize("max_tokens,refused", [(-5, True), (-1, True), (0, False), (16, False)])
def test_completion_max_tokens_is_refused_where_llama_cpp_server_refuses_it(max_tokens, refused):
    # llama-cpp-python's server validates a completion request with its own schema; ours refuses
    # the same values (OpenAI's 400 where FastAPI's default would say 422; the error names the field).
    def refuses(model) -> bool:
        try:
            model(prompt="x", max_tokens=max_tokens)
        except ValidationError:
            return True
        return False

    assert refuses(CreateCompletionRequest) == refused
    assert refuses(CompletionRequest) == refused
