"""One Model from many threads: calls are serialized by the Model's lock and return what they
return alone; a Llama's stream whose cache another thread takes recomputes it; never a crash. Two Models run in parallel. The hammering runs in a subprocess, so a crash
(it was SIGSEGV, or "tensor read out of bounds") fails the test instead of killing pytest."""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.eval.random_model import write_tiny_model

TIMEOUT_S = 300

# Threads against each other: on a core of its own, not beside another xdist worker.
pytestmark = pytest.mark.alone


@pytest.fixture(scope="module")
def tiny_path(tiny):
    return tiny.model("llama", n_layer=4, seed=11)


def _run_script(script: str, *args) -> dict:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
                       capture_output=True, text=True, timeout=TIMEOUT_S, env=dict(os.environ))
    assert p.returncode == 0, f"the subprocess died (rc {p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


HAMMER = r"""
import json, random, sys, threading, time
import numpy as np
from river_gguf import Model
from river_gguf.greedy import greedy
from river_gguf.measure.teacher import score
from river_gguf.measure.traces import similarity_trace

path, n_threads, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = Model(path, river=path, n_ctx=96, n_threads=1, threshold=0.5)
prompts = [[1, 100 + 37 * i, 2000 + 11 * i, 300, 45 + i] for i in range(4)]
modes = ["river", "backbone", "river-only"]
jobs = []
for i, p in enumerate(prompts):
    mode = modes[i % 3]
    jobs += [("greedy", p, mode), ("logits", p, mode), ("score", p, mode), ("trace", p, mode)]

def run(job):
    kind, p, mode = job
    if kind == "greedy":
        return greedy(m, p, 6, mode=mode).tokens
    if kind == "logits":
        return m.logits(p, mode=mode).tobytes().hex()
    if kind == "score":
        return score(m, p + [5, 6, 7], prefix=2, mode=mode).logprobs.tobytes().hex()
    return similarity_trace(m, p, mode=mode)

reference = [run(j) for j in jobs]
assert any(r != reference[0] for r in reference[1:])  # the jobs differ, so equality means something
out = {"ok": 0, "mismatch": [], "errors": []}
lock = threading.Lock()

def worker(tid):
    rng = random.Random(tid)
    for _ in range(rounds):
        order = list(range(len(jobs)))
        rng.shuffle(order)
        for j in order:
            try:
                got = run(jobs[j])
            except Exception as e:
                with lock:
                    out["errors"].append(f"{jobs[j][0]}: {type(e).__name__}: {e}")
                continue
            with lock:
                if got == reference[j]:
                    out["ok"] += 1
                else:
                    out["mismatch"].append(jobs[j][:1] + (j,))

threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


def test_one_model_hammered_from_four_threads(tiny_path):
    rounds = 3
    res = _run_script(HAMMER, tiny_path, 4, rounds)
    assert res == {"ok": 4 * rounds * 16, "mismatch": [], "errors": []}


LLAMA_AND_MODEL = r"""
import json, sys, threading
from river_gguf import Llama

path = sys.argv[1]
llm = Llama(path, n_ctx=96, n_threads=1, verbose=False)
m = llm.river_model
prompt = [1, 500, 77, 9000]
alone = llm.create_completion(prompt, max_tokens=12, temperature=0.8, seed=5)["choices"][0]["text"]
stop = threading.Event()
calls = [0]

def other():  # another thread keeps taking the Model's KV cache
    while not stop.is_set():
        m.logits([1, 2, 3, 4, 5])
        calls[0] += 1

out = {"same": 0, "bad": []}
t = threading.Thread(target=other)
t.start()
try:
    for _ in range(5):
        chunks = llm.create_completion(prompt, max_tokens=12, temperature=0.8, seed=5, stream=True)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        if text == alone: out["same"] += 1
        else: out["bad"].append(text)
finally:
    stop.set()
    t.join()
out["other_calls"] = calls[0]
print(json.dumps(out))
"""


def test_a_llama_stream_beside_calls_on_its_model_from_another_thread(tiny_path):
    """River_gguf.Llama shares its Model's lock and checks the Model's epoch before each step:
    a thread that keeps using the Model's cache costs the stream a recompute, never a wrong text."""
    res = _run_script(LLAMA_AND_MODEL, tiny_path)
    assert res["bad"] == [] and res["same"] == 5
    assert res["other_calls"] > 0


TWO_MODELS = r"""
import json, sys, threading
from river_gguf import Model
from river_gguf.greedy import greedy

path_a, path_b = sys.argv[1], sys.argv[2]
models = [Model(path_a, n_ctx=96, n_threads=1), Model(path_b, river=path_b, n_ctx=96, n_threads=1, threshold=0.5)]
prompt = [1, 610, 42, 3000]
alone = [greedy(m, prompt, 10).tokens for m in models]
assert alone[0] != alone[1]
res = {"bad": [], "ok": 0}

def worker(i):
    for _ in range(10):
        got = greedy(models[i], prompt, 10).tokens
        if got == alone[i]: res["ok"] += 1
        else: res["bad"].append(i)

threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(res))
"""


def test_two_models_in_two_threads(tiny_path, tmp_path):
    other = write_tiny_model(tmp_path / "other.gguf", "qwen2", n_layer=3, seed=4)
    res = _run_script(TWO_MODELS, tiny_path, other)
    assert res == {"bad": [], "ok": 20}


def test_the_lock_is_per_model(tiny_path):
    a = Model(tiny_path, n_ctx=64, n_threads=1)
    b = Model(tiny_path, n_ctx=64, n_threads=1)
    done = {}
    with a.lock:  # as if a long call on `a` were running in another thread
        tb = threading.Thread(target=lambda: done.setdefault("b", greedy(b, [1, 2, 3], 4)))
        ta = threading.Thread(target=lambda: done.setdefault("a", greedy(a, [1, 2, 3], 4)))
        n_past = a.n_past
        tb.start(), ta.start()
        tb.join(60)
        assert not tb.is_alive() and "b" in done  # b does not wait for a
        time.sleep(0.2)
        assert "a" not in done and a.n_past == n_past  # a's second call waits for the lock
    ta.join(60)
    assert done["a"].tokens == done["b"].tokens


def test_native_eval_releases_the_gil(q4_1_path):
    """While one thread is inside a long native eval, another thread keeps running Python."""
    m = Model(q4_1_path, n_ctx=512, n_threads=1)
    toks = m.tokenize("The river rose in the hills above the town. " * 30)[:400]
    span = {}

    def work():
        span["t0"] = time.perf_counter()
        m.logits(toks)
        span["t1"] = time.perf_counter()

    t = threading.Thread(target=work)
    stamps = []
    t.start()
    while t.is_alive():
        stamps.append(time.perf_counter())
    t.join()
    inside = [s for s in stamps if span["t0"] < s < span["t1"]]
    duration = span["t1"] - span["t0"]
    assert duration > 0.05, "the eval was too short to tell"
    # Holding the GIL through the eval would leave one gap as long as the eval itself.
    points = [span["t0"]] + inside + [span["t1"]]
    longest_gap = max(b - a for a, b in zip(points, points[1:]))
    assert longest_gap < 0.5 * duration, (longest_gap, duration)
