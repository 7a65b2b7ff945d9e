"""Random models with a small vocabulary, for the lossless tests that run many short generations:
with SmolLM2's 49152 tokens a sampler pass over the vocabulary costs more than a tiny model's
whole step, and a distribution over the next tokens has too many cells to test.

The vocabulary is byte-level BPE ("gpt2", which llama.cpp and the engine both load): an end of
text token (id 0, also BOS and EOS), newline and space (llama.cpp's loader needs a newline), then
lowercase letters and strings of them, with and without a leading space, so that a grammar over
letters and spaces has every token but the first two to choose from."""
from __future__ import annotations

import contextlib
import itertools
import os
import string

import gguf
import numpy as np

from river_gguf.eval.random_model import write_tiny_model
from river_gguf.gguf.io import atomic_output, metadata_items
from river_gguf.gguf.reader import GGUFReader

from support import package_digest

EOS = 0
_SPACE = "\u0120"  # byte-level BPE's piece for " "


def _pieces(n: int) -> list:
    """n distinct token pieces after the three fixed ones: letters, then longer strings, each
    also after a space."""
    out = []
    for length in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            word = "".join(letters)
            out += [word, _SPACE + word]
            if len(out) >= n:
                return out[:n]


def write_small_vocab_model(path: str | os.PathLike, n_vocab: int, arch: str = "qwen2", **kw) -> str:
    """write_tiny_model(arch, **kw) with a vocabulary of n_vocab tokens (at least 8): the same
    layers, the token embedding and output head cut to the vocabulary's rows."""
    if n_vocab < 8:
        raise ValueError(f"n_vocab must be at least 8, got {n_vocab}")
    wide = f"{os.fspath(path)}.wide"
    write_tiny_model(wide, arch, **kw)
    try:
        r = GGUFReader(wide)
        skip = [k for k in r.fields if k.startswith("tokenizer.")] + [f"{arch}.vocab_size"]
        with atomic_output(path) as tmp, contextlib.closing(gguf.GGUFWriter(tmp, arch)) as w:
            for key, value, vtype, sub_type in metadata_items(r, skip):
                w.add_key_value(key, value, vtype, sub_type=sub_type)
            w.add_uint32(f"{arch}.vocab_size", n_vocab)
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre("default")
            w.add_token_list(["<|endoftext|>", "\u010a", _SPACE] + _pieces(n_vocab - 3))
            w.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (n_vocab - 1))
            w.add_token_merges([f"{_SPACE} a"])
            w.add_bos_token_id(EOS)
            w.add_eos_token_id(EOS)
            w.add_add_bos_token(False)
            for t in r.tensors:
                data = np.array(t.data)
                if t.name in ("token_embd.weight", "output.weight"):
                    data = data[:n_vocab]
                w.add_tensor(t.name, data)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(wide)
    return os.fspath(path)


def small_vocab_model(built, n_vocab: int, arch: str = "qwen2", **kw) -> str:
    """write_small_vocab_model's file, built once and kept (conftest's `built` cache)."""
    options = dict(n_vocab=n_vocab, arch=arch, **kw)
    return built.get(f"small-vocab-{arch}", lambda out: write_small_vocab_model(out, n_vocab, arch, **kw),
                     options, package_digest())
