"""Loading without a memory map: RIVER_GGUF_NO_MMAP=1 reads the GGUF into memory (the fallback
used where mapping fails). The bytes are the same, so the logits must be bit-identical, and the
file must then not be mapped at all."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import river_gguf
from river_gguf import _native as native
from river_gguf.eval.random_model import write_tiny_model

from support import truncate_copy

HAS_PROC_MAPS = pathlib.Path("/proc/self/maps").is_file()

# Token ids inside the tiny models' (SmolLM2) vocabulary; no tokenizer needed for logits.
PROMPT = [1, 504, 3458, 2102, 288, 260, 4937, 30, 1073, 17]


def mappings_of(path) -> int:
    """How many regions of this process map `path` (0 where /proc is absent)."""
    if not HAS_PROC_MAPS:
        return 0
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if (line.split(None, 5) + [""] * 6)[5].strip() == real)


def run(engine, **req):
    """A prompt with logits for every token, then two single-token decode steps."""
    out = [engine.eval(PROMPT, all_logits=True, **req)[0]]
    for t in (42, 7):
        out.append(engine.eval([t], **req)[0])
    return out


def load_and_run(monkeypatch, path, river, mmap, req, **kw):
    if mmap:
        monkeypatch.delenv("RIVER_GGUF_NO_MMAP", raising=False)
    else:
        monkeypatch.setenv("RIVER_GGUF_NO_MMAP", "1")
    before = mappings_of(path)
    engine = native.Engine(path, river, n_ctx=64, n_threads=1, **kw)
    mapped_regions = mappings_of(path) - before
    logits = run(engine, **req)
    del engine
    return logits, mapped_regions


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("file_map")
    write_tiny_model(d / "llama.gguf", "llama", n_layer=2, seed=3)
    write_tiny_model(d / "qwen2.gguf", "qwen2", n_layer=2, dtype="f16", seed=4)
    return d


CASES = {
    # name: (model, uses itself as river, request, engine options)
    "llama-f32": ("llama.gguf", False, {}, {}),
    "llama-f32-no-repack": ("llama.gguf", False, {}, {"repack": False}),
    # layer 1 from the river file, which is loaded (and mapped or read) a second time
    "qwen2-f16-river": ("qwen2.gguf", True, {"mode": 3, "exit_layer": 0}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_read_fallback_gives_identical_logits_tiny(monkeypatch, tiny_dir, case):
    name, with_river, req, kw = CASES[case]
    path = str(tiny_dir / name)
    river = path if with_river else ""
    mapped, n_mapped = load_and_run(monkeypatch, path, river, True, req, **kw)
    read, n_read = load_and_run(monkeypatch, path, river, False, req, **kw)
    for a, b in zip(mapped, read):
        assert np.isfinite(a).all()
        assert np.array_equal(a, b)
    if HAS_PROC_MAPS:
        assert n_mapped >= (2 if with_river else 1)  # the mapping was really used...
        assert n_read == 0  # ...and the fallback really did not map


@pytest.mark.parametrize("repack", [True, False])
def test_read_fallback_gives_identical_logits_smollm2_q4_0(monkeypatch, q4_0_path, repack):
    mapped, n_mapped = load_and_run(monkeypatch, q4_0_path, "", True, {}, repack=repack)
    read, n_read = load_and_run(monkeypatch, q4_0_path, "", False, {}, repack=repack)
    for a, b in zip(mapped, read):
        assert np.isfinite(a).all()
        assert np.array_equal(a, b)
    if HAS_PROC_MAPS:
        assert n_mapped >= 1 and n_read == 0


def test_no_mmap_zero_means_mapping_on(monkeypatch, tiny_dir):
    if not HAS_PROC_MAPS:
        pytest.skip("needs /proc/self/maps to see whether the file is mapped")
    path = str(tiny_dir / "llama.gguf")
    monkeypatch.setenv("RIVER_GGUF_NO_MMAP", "0")
    before = mappings_of(path)
    engine = native.Engine(path, "", n_ctx=64, n_threads=1)
    assert mappings_of(path) > before
    del engine


@pytest.mark.parametrize("mmap", [True, False])
def test_bad_files_raise_clear_errors_either_way(monkeypatch, tmp_path, tiny_dir, mmap):
    if mmap:
        monkeypatch.delenv("RIVER_GGUF_NO_MMAP", raising=False)
    else:
        monkeypatch.setenv("RIVER_GGUF_NO_MMAP", "1")
    cut = truncate_copy(tiny_dir / "llama.gguf", tmp_path / "cut.gguf", keep_fraction=0.6)
    with pytest.raises(river_gguf.GGUFFormatError, match="truncated"):
        native.Engine(cut, "", n_ctx=64, n_threads=1)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(river_gguf.GGUFFormatError, match="not a GGUF"):
        native.Engine(str(tmp_path / "empty.gguf"), "", n_ctx=64, n_threads=1)
    with pytest.raises(river_gguf.GGUFFormatError, match="not a regular file"):
        native.Engine(str(tmp_path), "", n_ctx=64, n_threads=1)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
def test_a_named_pipe_is_refused_without_blocking(tmp_path):
    # Opening a FIFO for reading waits for a writer; the loader must refuse it instead.
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    with pytest.raises(river_gguf.GGUFFormatError, match="not a regular file"):
        river_gguf.Model(str(fifo), n_threads=1)


# The measurement runs in a fresh process: in the suite's own, the heap that earlier tests left
# behind can hold a free region the copy is served from, so RSS need not move.
READ_COPY_RSS = """
import json, os, sys
from river_gguf import _native as native

page = os.sysconf("SC_PAGE_SIZE")

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

base = rss()
engine = native.Engine(sys.argv[1], "", n_ctx=64, n_threads=1, repack=False)
held = rss() - base
del engine
print(json.dumps({"held": held, "freed": held - (rss() - base)}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="checks the bytes a read copy adds on Linux")
def test_read_copy_is_released_with_the_engine(q4_0_path):
    """The read copy is owned: dropping the engine frees it (RSS falls back). A file over 32 MiB,
    so that glibc always serves the copy from its own mapping and returns it on free."""
    size = os.path.getsize(q4_0_path)
    out = subprocess.run([sys.executable, "-c", READ_COPY_RSS, q4_0_path], capture_output=True, text=True,
                         check=True, env={**os.environ, "RIVER_GGUF_NO_MMAP": "1"}, cwd="/")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["held"] > 0.8 * size  # the whole file was read into memory
    assert r["freed"] > 0.8 * size  # and all of it given back


def test_model_use_mmap_false_reads_the_file_and_gives_identical_logits(q4_0_path):
    # The Model-level switch, as llama_cpp.Llama(use_mmap=False): same logits (that the file is
    # then read, not mapped, is checked on the native engine above).
    from river_gguf import Model

    toks = [1, 504, 3058, 314, 253, 1326, 30]
    mapped = Model(q4_0_path, n_ctx=64, n_threads=1).logits(toks)
    m = Model(q4_0_path, n_ctx=64, n_threads=1, use_mmap=False)
    assert np.array_equal(mapped, m.logits(toks))
    with pytest.raises(ValueError, match="use_mmap"):
        Model(q4_0_path, n_ctx=64, n_threads=1, use_mmap="no")
