"""The server's slots: N model objects, each with its own thread, requests taking a free one and
waiting in arrival order for one when all are busy; /health and /slots report them.

Fake slot objects make the timing controllable: each token step of a request can wait on a gate
the test opens, or on a barrier that only two requests computing at once can pass. Every wait
has a bound, so a server that serialised the slots, lost a request or hung fails within seconds.
The last test runs two slots of one real Llama on the smallest model side by side."""
import asyncio
import contextlib
import json
import socket
import threading
import time

import urllib.error
import urllib.request

import pytest
import uvicorn

from river_gguf.serve.app import create_app
from river_gguf.serve.loading import LOADING, LoadingGate
from river_gguf.serve.settings import ServerSettings
from river_gguf.serve.worker import PROMPT_SIMILARITY, ClientGone, ModelWorker, common_prefix, prompt_key

BOUND = 10.0  # seconds any one wait in these tests may take before it counts as a hang
SLOT_N_CTX = 64


class Board:
    """What the fake slots share with the test: gates that hold a prompt's token steps, a barrier
    its steps may have to pass, and a record of who ran where."""

    def __init__(self):
        self.lock = threading.Lock()
        self.started = []   # (prompt, slot id, thread name) in the order calls started
        self.closed = []    # prompts whose generator was closed before its end
        self.gates = {}     # prompt -> (token index from which it waits, threading.Event)
        self.barrier = None  # every step of a prompt in barrier_prompts waits here
        self.barrier_prompts = ()

    def hold(self, prompt, from_token=0) -> threading.Event:
        gate = threading.Event()
        self.gates[prompt] = (from_token, gate)
        return gate

    def step(self, prompt, i):
        if prompt in self.barrier_prompts:
            self.barrier.wait()  # BrokenBarrierError unless the partner runs at once
        held = self.gates.get(prompt)
        if held is not None and i >= held[0] and not held[1].wait(timeout=BOUND):
            raise RuntimeError(f"gate for {prompt!r} never opened")


def token_text(prompt, i):
    return f"[{prompt}:{i}]"


def expected_text(prompt, n):
    return "".join(token_text(prompt, i) for i in range(n))


class FakeSlot:
    """A Llama-shaped slot: one token per step, each step's text naming its prompt; n_tokens as
    llama_cpp keeps it (the prompt, then every decoded token but the newest)."""

    model_path = "/models/fake.gguf"

    def __init__(self, slot_id, board):
        self.slot_id = slot_id
        self.board = board
        self.n_tokens = 0

    def tokenize(self, text, add_bos=True, special=False):
        return list(text)

    def n_ctx(self):
        return SLOT_N_CTX

    def _tokens(self, prompt, max_tokens):
        with self.board.lock:
            self.board.started.append((prompt, self.slot_id, threading.current_thread().name))
        try:
            for i in range(max_tokens):
                self.board.step(prompt, i)
                self.n_tokens = len(prompt) + i
                yield token_text(prompt, i)
        except GeneratorExit:
            with self.board.lock:
                self.board.closed.append(prompt)
            raise

    def create_completion(self, prompt, max_tokens=4, stream=False, temperature=0.8):
        texts = self._tokens(prompt, max_tokens)
        if stream:
            return ({"object": "text_completion", "model": self.model_path,
                     "choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in texts)
        text = "".join(texts)
        return {"object": "text_completion", "model": self.model_path,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                          "total_tokens": len(prompt) + max_tokens}}

    def create_chat_completion(self, messages, max_tokens=4, stream=False, temperature=0.8):
        raise NotImplementedError  # not served in these tests


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(slots):
    """create_app(slots) (or an ASGI app) under uvicorn on a thread of this process; its base URL."""
    port = _free_port()
    app = slots if isinstance(slots, LoadingGate) else create_app(slots, ServerSettings("fake", port=port))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + BOUND
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        first = slots[0] if isinstance(slots, list) else slots
        for _, gate in getattr(first, "board", Board()).gates.values():
            gate.set()  # nothing left waiting on a gate keeps the server from stopping
        server.should_exit = True
        thread.join(timeout=BOUND)


# Straight to 127.0.0.1: a proxy set in the environment must not carry these requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _open(base, path, body=None):
    """The response to one request (an HTTPError is a response too)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        return _OPENER.open(req, timeout=BOUND)
    except urllib.error.HTTPError as e:
        return e


def post(base, path, body):
    with _open(base, path, body) as r:
        return r.status, json.loads(r.read())


def complete(base, prompt, max_tokens=4):
    status, body = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
    assert status == 200, body
    return body["choices"][0]["text"]


@contextlib.contextmanager
def stream(base, prompt, max_tokens=4, **body):
    """An open streaming request: yields an iterator of its chunks' texts (closing the context
    drops the connection)."""
    body = dict(body, prompt=prompt, max_tokens=max_tokens, stream=True)
    with _open(base, "/v1/completions", body) as r:
        assert r.status == 200

        def texts():
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])["choices"][0]["text"]

        yield texts()


def get(base, path):
    with _open(base, path) as r:
        return r.status, json.loads(r.read())


def wait_until(what, condition):
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def in_threads(*calls):
    """Run each call on a thread of its own; their results in order (an exception re-raised)."""
    results = [None] * len(calls)

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * BOUND)
        assert not t.is_alive(), "a request never returned"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture
def board():
    return Board()


def fake_slots(board, n):
    return [FakeSlot(i, board) for i in range(n)]


# ----- concurrency -----------------------------------------------------------------------
def test_two_requests_compute_at_once_on_two_slots(board):
    """Every token step of both requests waits at a two-party barrier: they pass only if the two
    compute at the same time, on different slots and threads."""
    board.barrier, board.barrier_prompts = threading.Barrier(2, timeout=BOUND), ("left", "right")
    with serving(fake_slots(board, 2)) as base:
        got = in_threads(lambda: complete(base, "left"), lambda: complete(base, "right"))
    assert got == [expected_text("left", 4), expected_text("right", 4)]
    slots = {p: (s, t) for p, s, t in board.started}
    assert slots["left"][0] != slots["right"][0] and slots["left"][1] != slots["right"][1]


def test_one_slot_serialises_requests(board):
    """The same barrier with one slot: the second request waits for the first, which waits at the
    barrier for it, so the first fails (broken barrier) instead of the two running interleaved."""
    board.barrier, board.barrier_prompts = threading.Barrier(2, timeout=0.5), ("left", "right")
    with serving(fake_slots(board, 1)) as base:
        codes = [status for status, _ in in_threads(lambda: post(base, "/v1/completions", {"prompt": "left"}),
                                                    lambda: post(base, "/v1/completions", {"prompt": "right"}))]
    assert 500 in codes  # at least one request met the barrier alone
    assert len({t for _, _, t in board.started}) == 1


def test_requests_wait_for_a_slot_in_arrival_order(board):
    """Both slots held by streams; three more requests queue; each freed slot goes to the oldest."""
    gates = {p: board.hold(p, from_token=1) for p in ("hold0", "hold1")}
    with serving(fake_slots(board, 2)) as base, stream(base, "hold0") as s0, stream(base, "hold1") as s1:
        assert next(s0) == token_text("hold0", 0) and next(s1) == token_text("hold1", 0)
        results, threads = {}, []
        for i, prompt in enumerate(("first", "second", "third")):
            t = threading.Thread(target=lambda p=prompt: results.__setitem__(p, complete(base, p)))
            t.start()
            threads.append(t)
            wait_until(f"{prompt} to queue", lambda i=i: get(base, "/health")[1]["waiting"] == i + 1)
        assert [p for p, _, _ in board.started] == ["hold0", "hold1"]  # nothing ran yet
        gates["hold1"].set()
        assert list(s1) == [token_text("hold1", i) for i in range(1, 4)]
        wait_until("the queue to drain", lambda: len(results) == 3)
        assert [p for p, _, _ in board.started] == ["hold0", "hold1", "first", "second", "third"]
        gates["hold0"].set()
        assert list(s0) == [token_text("hold0", i) for i in range(1, 4)]
        for t in threads:
            t.join(timeout=BOUND)
    assert results == {p: expected_text(p, 4) for p in ("first", "second", "third")}


def test_a_cancelled_stream_frees_its_slot_and_leaves_the_other_intact(board):
    gate_a = board.hold("a", from_token=2)
    gate_b = board.hold("b", from_token=2)
    with serving(fake_slots(board, 2)) as base:
        with stream(base, "b", max_tokens=6) as sb:
            got_b = [next(sb), next(sb)]
            with stream(base, "a", max_tokens=6) as sa:
                assert [next(sa), next(sa)] == [token_text("a", 0), token_text("a", 1)]
            # The client of "a" is gone. Its step in flight (held at the gate) ends, then its
            # generator is closed on its slot's thread and the slot is free again, while "b" is
            # still held at its gate.
            gate_a.set()
            wait_until("a's generator to close", lambda: board.closed == ["a"])
            wait_until("a's slot to be free", lambda: get(base, "/health")[1]["slots_processing"] == 1)
            assert complete(base, "c") == expected_text("c", 4)  # served on the freed slot
            gate_b.set()
            got_b += list(sb)
    assert "".join(got_b) == expected_text("b", 6)
    assert board.closed == ["a"]


def test_requests_whose_clients_left_while_queued_never_run(board):
    """On the worker itself: with its one slot busy, a queued request that is cancelled, and one
    whose client is gone by its turn, compute nothing; the next request gets the slot."""

    async def scenario():
        worker = ModelWorker(fake_slots(board, 1))
        gate = board.hold("first")
        first = asyncio.ensure_future(worker.call("create_completion", {"prompt": "first"}))
        await asyncio.wait_for(_until(lambda: worker.busy), BOUND)
        cancelled = asyncio.ensure_future(worker.call("create_completion", {"prompt": "cancelled"}))

        async def gone():
            return True

        left = asyncio.ensure_future(worker.call("create_completion", {"prompt": "left"}, gone=gone))
        last = asyncio.ensure_future(worker.call("create_completion", {"prompt": "last"}))
        await asyncio.wait_for(_until(lambda: worker.waiting == 3), BOUND)
        cancelled.cancel()
        await asyncio.wait_for(_until(lambda: worker.waiting == 2), BOUND)
        gate.set()
        texts = await asyncio.wait_for(asyncio.gather(first, last), BOUND)
        with pytest.raises(ClientGone):
            await left
        worker.shutdown()
        return [t["choices"][0]["text"] for t in texts]

    assert asyncio.run(scenario()) == [expected_text("first", 4), expected_text("last", 4)]
    assert [p for p, _, _ in board.started] == ["first", "last"]


async def _until(condition):
    while not condition():
        await asyncio.sleep(0.005)


# ----- slot choice ---------------------------------------------------------------------
def test_a_request_takes_the_free_slot_with_its_prompt_prefix(board):
    with serving(fake_slots(board, 3)) as base:
        for prompt in ("The capital of France", "def fib(n):", "1, 2, 3, 4",
                       "def fib(n): return", "The capital of France is"):
            complete(base, prompt)
    slot_of = {p: s for p, s, _ in board.started}
    assert len({slot_of["The capital of France"], slot_of["def fib(n):"], slot_of["1, 2, 3, 4"]}) == 3
    assert slot_of["def fib(n): return"] == slot_of["def fib(n):"]
    assert slot_of["The capital of France is"] == slot_of["The capital of France"]


def test_prompt_keys_and_their_prefixes():
    chat = prompt_key({"messages": [{"role": "user", "content": "hi"}]})
    longer = prompt_key({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    assert common_prefix(chat, longer) == len(chat)
    assert prompt_key({"prompt": [1, 2, 3]}) == (1, 2, 3)
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix("abc", (97, 98)) == 0  # text and token ids never share a prefix
    assert 0 < PROMPT_SIMILARITY < 1


# ----- /health and /slots ---------------------------------------------------------------
def test_health_and_slots_report_each_slot(board):
    gate = board.hold("busy prompt", from_token=3)
    with serving(fake_slots(board, 2)) as base:
        status, slots = get(base, "/slots")
        assert status == 200
        assert slots == [{"id": i, "n_ctx": SLOT_N_CTX, "speculative": False, "is_processing": False}
                         for i in range(2)]
        with stream(base, "busy prompt", max_tokens=8) as s:
            assert [next(s) for _ in range(3)] == [token_text("busy prompt", i) for i in range(3)]
            _, health = get(base, "/health")
            assert health == {"status": "ok", "model": "fake", "slots_idle": 1, "slots_processing": 1,
                              "busy": True, "waiting": 0}
            _, slots = get(base, "/slots")
            busy = next(s for s in slots if s["is_processing"])
            assert busy["n_prompt_tokens"] == len("busy prompt") and busy["n_ctx"] == SLOT_N_CTX
            assert busy["next_token"] == [{"has_next_token": True, "n_decoded": 3}]
            assert get(base, "/slots?fail_on_no_slot=1")[0] == 200
            gate.set()
            assert len(list(s)) == 5
        complete(base, "abc", max_tokens=2)
        wait_until("both slots idle", lambda: get(base, "/health")[1]["slots_idle"] == 2)
        _, slots = get(base, "/slots")
        done = {s["id"]: s for s in slots}
        counts = sorted((s["n_prompt_tokens"], s["next_token"][0]["n_decoded"]) for s in done.values())
        assert counts == [(3, 2), (len("busy prompt"), 8)]
        assert not any(s["is_processing"] for s in slots)


def test_slots_answers_503_when_every_slot_is_busy(board):
    gate = board.hold("only", from_token=1)
    with serving(fake_slots(board, 1)) as base, stream(base, "only") as s:
        next(s)
        status, body = get(base, "/slots?fail_on_no_slot=1")
        assert status == 503 and body["error"]["message"] == "no slot available"
        gate.set()
        list(s)


def test_create_app_takes_a_model_or_a_list_of_slots(board):
    with pytest.raises(ValueError, match="at least one slot"):
        create_app([], ServerSettings("fake"))
    with pytest.raises(TypeError, match="cannot be served"):
        create_app([FakeSlot(0, board), object()], ServerSettings("fake"))
    with serving(FakeSlot(0, board)) as base:  # one model object: one slot
        assert [s["id"] for s in get(base, "/slots")[1]] == [0]


# ----- real models ---------------------------------------------------------------------
def test_two_slots_of_one_model_serve_two_requests_at_once(tiny):
    """serve's slots (served_model.make_slots: two sequences of one loaded model, their decode
    steps batched): two greedy streams at once each get the text the same request gets alone,
    and /slots counts what each decoded."""
    from river_gguf import Llama
    from river_gguf.serve.served_model import make_slots

    path = tiny.model("llama")
    llama = Llama(path, n_ctx=128, n_threads=1, flash_attn=True, verbose=False)
    slots = make_slots(llama, 2, 64)
    assert [s.n_ctx() for s in slots] == [64, 64]
    prompts, n = ("one two three", "alpha beta"), 12
    with serving(slots) as base:
        alone = {p: complete_json(base, p, n) for p in prompts}

        def streamed(p):
            with stream(base, p, max_tokens=n, temperature=0) as s:
                return "".join(s)

        together = in_threads(*(lambda p=p: streamed(p) for p in prompts))
        _, slots = get(base, "/slots")
    assert together == [alone[p]["choices"][0]["text"] for p in prompts]
    # The two streams ran on both slots; each slot's counts are its request's usage.
    usage = sorted((a["usage"]["prompt_tokens"], a["usage"]["completion_tokens"]) for a in alone.values())
    assert sorted((s["n_prompt_tokens"], s["next_token"][0]["n_decoded"]) for s in slots) == usage


def complete_json(base, prompt, max_tokens):
    status, body = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return body


# ----- the command line ----------------------------------------------------------------
def test_the_server_answers_loading_until_the_model_is_ready(board):
    gate = LoadingGate()
    with serving(gate) as base:
        for path in ("/health", "/slots", "/v1/models"):
            assert get(base, path) == (503, LOADING)
        assert post(base, "/v1/completions", {"prompt": "x"}) == (503, LOADING)
        gate.open(create_app(fake_slots(board, 1), ServerSettings("fake")))
        assert get(base, "/health")[1]["status"] == "ok"
        assert complete(base, "x") == expected_text("x", 4)


def test_slot_context_splits_as_llama_cpp_does():
    from river_gguf.serve.served_model import slot_context

    assert slot_context(2048, 4, unified=True) == (2048, 2048)    # one pool, any slot may fill it
    assert slot_context(2048, 4, unified=False) == (512, 2048)
    assert slot_context(2048, 3, unified=False) == (768, 2304)    # 682 rounded up to 256s
    assert slot_context(100, 1, unified=False) == (100, 100)
    with pytest.raises(ValueError, match="cannot be split"):
        slot_context(2, 3, unified=False)
    with pytest.raises(ValueError, match="slots"):
        slot_context(512, 0, unified=True)


def test_serve_makes_its_slots_as_llama_server_sizes_them(tiny, monkeypatch):
    """`river-gguf serve` without --parallel asks for llama-server's 4 slots over one context;
    --parallel N splits it; --parallel 1 serves the Llama itself."""
    from river_gguf import cli
    from river_gguf.serve import served_model

    asked, apps = [], []

    def make_slots(llama, n_slots, slot_n_ctx):
        asked.append((n_slots, slot_n_ctx, llama.n_ctx()))
        return [llama] * n_slots  # enough to build the app, which is never run here

    def run(server, sockets=None):  # uvicorn.Server.run: wait for the load instead of serving
        deadline = time.monotonic() + BOUND
        while not server.config.app.is_open:
            assert not server.should_exit and time.monotonic() < deadline, "the model never loaded"
            time.sleep(0.01)
        apps.append(server.config.app.app)

    monkeypatch.setattr(served_model, "make_slots", make_slots)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    path = tiny.model("llama")
    for extra in ([], ["--parallel", "3", "-c", "2048"], ["--parallel", "1"]):
        assert cli.main(["serve", path, "--threads", "1", "-c", "512", *extra]) == 0
    assert asked == [(4, 512, 512), (3, 768, 2304)]
    assert [len(app.state.worker.slots) for app in apps] == [4, 3, 1]


def test_serve_refuses_slot_counts_it_cannot_make(tiny, capsys):
    from river_gguf import cli

    path = tiny.model("llama")
    for args, needle in ((["--parallel", "0"], "--parallel must be at least 1"),
                         (["--parallel", "3", "-c", "2"], "cannot be split among 3 slots")):
        assert cli.main(["serve", path, *args]) == 2
        assert needle in capsys.readouterr().err
