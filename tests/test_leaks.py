"""No growth over many failed loads and many generations: every native resource is owned from
the moment it is created, so a load that throws half-way frees what it made.

RIVER_GGUF_FAIL_LOAD_AT=<stage> makes the engine's constructor throw at that stage (after the
CPU backend and thread pool, after weight placement, after the KV cache, at the very end), so
these loads fail late on purpose. Growth is measured after a warm-up (allocator pools, kept
graphs), against tolerances that a leak of even a tenth of what was seen before (~1.1 MB and a
memory map per failed load) would exceed many times over."""
import gc
import os
import sys

import numpy as np
import pytest

import river_gguf
from river_gguf.eval.random_model import write_tiny_model
from river_gguf.greedy import greedy

from support import THREADS, truncate_copy

# Growth of the process over many calls: alone, so another worker's load does not stretch it.
pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="measures the process through /proc/self"),
              pytest.mark.alone]

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MiB = 1 << 20


def usage() -> dict:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * PAGE
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    with open("/proc/self/status") as f:
        threads = int(next(line for line in f if line.startswith("Threads:")).split()[1])
    return {"rss": rss, "maps": maps, "fds": len(os.listdir("/proc/self/fd")), "threads": threads}


def growth(step, warmup: int, n: int) -> dict:
    for i in range(warmup):
        step(i)
    gc.collect()
    before = usage()
    for i in range(n):
        step(i)
    gc.collect()
    after = usage()
    return {k: after[k] - before[k] for k in before}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("leaks")
    return str(write_tiny_model(d / "bb.gguf", "llama", n_layer=2, seed=5))


STAGES = ("backend", "weights", "cache", "end")


def test_failed_loads_do_not_grow_the_process(monkeypatch, tmp_path, tiny):
    cut = truncate_copy(tiny, tmp_path / "cut.gguf", keep_fraction=0.7)

    def fail_once(i):
        # Mapped and read loads alike; two threads, so a leaked pool would leave a worker behind.
        if i % 2:
            monkeypatch.setenv("RIVER_GGUF_NO_MMAP", "1")
        else:
            monkeypatch.delenv("RIVER_GGUF_NO_MMAP", raising=False)
        if i % 5 == 4:
            monkeypatch.delenv("RIVER_GGUF_FAIL_LOAD_AT", raising=False)
            with pytest.raises(river_gguf.GGUFFormatError, match="truncated"):
                river_gguf.Model(cut, n_threads=THREADS, n_ctx=64)
            return
        stage = STAGES[i % 5]
        monkeypatch.setenv("RIVER_GGUF_FAIL_LOAD_AT", stage)
        river = tiny if i % 3 == 0 else None  # sometimes a second file (the river) too
        with pytest.raises(RuntimeError, match=f"stage '{stage}'"):
            river_gguf.Model(tiny, river=river, n_threads=THREADS, n_ctx=64)

    g = growth(fail_once, warmup=20, n=200)
    monkeypatch.delenv("RIVER_GGUF_FAIL_LOAD_AT", raising=False)
    monkeypatch.delenv("RIVER_GGUF_NO_MMAP", raising=False)
    print("growth over 200 failed loads:", g)
    assert g["rss"] < 24 * MiB, g  # a 1.1 MB leak per load would be ~220 MB
    assert g["maps"] <= 10, g  # a leaked mapping or thread stack per load would be +160 or more
    assert g["fds"] <= 2, g
    assert g["threads"] <= 0, g
    # The same file still loads and runs: nothing was left half-set.
    m = river_gguf.Model(tiny, n_threads=1, n_ctx=64)
    assert np.isfinite(m.logits(m.tokenize("The river"))).all()


def test_generations_do_not_grow_the_process(tiny):
    """Greedy decoding on a Model and sampled completions on a Llama (each with its sampler
    chain), in every mode: nothing per call stays behind."""
    m = river_gguf.Model(tiny, river=tiny, threshold=0.9, n_threads=1, n_ctx=128)
    llm = river_gguf.Llama(tiny, river=tiny, threshold=0.9, n_threads=1, n_ctx=128, verbose=False)
    prompts = ["The river rose", "One year the flood came early", "Every spring"]
    modes = ["backbone", "river", "river-only"]

    def generate(i):
        mode = modes[(i // 3) % 3]
        if i % 2:
            r = llm.create_completion(prompts[i % 3], max_tokens=3, temperature=0.8, seed=i, mode=mode)
            finish = r["choices"][0]["finish_reason"]
        else:
            finish = greedy(m, prompts[i % 3], max_tokens=3, mode=mode).finish_reason
        assert finish in ("length", "stop")

    g = growth(generate, warmup=100, n=1000)
    print("growth over 1000 generations:", g)
    assert g["rss"] < 8 * MiB, g  # 8 KiB per generation would already show
    assert g["maps"] <= 10, g
    assert g["fds"] <= 2, g
    assert g["threads"] <= 0, g
