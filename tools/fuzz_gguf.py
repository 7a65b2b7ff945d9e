"""Fuzzing the GGUF loader: damaged copies of tiny models, each loaded and run in a subprocess.

Every case is a function of (seed, index) alone: a damaged copy of one of a few tiny base models
(``river_gguf.eval.random_model.write_tiny_model`` for llama, qwen2 and qwen3; a River GGUF built
from the llama one)
— a truncation, flipped bytes, a hyperparameter given a wrong value or type, a tensor of another
type, shape or name, a damaged vocabulary, river tensors removed or a River GGUF given as
another model's river. Some cases use the damaged file as the river of an intact backbone.

A worker process loads each case with ``Model(...)`` and runs a short generate, a tokenized
generate, a score and, with a river, the river modes, lossless rounds and a draft on a second
sequence; the parent watches it. A case fails when the worker dies from a signal (a crash or an
abort), runs past the timeout (a hang), raises an exception river_gguf does not document, or
loads without an error although its damage is one the loader must refuse (``expect_error``). One
worker runs case after case; only a crash or a hang costs a fresh one.

    python tools/fuzz_gguf.py --cases 2000 --seed 1        # a longer run, on demand
    python tools/fuzz_gguf.py --api both                    # also through river_gguf.Llama
    python tools/fuzz_gguf.py --seed 1 --write 123 c.gguf   # one case's file, to reproduce it

Exit status 1 when any case failed; each failure is printed with its case description.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

# ----------------------------------------------------------------------------------------
# GGUF bytes: parsed just enough to rewrite a key, a tensor's description or its data.
# ----------------------------------------------------------------------------------------

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
               U64: "<Q", I64: "<q", F64: "<d"}
INT_TYPES = (U8, I8, U16, I16, U32, I32, U64, I64)
_INT_BITS = {U8: (8, False), I8: (8, True), U16: (16, False), I16: (16, True), U32: (32, False),
             I32: (32, True), U64: (64, False), I64: (64, True)}


def wrap_int(v: int, vtype: int) -> int:
    """The value a GGUF integer of `vtype` holds when `v` is written into it (two's complement)."""
    bits, signed = _INT_BITS[vtype]
    v &= (1 << bits) - 1
    return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v


def _pack_str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def pack_value(vtype: int, value) -> bytes:
    """The bytes of a value of `vtype` after its type field. Arrays: value = (elem_type, items)."""
    if vtype == STRING:
        return _pack_str(value if isinstance(value, bytes) else str(value).encode())
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(pack_value(etype, x) for x in items)
    if vtype in INT_TYPES:
        return struct.pack(_SCALAR_FMT[vtype], wrap_int(int(value), vtype))
    if vtype == BOOL:
        return struct.pack("<?", bool(value))
    return struct.pack(_SCALAR_FMT[vtype], float(value))


@dataclasses.dataclass
class Tensor:
    name: str
    dims: List[int]   # ne, innermost first
    ttype: int
    offset: int       # into the data section


RIVER_INDEX_KEYS = ("river.tensor_names", "river.tensor_types", "river.tensor_shapes", "river.tensor_offsets",
                    "river.data_size")


class Gguf:
    """A GGUF file as a list of raw key-values, tensor descriptions and its data.

    A River GGUF of format 2 (python/river_gguf/river_index.py) keeps its river's tensors out of
    the GGUF index, after the backbone's data, listed in river.tensor_* arrays: those are parsed
    into `river` (offsets from the start of `river_data`), and `tensor()`, `relayout()` and
    `remove_tensors()` treat both kinds alike; `sync_river_index()` writes the arrays back."""

    def __init__(self, version: int, kvs: List[list], tensors: List[Tensor], alignment: int, data: bytes):
        self.version, self.kvs, self.tensors, self.alignment, self.data = version, kvs, tensors, alignment, data
        self.spans: List[Tuple[int, int]] = []  # set by parse(): where scalar keys and tensor infos lie
        self.river: Optional[List[Tensor]] = None  # format 2: the river's tensors
        self.river_data = b""
        self.trailer = b""  # bytes after the river's data (padding)

    @classmethod
    def parse(cls, buf: bytes) -> "Gguf":
        if buf[:4] != b"GGUF":
            raise ValueError("not a GGUF")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        pos = 24

        def read_str(p):
            (n,) = struct.unpack_from("<Q", buf, p)
            return buf[p + 8:p + 8 + n], p + 8 + n

        def skip_value(t, p):
            if t == STRING:
                return read_str(p)[1]
            if t == ARRAY:
                et, n = struct.unpack_from("<IQ", buf, p)
                p += 12
                if et == STRING:
                    for _ in range(n):
                        (ln,) = struct.unpack_from("<Q", buf, p)
                        p += 8 + ln
                    return p
                return p + n * struct.calcsize(_SCALAR_FMT[et])
            return p + struct.calcsize(_SCALAR_FMT[t])

        kvs = []
        alignment = 32
        spans = []  # byte ranges of the scalar key-values and of the tensor descriptions
        for _ in range(n_kv):
            start = pos
            key, pos = read_str(pos)
            (t,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            end = skip_value(t, pos)
            kvs.append([key.decode("utf-8", "surrogateescape"), t, bytes(buf[pos:end])])
            if t != ARRAY:
                spans.append((start, end))
            if key == b"general.alignment" and t == U32:
                (alignment,) = struct.unpack_from("<I", buf, pos)
            pos = end
        tensors = []
        infos_start = pos
        for _ in range(n_tensors):
            name, pos = read_str(pos)
            (nd,) = struct.unpack_from("<I", buf, pos)
            dims = list(struct.unpack_from(f"<{nd}Q", buf, pos + 4))
            pos += 4 + 8 * nd
            ttype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            tensors.append(Tensor(name.decode("utf-8", "surrogateescape"), dims, ttype, offset))
        data_start = (pos + alignment - 1) // alignment * alignment
        g = cls(version, kvs, tensors, alignment, bytes(buf[data_start:]))
        g.spans = spans + [(infos_start, pos)]
        if g.kv("river.tensor_names") is not None:
            g._split_river()
        return g

    def _split_river(self) -> None:
        names = [n.decode("utf-8", "surrogateescape") for n in self.strings("river.tensor_names")]
        types = self.ints("river.tensor_types")
        shapes = self.ints("river.tensor_shapes")
        offsets = self.ints("river.tensor_offsets")
        size = self.scalar("river.data_size")
        self.river = [Tensor(n, list(shapes[4 * i:4 * i + 4]), types[i], offsets[i]) for i, n in enumerate(names)]
        start = self._backbone_end()
        self.river_data = self.data[start:start + size]
        self.trailer = self.data[start + size:]
        self.data = self.data[:start]

    def _backbone_end(self) -> int:
        end = max((t.offset + tensor_nbytes(t.ttype, t.dims) for t in self.tensors), default=0)
        return end + (-end % self.alignment)

    def clone(self) -> "Gguf":
        g = Gguf(self.version, [list(kv) for kv in self.kvs], [dataclasses.replace(t) for t in self.tensors],
                 self.alignment, self.data)
        if self.river is not None:
            g.river = [dataclasses.replace(t) for t in self.river]
        g.river_data, g.trailer = self.river_data, self.trailer
        return g

    def header(self) -> bytes:
        parts = [b"GGUF", struct.pack("<IQQ", self.version, len(self.tensors), len(self.kvs))]
        for key, t, raw in self.kvs:
            parts += [_pack_str(key.encode("utf-8", "surrogateescape")), struct.pack("<I", t), raw]
        for t in self.tensors:
            parts += [_pack_str(t.name.encode("utf-8", "surrogateescape")), struct.pack("<I", len(t.dims)),
                      struct.pack(f"<{len(t.dims)}Q", *t.dims), struct.pack("<IQ", t.ttype, t.offset)]
        head = b"".join(parts)
        return head + b"\0" * (-len(head) % self.alignment)

    def to_bytes(self) -> bytes:
        if self.river is None:
            return self.header() + self.data
        pad = b"\0" * (-len(self.data) % self.alignment)
        return self.header() + self.data + pad + self.river_data + self.trailer

    # --- keys ---
    def kv(self, key: str) -> Optional[list]:
        return next((kv for kv in self.kvs if kv[0] == key), None)

    def scalar(self, key: str):
        kv = self.kv(key)
        if kv is None or kv[1] in (STRING, ARRAY):
            return None if kv is None or kv[1] == ARRAY else _unpack_str(kv[2])
        return struct.unpack_from(_SCALAR_FMT[kv[1]], kv[2])[0]

    def set(self, key: str, vtype: int, value) -> None:
        raw = pack_value(vtype, value)
        kv = self.kv(key)
        if kv is None:
            self.kvs.append([key, vtype, raw])
        else:
            kv[1], kv[2] = vtype, raw

    def delete(self, key: str) -> None:
        self.kvs = [kv for kv in self.kvs if kv[0] != key]

    def strings(self, key: str) -> List[bytes]:
        """The items of a string array key."""
        _, t, raw = self.kv(key)
        et, n = struct.unpack_from("<IQ", raw, 0)
        assert t == ARRAY and et == STRING
        out, p = [], 12
        for _ in range(n):
            (ln,) = struct.unpack_from("<Q", raw, p)
            out.append(raw[p + 8:p + 8 + ln])
            p += 8 + ln
        return out

    def ints(self, key: str) -> List[int]:
        """The items of an integer array key."""
        _, t, raw = self.kv(key)
        et, n = struct.unpack_from("<IQ", raw, 0)
        assert t == ARRAY and et in INT_TYPES
        return list(struct.unpack_from("<%d%s" % (n, _SCALAR_FMT[et][1]), raw, 12))

    # --- tensors (the GGUF index's, then a format-2 river's) ---
    def all_tensors(self) -> List[Tensor]:
        return self.tensors + (self.river or [])

    def tensor(self, name: str) -> Optional[Tensor]:
        return next((t for t in self.all_tensors() if t.name == name), None)

    def is_indexed_river(self, t: Tensor) -> bool:
        return self.river is not None and any(r is t for r in self.river)

    def tensor_bytes(self, t: Tensor) -> bytes:
        data = self.river_data if self.is_indexed_river(t) else self.data
        return data[t.offset:t.offset + tensor_nbytes(t.ttype, t.dims)]

    def relayout(self, blobs: Dict[str, bytes]) -> None:
        """Rewrite the data with `blobs` replacing those tensors' bytes (and the river index)."""
        def lay(tensors):
            parts, off = [], 0
            for t in tensors:
                b = blobs[t.name] if t.name in blobs else self.tensor_bytes(t)
                t.offset = off
                parts += [b, b"\0" * (-len(b) % self.alignment)]
                off += len(b) + (-len(b) % self.alignment)
            return b"".join(parts)

        data = lay(self.tensors)
        if self.river is not None:
            self.river_data = lay(self.river)
            self.trailer = b""
            self.sync_river_index()
        self.data = data

    def remove_tensors(self, which: Callable[[str], bool]) -> None:
        self.tensors = [t for t in self.tensors if not which(t.name)]
        if self.river is not None:
            self.river = [t for t in self.river if not which(t.name)]
        self.relayout({})

    def sync_river_index(self) -> None:
        """Write `river` into the river.tensor_* arrays (format 2)."""
        self.set("river.tensor_names", ARRAY, (STRING, [t.name.encode("utf-8", "surrogateescape") for t in self.river]))
        self.set("river.tensor_types", ARRAY, (U32, [t.ttype for t in self.river]))
        self.set("river.tensor_shapes", ARRAY, (U64, [d for t in self.river for d in (t.dims + [1] * 4)[:4]]))
        self.set("river.tensor_offsets", ARRAY, (U64, [t.offset for t in self.river]))
        self.set("river.data_size", U64, len(self.river_data))

    def to_format1(self) -> "Gguf":
        """A copy in River format 1: the river's tensors listed in the GGUF index, no river index."""
        g = self.clone()
        if g.river is None:
            return g
        base = len(g.data) + (-len(g.data) % g.alignment)
        g.data += b"\0" * (base - len(g.data)) + g.river_data
        g.tensors += [dataclasses.replace(t, dims=_trim_dims(t.dims), offset=base + t.offset) for t in g.river]
        g.river, g.river_data, g.trailer = None, b"", b""
        for key in RIVER_INDEX_KEYS:
            g.delete(key)
        g.set("river.format_version", U32, 1)
        return g

    def river_tensors(self) -> List[Tensor]:
        """The river's tensors, in either format."""
        return self.river if self.river is not None else [t for t in self.tensors if t.name.startswith("river.")]

    def data_end(self) -> int:
        """Where the last byte of tensor data lies in the file, plus one."""
        head = len(self.header())
        if self.river is not None:
            return head + len(self.data) + (-len(self.data) % self.alignment) + len(self.river_data)
        return head + max((t.offset + tensor_nbytes(t.ttype, t.dims) for t in self.tensors), default=0)


def _trim_dims(dims: List[int]) -> List[int]:
    """Dimensions without trailing 1s (at least one), as a GGUF tensor description lists them."""
    out = list(dims)
    while len(out) > 1 and out[-1] == 1:
        out.pop()
    return out


def _unpack_str(raw: bytes) -> bytes:
    (n,) = struct.unpack_from("<Q", raw, 0)
    return raw[8:8 + n]


def _quant_sizes() -> Dict[int, Tuple[int, int]]:
    from gguf.constants import GGML_QUANT_SIZES
    return {int(t): v for t, v in GGML_QUANT_SIZES.items()}


QUANT_SIZES = _quant_sizes()


def tensor_nbytes(ttype: int, dims: List[int]) -> int:
    blck, size = QUANT_SIZES.get(ttype, (1, 0))
    n = 1
    for d in dims:
        n *= d
    return n // blck * size


# ----------------------------------------------------------------------------------------
# Base models
# ----------------------------------------------------------------------------------------

# Small enough that a case is written and loaded in milliseconds; n_embd and n_ff are
# multiples of 32 so the 32-element block quants (Q4_0, Q8_0, ...) are valid weight types.
TINY = dict(n_layer=2, n_embd=32, n_head=4, n_head_kv=2, n_ff=64, dtype="f16")
BASE_NAMES = ("llama", "qwen2", "qwen3", "river", "river1")


def build_bases(folder: str) -> Dict[str, str]:
    """Write the base models into `folder`; return name -> path."""
    from river_gguf.eval.random_model import write_tiny_model

    os.makedirs(folder, exist_ok=True)
    paths = {}
    for arch, tied in (("llama", False), ("qwen2", True), ("qwen3", False)):
        paths[arch] = write_tiny_model(os.path.join(folder, f"{arch}.gguf"), arch, tied=tied, seed=3, **TINY)
    paths["river"] = os.path.join(folder, "llama.river.gguf")
    _build_river(paths["llama"], paths["river"])
    # The same River GGUF in format 1 (river tensors in the GGUF index), which is still read.
    paths["river1"] = os.path.join(folder, "llama.river1.gguf")
    with open(paths["river"], "rb") as f:
        g = Gguf.parse(f.read())
    with open(paths["river1"], "wb") as f:
        f.write(g.to_format1().to_bytes())
    return paths


def _build_river(backbone: str, out: str) -> None:
    import contextlib
    import io

    from river_gguf.convert.build import build_river_gguf

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        build_river_gguf(backbone, out, river_type="q8_0", threshold=0.9, progress=False, imatrix=None,
                         presets=False, n_threads=1)


class Bases:
    """The base files, parsed, with what the cases need to know about them."""

    def __init__(self, paths: Dict[str, str]):
        self.paths = paths
        self.files: Dict[str, Gguf] = {}
        self.bytes: Dict[str, bytes] = {}
        self._n_tokens: Dict[str, int] = {}
        for name, p in paths.items():
            with open(p, "rb") as f:
                self.bytes[name] = f.read()
            self.files[name] = Gguf.parse(self.bytes[name])

    def arch(self, name: str) -> str:
        return self.files[name].scalar("general.architecture").decode()

    def n_tokens(self, name: str) -> int:
        if name not in self._n_tokens:
            self._n_tokens[name] = len(self.files[name].strings("tokenizer.ggml.tokens"))
        return self._n_tokens[name]


# ----------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    index: int
    kind: str
    base: str
    desc: str
    expect_error: bool
    build: Callable[[], bytes]              # the damaged file's bytes
    as_river: bool = False                  # load it as the river of the intact llama base
    river_base: Optional[str] = None        # load it with this base file as its river
    use_mmap: bool = True                   # False: the engine reads the file instead of mapping it


KINDS = (("truncate", 8), ("byteflip", 14), ("hparam", 26), ("tensor_type", 16), ("tensor_layout", 10),
         ("vocab", 12), ("river", 14))

_BAD_MATMUL = {"F64", "I8", "I16", "I32", "I64", "Q8_1", "Q8_K"}
_TYPE_POOL = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
              "Q2_K", "Q4_K", "Q6_K", "Q8_K", "IQ4_NL", "IQ2_XXS", "TQ1_0", "MXFP4")
INT_VALUES = (0, 1, 2, 3, 4, 6, 7, 8, 9, 16, 64, -1, -2, 2**31 - 1, 2**32 - 2, 2**33 + 4, 2**63 - 1, -2**63)
FLOAT_VALUES = (0.0, -0.0, -1.0, 1e-30, 0.5, 1.0, 1e30, math.nan, math.inf, -math.inf, -1e-5)
STRING_VALUES = ("", "abc", "llama", "qwen2", "none", "linear", "yarn", "llama3", "gpt2", "\u00e9t\u00e9",
                 b"\xff\xfe not UTF-8")


def _type_id(name: str) -> int:
    from gguf import GGMLQuantizationType as QT
    return int(QT[name])


def _type_name(tid: int) -> str:
    from gguf import GGMLQuantizationType as QT
    try:
        return QT(tid).name
    except ValueError:
        return f"type {tid}"


def make_case(seed: int, index: int, bases: Bases) -> Case:
    """Case `index` of the run with `seed`: the same on every machine and in every process."""
    rng = random.Random(f"river-fuzz:{seed}:{index}")
    kind = rng.choices([k for k, _ in KINDS], weights=[w for _, w in KINDS])[0]
    make = globals()[f"_case_{kind}"]
    case = make(rng, index, bases)
    case.desc = case.desc.encode("utf-8", "backslashreplace").decode()  # printable (names may hold lone surrogates)
    if rng.random() < 0.2:
        case.use_mmap = False
        case.desc += " [read, not mapped]"
    # A fifth of the plain llama cases load the damaged file as an intact backbone's river.
    if case.base == "llama" and not case.as_river and case.river_base is None and kind != "river" and rng.random() < 0.2:
        case.as_river = True
        case.desc += " [as the river of the intact llama]"
        # A river is read for its layers, hyperparameters and token list only (no head norm,
        # no tokenizer), so only a cut-off file is sure to be refused.
        case.expect_error = case.expect_error and kind == "truncate"
    return case


def _plain_base(rng) -> str:
    return rng.choice(("llama", "llama", "qwen2", "qwen3", "river", "river", "river1"))


def _case_truncate(rng, index, bases):
    base = _plain_base(rng)
    g = bases.files[base]
    size = len(bases.bytes[base])
    head = len(g.header())
    cut = rng.randrange(0, head) if rng.random() < 0.5 else rng.randrange(head, size)
    return Case(index, "truncate", base, f"{base}: cut at byte {cut} of {size}", cut < g.data_end(),
                lambda: bases.bytes[base][:cut])


def _case_byteflip(rng, index, bases):
    base = _plain_base(rng)
    size = len(bases.bytes[base])
    head = len(bases.files[base].header())
    spans = bases.files[base].spans
    n = rng.choice((1, 1, 2, 4, 8, 32))
    flips = []
    for _ in range(n):
        # Most of a header is the vocabulary, half of it string lengths that gguf refuses when
        # flipped; the hyperparameters and tensor descriptions get most flips instead.
        r = rng.random()
        if r < 0.45:
            start, end = rng.choice(spans[:-1])
        elif r < 0.65:
            start, end = spans[-1]
        elif r < 0.85:
            start, end = 0, head
        else:
            start, end = 0, size
        flips.append((rng.randrange(start, end), rng.randrange(1, 256)))

    def build():
        b = bytearray(bases.bytes[base])
        for pos, x in flips:
            b[pos] ^= x
        return bytes(b)

    return Case(index, "byteflip", base, f"{base}: xor bytes {flips[:8]}{'...' if n > 8 else ''}", False, build)


def _hparam_keys(g: Gguf, arch: str, river: bool) -> List[str]:
    keys = [k for k, t, _ in g.kvs if k.startswith(arch + ".") or (k.startswith("tokenizer.") and t != ARRAY)]
    keys += ["general.architecture", "general.alignment"]
    keys += [f"{arch}.{k}" for k in ("attention.key_length", "attention.value_length", "rope.scaling.type",
                                     "rope.scaling.factor", "rope.scale_linear", "expert_count")]
    if river:
        keys += [k for k, _, _ in g.kvs if k.startswith("river.")]
    return sorted(set(keys))


def _random_value(rng, orig):
    """A (type, value, text) for a hyperparameter: wrong values, wrong types, arrays."""
    r = rng.random()
    if r < 0.45:
        t = rng.choice(INT_TYPES)
        if isinstance(orig, int) and not isinstance(orig, bool) and rng.random() < 0.3:
            v = orig + rng.choice((-1, 1, orig, 2**32))
        else:
            v = rng.choice(INT_VALUES)
        return t, v, f"{v} as {_VT_NAMES[t]}"
    if r < 0.65:
        t = rng.choice((F32, F64))
        v = rng.choice(FLOAT_VALUES)
        return t, v, f"{v} as {_VT_NAMES[t]}"
    if r < 0.7:
        v = rng.random() < 0.5
        return BOOL, v, f"bool {v}"
    if r < 0.8:
        v = rng.choice(STRING_VALUES)
        return STRING, v, f"string {v!r}"
    arrays = [
        ((I32, [orig] * 2), "int32 array of the value") if isinstance(orig, int) else ((I32, [1, 2]), "int32 [1, 2]"),
        ((I32, [4, 8]), "int32 [4, 8]"),
        ((STRING, [b"64", b"64"]), "string array"),
        ((F32, [1.0, 2.0]), "float32 array"),
        ((I32, []), "empty int32 array"),
        ((U64, [2**64 - 1, 2**64 - 1]), "uint64 array of 2^64-1"),
        ((I8, [-1, -1]), "int8 array of -1"),
    ]
    v, text = rng.choice(arrays)
    return ARRAY, v, text


_VT_NAMES = {U8: "u8", I8: "i8", U16: "u16", I16: "i16", U32: "u32", I32: "i32", F32: "f32", BOOL: "bool",
             STRING: "string", ARRAY: "array", U64: "u64", I64: "i64", F64: "f64"}


def _loader_int(vtype, value):
    """What the engine's integer reader makes of a key: the int, or None when it refuses."""
    if vtype in INT_TYPES:
        v = wrap_int(value, vtype)
        return None if vtype == U64 and v >= 2**63 else v
    if vtype == BOOL:
        return int(bool(value))
    return None


def _loader_ints(vtype, value):
    """get_int_array's view: a list of ints, or None when it refuses."""
    if vtype == ARRAY:
        et, items = value
        if et not in INT_TYPES or not items:
            return None
        vals = [wrap_int(x, et) for x in items]
        return None if et == U64 and any(v >= 2**63 for v in vals) else vals
    v = _loader_int(vtype, value)
    return None if v is None else [v]


def _loader_float(vtype, value):
    if vtype in (F32, F64):
        return float(np.float32(value)) if vtype == F32 else float(value)
    v = _loader_int(vtype, value) if vtype != BOOL else None
    return None if v is None else float(v)


def _hparam_must_fail(key: str, arch: str, vtype, value, deleted: bool, g: Gguf) -> bool:
    """Whether the loader must refuse the file after this change (only for keys whose rule is plain)."""
    a = arch + "."
    orig = {a + "block_count": 2, a + "embedding_length": TINY["n_embd"]}
    orig_arr = {a + "feed_forward_length": TINY["n_ff"], a + "attention.head_count": TINY["n_head"],
                a + "attention.head_count_kv": TINY["n_head_kv"]}
    if deleted:
        return key in orig or key in orig_arr or key in ("general.architecture", "tokenizer.ggml.model")
    if key in orig:
        return _loader_int(vtype, value) != orig[key]
    if key in orig_arr:
        vals = _loader_ints(vtype, value)
        return vals is None or any(v != orig_arr[key] for v in vals)
    if key == a + "rope.dimension_count":
        v = _loader_int(vtype, value)
        head_dim = TINY["n_embd"] // TINY["n_head"]
        return v is None or v % 2 == 1 or not 2 <= v <= head_dim
    if key == a + "attention.layer_norm_rms_epsilon":
        v = _loader_float(vtype, value)
        return v is None or not math.isfinite(v) or v < 0
    if key == a + "rope.freq_base":
        v = _loader_float(vtype, value)
        return v is None or not math.isfinite(v) or v <= 0
    if key == a + "context_length":
        v = _loader_int(vtype, value)
        return v is None or not 1 <= v <= 2**30
    if key == "general.architecture":
        return vtype != STRING or value not in ("llama", "qwen2", "qwen3")
    return False


def _case_hparam(rng, index, bases):
    base = _plain_base(rng)
    g = bases.files[base]
    arch = bases.arch(base)
    key = rng.choice(_hparam_keys(g, arch, base.startswith("river")))
    orig = g.scalar(key)
    if rng.random() < 0.08:
        def build():
            h = g.clone()
            h.delete(key)
            return h.to_bytes()
        return Case(index, "hparam", base, f"{base}: delete {key}", _hparam_must_fail(key, arch, None, None, True, g),
                    build)
    vtype, value, text = _random_value(rng, orig)

    def build():
        h = g.clone()
        h.set(key, vtype, value)
        return h.to_bytes()

    return Case(index, "hparam", base, f"{base}: {key} = {text}",
                _hparam_must_fail(key, arch, vtype, value, False, g), build)


def _values(g: Gguf, t: Tensor, rng: np.random.Generator) -> np.ndarray:
    """A tensor's values as float32 (dims reversed to numpy order); quantized ones are redrawn."""
    shape = tuple(reversed(t.dims))
    raw = g.tensor_bytes(t)
    if t.ttype == 0:
        return np.frombuffer(raw, dtype=np.float32).reshape(shape)
    if t.ttype == 1:
        return np.frombuffer(raw, dtype=np.float16).astype(np.float32).reshape(shape)
    return (rng.standard_normal(shape) * 0.1).astype(np.float32)


def _encode(values: np.ndarray, tname: str, rng: np.random.Generator) -> bytes:
    """`values` in ggml type `tname`: converted where the gguf package can, else random bytes."""
    import gguf.quants
    from gguf import GGMLQuantizationType as QT

    simple = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
              "I32": np.int32, "I64": np.int64}
    if tname in simple:
        scale = 1.0 if tname.startswith("F") else 50.0
        return (values * scale).astype(simple[tname]).tobytes()
    blck, size = QUANT_SIZES[_type_id(tname)]
    rows = values.reshape(-1, values.shape[-1])
    try:
        return np.ascontiguousarray(gguf.quants.quantize(rows, QT[tname])).tobytes()
    except Exception:  # not implemented in the gguf package for this type: any bytes will do
        return rng.bytes(rows.size // blck * size)


def _tensor_use(g: Gguf, t: Tensor) -> str:
    if all(d == 1 for d in t.dims[1:]):
        return "vector"
    if t.name.endswith("token_embd.weight"):
        prefix = t.name[: -len("token_embd.weight")]
        return "tied" if g.tensor(prefix + "output.weight") is None else "embedding"
    return "matmul"


def _case_tensor_type(rng, index, bases):
    base = _plain_base(rng)
    g = bases.files[base]
    t = rng.choice(g.all_tensors())
    tname = rng.choice(_TYPE_POOL)
    blck, _ = QUANT_SIZES[_type_id(tname)]
    use = _tensor_use(g, t)
    fails = t.dims[0] % blck != 0 or (use == "vector" and tname != "F32") or (use != "vector" and tname in _BAD_MATMUL)
    data_seed = rng.randrange(2**32)

    def build():
        h = g.clone()
        ht = h.tensor(t.name)
        nrng = np.random.default_rng(data_seed)
        blob = b"" if t.dims[0] % blck else _encode(_values(g, t, nrng), tname, nrng)
        ht.ttype = _type_id(tname)
        h.relayout({t.name: blob})
        return h.to_bytes()

    return Case(index, "tensor_type", base, f"{base}: {t.name} ({use}) as {tname}", fails, build)


def _case_tensor_layout(rng, index, bases):
    base = _plain_base(rng)
    g = bases.files[base]
    t = rng.choice(g.all_tensors())
    indexed = g.is_indexed_river(t)  # listed in a format-2 river index: always 4 dims there
    ops = ["remove", "rename_layer", "rename", "swap_dims", "double_dim", "duplicate", "misalign", "offset_past_end"]
    op = rng.choice(ops if indexed else ops + ["extra_dim"])
    # Without output.weight the head is tied to token_embd; the rest must be there.
    required = t.name not in ("output.weight", "river.output.weight")
    where = " (river index)" if indexed else ""

    def edit(fn):
        def build():
            h = g.clone()
            fn(h, h.tensor(t.name))
            if h.river is not None:
                h.sync_river_index()
            return h.to_bytes()
        return build

    def case(desc, expect, fn):
        return Case(index, "tensor_layout", base, f"{base}: {desc}{where}", expect, edit(fn))

    if op == "remove":
        return case(f"remove {t.name}", required, lambda h, ht: h.remove_tensors(lambda name: name == t.name))
    if op == "rename_layer":
        n = rng.choice((2, 3, 7, 1000, 99999999999))
        new = t.name.replace("blk.0.", f"blk.{n}.").replace("blk.1.", f"blk.{n}.")
        return case(f"rename {t.name} -> {new}", new != t.name, lambda h, ht: setattr(ht, "name", new))
    if op == "rename":
        new = t.name + rng.choice(("x", ".bak", "\u00e9", "\udcff"))  # the last: the byte 0xff
        return case(f"rename {t.name} -> {new}", required, lambda h, ht: setattr(ht, "name", new))
    if op == "swap_dims":
        same = list(reversed(t.dims)) == t.dims
        return case(f"reverse the dims of {t.name} {t.dims}", not same,
                    lambda h, ht: setattr(ht, "dims", list(reversed(ht.dims))))
    if op == "extra_dim":
        d = rng.choice((1, 2))

        def fn(h, ht):
            ht.dims = ht.dims + [d]
            if d != 1:
                h.relayout({ht.name: g.tensor_bytes(t) * d})
        return case(f"{t.name} dims {t.dims} + [{d}]", d != 1, fn)
    if op == "double_dim":
        def fn(h, ht):
            ht.dims = [ht.dims[0] * 2] + ht.dims[1:]
            h.relayout({ht.name: g.tensor_bytes(t) * 2})
        return case(f"{t.name} ne0 doubled", True, fn)
    if op == "duplicate":
        def fn(h, ht):
            (h.river if indexed else h.tensors).append(dataclasses.replace(ht))
            h.relayout({})
        return case(f"{t.name} described twice", True, fn)
    if op == "misalign":
        shift = rng.choice((1, 2, 16))

        def fn(h, ht):
            ht.offset += shift
        return case(f"{t.name} offset +{shift}", True, fn)
    blocks = rng.choice((0, 1, 1 << 20, 1 << 40))

    def fn(h, ht):
        ht.offset = (len(h.river_data if indexed else h.data) // 32 + blocks) * 32
    return case(f"{t.name} offset past the end (+{blocks} blocks)", True, fn)


def _case_vocab(rng, index, bases):
    base = rng.choice(("llama", "qwen2", "river"))
    g = bases.files[base]
    n = bases.n_tokens(base)
    i, j = rng.randrange(n), rng.randrange(n)
    op = rng.choice(("nul", "nul_end", "duplicate", "empty", "drop_last", "as_ints", "types_short", "types_float",
                     "types_values", "types_byte", "merges_ints", "merges_garbage", "no_merges", "model", "pre",
                     "special_ids", "add_bos_no_bos", "utf8"))

    def with_tokens(fn):
        def build():
            h = g.clone()
            toks = h.strings("tokenizer.ggml.tokens")
            fn(toks)
            h.set("tokenizer.ggml.tokens", ARRAY, (STRING, toks))
            return h.to_bytes()
        return build

    def with_file(fn):
        def build():
            h = g.clone()
            fn(h)
            return h.to_bytes()
        return build

    if op in ("nul", "nul_end"):
        at_seed = rng.randrange(1 << 16)

        def fn(toks):
            t = toks[i]
            at = len(t) if op == "nul_end" else at_seed % (len(t) + 1)
            toks[i] = t[:at] + b"\0" + t[at:]
        return Case(index, "vocab", base, f"{base}: NUL byte in token {i}", True, with_tokens(fn))
    if op == "duplicate":
        def fn(toks):
            toks[i] = toks[j]
        return Case(index, "vocab", base, f"{base}: token {i} := token {j}", i != j, with_tokens(fn))
    if op == "empty":
        def fn(toks):
            toks[i] = b""
        return Case(index, "vocab", base, f"{base}: token {i} empty", False, with_tokens(fn))
    if op == "utf8":
        def fn(toks):
            toks[i] = bytes([0xff, 0xfe]) + toks[i]
        return Case(index, "vocab", base, f"{base}: token {i} with invalid UTF-8", False, with_tokens(fn))
    if op == "drop_last":
        def fn(toks):
            del toks[-1]
        return Case(index, "vocab", base, f"{base}: last token dropped", True, with_tokens(fn))
    if op == "as_ints":
        return Case(index, "vocab", base, f"{base}: tokens as an int32 array", True,
                    with_file(lambda h: h.set("tokenizer.ggml.tokens", ARRAY, (I32, list(range(n))))))
    if op == "types_short":
        return Case(index, "vocab", base, f"{base}: token_type shorter than the vocabulary", True,
                    with_file(lambda h: h.set("tokenizer.ggml.token_type", ARRAY, (I32, [1] * (n // 2)))))
    if op == "types_float":
        return Case(index, "vocab", base, f"{base}: token_type as floats", True,
                    with_file(lambda h: h.set("tokenizer.ggml.token_type", ARRAY, (F32, [1.0] * n))))
    if op in ("types_values", "types_byte"):
        v = 6 if op == "types_byte" else rng.choice((0, 7, 99, -5, 2**31 - 1))
        which = sorted(rng.sample(range(n), 50))

        def fn(h):
            kv = h.kv("tokenizer.ggml.token_type")
            arr = np.frombuffer(kv[2][12:], dtype=np.int32).copy()
            arr[which] = v
            kv[2] = kv[2][:12] + arr.tobytes()
        return Case(index, "vocab", base, f"{base}: token_type = {v} for 50 tokens", False, with_file(fn))
    if op == "merges_ints":
        return Case(index, "vocab", base, f"{base}: merges as an int32 array", True,
                    with_file(lambda h: h.set("tokenizer.ggml.merges", ARRAY, (I32, [1, 2, 3]))))
    if op == "merges_garbage":
        def fn(h):
            m = h.strings("tokenizer.ggml.merges")
            for k in range(0, len(m), 97):
                m[k] = rng_bytes[k % len(rng_bytes)]
            h.set("tokenizer.ggml.merges", ARRAY, (STRING, m))
        rng_bytes = [b"", b" ", b"  ", b"a", b"a  b", b"\xff \xfe", b" x"]
        return Case(index, "vocab", base, f"{base}: every 97th merge garbled", False, with_file(fn))
    if op == "no_merges":
        return Case(index, "vocab", base, f"{base}: merges deleted", True,
                    with_file(lambda h: h.delete("tokenizer.ggml.merges")))
    if op == "model":
        m = rng.choice(("bert", "rwkv", "none", "no_vocab", "t5", "llama", "plamo2", "", "gemma4", "hybriddna"))
        # the bases are byte-level BPE vocabularies: relabelled SentencePiece, they lack its byte tokens
        return Case(index, "vocab", base, f"{base}: tokenizer.ggml.model = {m!r}", True,
                    with_file(lambda h: h.set("tokenizer.ggml.model", STRING, m)))
    if op == "pre":
        p = rng.choice(("nonsense", "", "llama3", "qwen2", "default"))
        return Case(index, "vocab", base, f"{base}: tokenizer.ggml.pre = {p!r}", p == "nonsense",
                    with_file(lambda h: h.set("tokenizer.ggml.pre", STRING, p)))
    if op == "special_ids":
        key = rng.choice(("bos", "eos", "unknown", "padding", "seperator"))
        v = rng.choice((n, n + 5, -1, 2**31 - 1, 0))
        return Case(index, "vocab", base, f"{base}: tokenizer.ggml.{key}_token_id = {v}", False,
                    with_file(lambda h: h.set(f"tokenizer.ggml.{key}_token_id", U32, v)))

    def fn(h):
        h.set("tokenizer.ggml.add_bos_token", BOOL, True)
        h.set("tokenizer.ggml.add_eos_token", BOOL, True)
        h.set("tokenizer.ggml.add_sep_token", BOOL, True)
        h.set("tokenizer.ggml.bos_token_id", U32, n + 7)
    return Case(index, "vocab", base, f"{base}: adds BOS/EOS/SEP, BOS id out of range", False, with_file(fn))


def _case_river(rng, index, bases):
    name = rng.choice(("river", "river", "river1"))
    g = bases.files[name]
    river_tensors = g.river_tensors()
    ops = ["remove_one", "remove_one", "remove_layer", "remove_all", "shape", "metadata", "pair_river",
           "pair_other_arch", "pair_self"]
    if g.river is not None:
        ops += ["index"] * 4

    def edit(fn):
        def build():
            h = g.clone()
            fn(h)
            if h.river is not None:
                h.sync_river_index()
            return h.to_bytes()
        return build

    op = rng.choice(ops)
    if op == "remove_one":
        t = rng.choice(river_tensors)
        return Case(index, "river", name, f"{name}: remove {t.name}", t.name != "river.output.weight",
                    edit(lambda h: h.remove_tensors(lambda name: name == t.name)))
    if op == "remove_layer":
        il = rng.randrange(TINY["n_layer"])
        return Case(index, "river", name, f"{name}: remove river.blk.{il}.*", True,
                    edit(lambda h: h.remove_tensors(lambda name: name.startswith(f"river.blk.{il}."))))
    if op == "remove_all":
        # In format 2 an empty river index remains, which is refused; in format 1 a plain model remains.
        return Case(index, "river", name, f"{name}: remove every river tensor (metadata stays)", g.river is not None,
                    edit(lambda h: h.remove_tensors(lambda name: name.startswith("river."))))
    if op == "shape":
        t = rng.choice([t for t in river_tensors if len(t.dims) > 1 and t.dims[1] > 1 and t.dims[0] != t.dims[1]])

        def fn(h):
            ht = h.tensor(t.name)
            ht.dims = [ht.dims[1], ht.dims[0]] + ht.dims[2:]
        return Case(index, "river", name, f"{name}: swap the first two dims of {t.name}", True, edit(fn))
    if op == "metadata":
        keys = [k for k, _, _ in g.kvs if k.startswith("river.") and k not in RIVER_INDEX_KEYS]
        key = rng.choice(keys)
        vtype, value, text = _random_value(rng, g.scalar(key))
        return Case(index, "river", name, f"{name}: {key} = {text}", False, edit(lambda h: h.set(key, vtype, value)))
    if op == "index":
        return _river_index_case(rng, index, g)
    if op == "pair_river":
        return Case(index, "river", "llama", "llama with the River GGUF as its river", True,
                    lambda: bases.bytes["llama"], river_base="river")
    if op == "pair_other_arch":
        other = rng.choice(("qwen2", "qwen3"))
        return Case(index, "river", "llama", f"llama with the {other} base as its river", True,
                    lambda: bases.bytes["llama"], river_base=other)
    return Case(index, "river", name, f"{name}: the River GGUF with itself as its river", True,
                lambda: bases.bytes[name], river_base=name)


def _river_index_case(rng, index, g: Gguf) -> Case:
    """Damage to a format-2 river index (river.tensor_* arrays, river.data_size, the format version)."""
    n = len(g.river)
    i, j = rng.randrange(n), rng.randrange(n)
    op = rng.choice(("array_type", "short", "dup_name", "backbone_name", "bad_type", "offset_misaligned",
                     "offset_past", "data_size", "version", "delete_key", "swap_offsets"))

    def edit(fn):
        def build():
            h = g.clone()
            fn(h)
            return h.to_bytes()
        return build

    def case(desc, expect, fn):
        return Case(index, "river", "river", f"river index: {desc}", expect, edit(fn))

    def with_ints(key, fn):
        def apply(h):
            vals = h.ints(key)
            fn(vals)
            h.set(key, ARRAY, (U64 if key != "river.tensor_types" else U32, vals))
        return apply

    if op == "array_type":
        key = rng.choice(RIVER_INDEX_KEYS[:4])
        et = rng.choice((I32, U16, I64, F32) if key == "river.tensor_names" else (I32, U16, I64, F32, STRING))

        def fn(h):
            vals = h.strings(key) if key == "river.tensor_names" else h.ints(key)
            if et == STRING:
                vals = [str(v).encode() for v in vals]
            elif key == "river.tensor_names":
                vals = list(range(len(vals)))
            h.set(key, ARRAY, (et, vals))
        return case(f"{key} as an array of {_VT_NAMES[et]}", True, fn)
    if op == "short":
        key = rng.choice(RIVER_INDEX_KEYS[1:4])
        return case(f"{key} one element short", True, with_ints(key, lambda v: v.pop()))
    if op == "dup_name":
        def fn(h):
            h.river[i].name = h.river[j].name
            h.sync_river_index()
        return case(f"tensor {i} named like tensor {j}", i != j, fn)
    if op == "backbone_name":
        other = rng.choice(g.tensors).name

        def fn(h):
            h.river[i].name = other
            h.sync_river_index()
        return case(f"tensor {i} named {other}", True, fn)
    if op == "bad_type":
        v = rng.choice((4, 5, 37, 43, 99, 2**32 - 1))  # removed types, past the last, nonsense
        return case(f"tensor {i} of type id {v}", True, with_ints("river.tensor_types", lambda t: t.__setitem__(i, v)))
    if op == "offset_misaligned":
        d = rng.choice((1, 4, 16))
        return case(f"tensor {i} offset +{d}", True,
                    with_ints("river.tensor_offsets", lambda o: o.__setitem__(i, o[i] + d)))
    if op == "offset_past":
        size = len(g.river_data)
        v = rng.choice((size, size + 32 * 1024, 2**63, 2**64 - 32))
        return case(f"tensor {i} offset {v}", True, with_ints("river.tensor_offsets", lambda o: o.__setitem__(i, v)))
    if op == "data_size":
        size = len(g.river_data)
        v = rng.choice((0, size - 1, size - 4096, size + 1, 2**40, 2**64 - 1))
        needed = max(t.offset + tensor_nbytes(t.ttype, t.dims) for t in g.river)
        return case(f"river.data_size = {v} (holds {size})", v < needed or v > size + len(g.trailer),
                    lambda h: h.set("river.data_size", U64, v))
    if op == "version":
        vtype, v = rng.choice(((U32, 1), (U32, 0), (U32, 3), (U32, 99), (I32, -1), (STRING, "2"), (F32, 2.0)))
        return case(f"river.format_version = {v!r} ({_VT_NAMES[vtype]})", True,
                    lambda h: h.set("river.format_version", vtype, v))
    if op == "delete_key":
        key = rng.choice(RIVER_INDEX_KEYS)
        return case(f"{key} deleted", True, lambda h: h.delete(key))

    # Two tensors' data swapped: a wrong but readable index (no crash, no promise of an error).
    def fn(h):
        a, b = h.river[i], h.river[j]
        if tensor_nbytes(a.ttype, a.dims) == tensor_nbytes(b.ttype, b.dims):
            a.offset, b.offset = b.offset, a.offset
            h.sync_river_index()
    return case(f"offsets of tensors {i} and {j} swapped", False, fn)


# ----------------------------------------------------------------------------------------
# Running a case (in the worker)
# ----------------------------------------------------------------------------------------

def allowed_exceptions() -> tuple:
    """The exceptions a malformed file may raise: the error classes river_gguf exports and
    FileNotFoundError. Plain ValueError or TypeError are for bad arguments, not bad files."""
    import river_gguf

    exported = [getattr(river_gguf, n) for n in river_gguf.__all__]
    return (FileNotFoundError,) + tuple(c for c in exported if isinstance(c, type) and issubclass(c, Exception))


def run_case(path: str, river: Optional[str], use_mmap: bool = True) -> None:
    """Load and run one file: raises whatever the API raises."""
    from river_gguf.greedy import greedy
    from river_gguf.measure.teacher import score
    from river_gguf.model import Model

    kwargs = {"threshold": 0.9} if river else {}
    if not use_mmap:
        kwargs["use_mmap"] = False  # the read-into-memory path
    m = Model(path, river=river, n_ctx=64, n_threads=1, **kwargs)
    n = m.n_vocab
    toks = [t % n for t in (1, 2, 3, 4, 5)]
    greedy(m, toks, 2)
    greedy(m, "Hi there", 2)
    score(m, toks, prefix=2)
    if m.has_river:
        greedy(m, toks, 2, mode="river-only")
        greedy(m, toks, 2, mode="river", threshold=0.0)
        # Lossless rounds (the river's drafts, the backbone's verify batch) on sequence 0, and a
        # draft on sequence 1: a damaged river's drafts end as its other modes do, and a draft
        # leaves the cache's rows as it found them.
        greedy(m, toks, 3, mode="lossless")
        with m.session(seq=1, mode="lossless") as s:
            s.prefill(toks)
            used = m.cache_used
            s.draft(toks[-1], 2)
            if m.cache_used != used:
                raise AssertionError(f"a draft left {m.cache_used} cache rows in use, not {used}")


def run_case_llama(path: str, river: Optional[str], use_mmap: bool = True) -> None:
    """The same through river_gguf.Llama, the llama_cpp.Llama drop-in (libllama reads its vocabulary)."""
    from river_gguf.llama import Llama

    kwargs = {"threshold": 0.9} if river else {}
    llm = Llama(path, river=river, n_ctx=64, n_threads=1, use_mmap=use_mmap, verbose=False, **kwargs)
    try:
        toks = llm.tokenize(b"Hi there")
        llm.detokenize(toks)
        llm.create_completion("Hi there", max_tokens=2, temperature=0.0)
        if river:  # lossless sampling: each draft drawn by a copy of the sampler chain
            llm.create_completion("Hi there", max_tokens=3, temperature=0.8, seed=1, mode="lossless")
    finally:
        llm.close()


APIS = ("model", "llama", "both")


def _worker(seed: int, bases_dir: str, scratch: str, api: str = "model") -> int:
    # The protocol goes to the original stdout; anything native code prints goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    with open(os.path.join(bases_dir, "bases.json")) as f:
        bases = Bases(json.load(f))
    allowed = allowed_exceptions()
    # For testing the watchdog itself: "INDEX:abort,INDEX:hang,INDEX:raise" misbehaves on purpose.
    rigged = dict(item.split(":") for item in os.environ.get("RIVER_FUZZ_RIG", "").split(",") if item)
    proto.write("READY\n")
    for line in sys.stdin:
        line = line.strip()
        if not line or line == "quit":
            break
        index = int(line)
        case = make_case(seed, index, bases)
        path = os.path.join(scratch, f"case{index}.gguf")
        t0 = time.perf_counter()
        try:
            with open(path, "wb") as f:
                f.write(case.build())
            action = rigged.get(str(index))
            if action == "abort":
                os.abort()
            elif action == "hang":
                time.sleep(1e6)
            elif action == "raise":
                raise TypeError("rigged")
            if case.as_river:
                target, river = bases.paths["llama"], path
            else:
                target, river = path, bases.paths[case.river_base] if case.river_base else None
            if api == "llama" or (api == "both" and index % 2):
                run_case_llama(target, river, case.use_mmap)
            else:
                run_case(target, river, case.use_mmap)
            result = {"outcome": "ran"}
        except allowed as e:
            result = {"outcome": "error", "type": type(e).__name__, "message": str(e)[:300]}
        except Exception as e:  # an exception the API does not promise
            result = {"outcome": "bad-exception", "type": type(e).__name__, "message": str(e)[:300],
                      "where": traceback.format_exc().strip().splitlines()[-3][:300]}
        finally:
            import gc
            gc.collect()  # the Model (and its mapping) goes before its file does
            try:
                os.remove(path)
            except OSError:
                pass
        result.update(index=index, seconds=round(time.perf_counter() - t0, 3))
        proto.write(json.dumps(result) + "\n")
    return 0


# ----------------------------------------------------------------------------------------
# The parent: runs cases through workers, replacing a worker only after a crash or a hang
# ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
    index: int
    kind: str
    desc: str
    outcome: str              # ran | error | bad-exception | crash | hang | silent
    detail: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.outcome in ("bad-exception", "crash", "hang", "silent")


@dataclasses.dataclass
class Report:
    results: List[Result]
    seconds: float
    workers: int

    @property
    def failures(self) -> List[Result]:
        return [r for r in self.results if r.failed]

    def summary(self) -> str:
        counts: Dict[str, int] = {}
        for r in self.results:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        kinds: Dict[str, int] = {}
        for r in self.results:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        lines = [f"{len(self.results)} cases in {self.seconds:.1f} s with {self.workers} worker process(es): "
                 + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                 "kinds: " + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))]
        for r in self.failures[:50]:
            lines.append(f"FAIL case {r.index} [{r.outcome}] {r.desc}: {r.detail}")
        return "\n".join(lines)


class _Worker:
    def __init__(self, seed: int, bases_dir: str, scratch: str, log_path: str, api: str = "model"):
        env = dict(os.environ)
        # The worker imports the river_gguf this process did, wherever it was imported from.
        import river_gguf

        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(river_gguf.__file__)))
        env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--seed", str(seed), "--bases", bases_dir,
             "--scratch", scratch, "--api", api],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True, bufsize=1)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next_line(self, timeout: float) -> Optional[str]:
        """The worker's next line; None when it died; raises queue.Empty on timeout."""
        return self.lines.get(timeout=timeout)

    def send(self, text: str) -> bool:
        try:
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def death(self) -> str:
        rc = self.proc.wait(timeout=30)
        if rc < 0:
            try:
                return f"killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"killed by signal {-rc}"
        return f"exited with status {rc}"

    def log_tail(self, n: int = 400) -> str:
        self.log.flush()
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - n))
                return f.read().decode("utf-8", "replace").replace("\n", " | ")
        except OSError:
            return ""

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()

    def close(self):
        self.send("quit")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def prepare_bases(bases_dir: str) -> Dict[str, str]:
    """The base models in `bases_dir` (with a bases.json listing), built unless already there."""
    listing = os.path.join(bases_dir, "bases.json")
    if os.path.isfile(listing):  # a kept workdir: its bases are reused
        with open(listing) as f:
            return json.load(f)
    paths = build_bases(bases_dir)
    with open(listing, "w") as f:
        json.dump(paths, f)
    return paths


def run_fuzz(n_cases: int, seed: int = 0, workdir: Optional[str] = None, timeout: float = 30.0,
             progress: Optional[Callable[[Result], None]] = None, start_timeout: float = 180.0,
             api: str = "model", first: int = 0) -> Report:
    """Generate and run cases first..n_cases-1 of `seed` (a run split in parts gives each part's
    cases as the whole run would); see the module docstring. api: "model" loads each case with
    Model, "llama" with river_gguf.Llama, "both" alternates."""
    if api not in APIS:
        raise ValueError(f"api must be one of {APIS}, got {api!r}")
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="river-fuzz-")
    t0 = time.perf_counter()
    try:
        bases_dir = os.path.join(workdir, "bases")
        bases = Bases(prepare_bases(bases_dir))
        scratch = os.path.join(workdir, "scratch")
        os.makedirs(scratch, exist_ok=True)
        results: List[Result] = []
        workers = 0
        i = first
        while i < n_cases:
            workers += 1
            w = _Worker(seed, bases_dir, scratch, os.path.join(workdir, f"worker{workers}.log"), api)
            try:
                ready = w.next_line(start_timeout)
            except queue.Empty:
                ready = None
            if ready is None or ready.strip() != "READY":
                tail = w.log_tail()
                w.kill()
                raise RuntimeError(f"a fuzz worker did not start: {tail}")
            while i < n_cases:
                case = make_case(seed, i, bases)
                res = Result(i, case.kind, case.desc, "crash")
                line = None
                if w.send(str(i)):
                    try:
                        line = w.next_line(timeout)
                    except queue.Empty:
                        res.outcome, res.detail = "hang", f"no answer in {timeout:.0f} s"
                if line:
                    out = json.loads(line)
                    res.outcome, res.seconds = out["outcome"], out["seconds"]
                    if out["outcome"] != "ran":
                        res.detail = f"{out['type']}: {out['message']}" + (f" at {out['where']}" if "where" in out else "")
                    if out["outcome"] == "ran" and case.expect_error:
                        res.outcome, res.detail = "silent", "loaded and ran without an error"
                results.append(res)
                i += 1
                if progress:
                    progress(res)
                if not line:
                    if res.outcome == "crash":
                        res.detail = w.death() + "; log: " + w.log_tail()
                    w.kill()
                    break
            else:
                w.close()
        return Report(results, time.perf_counter() - t0, workers)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/fuzz_gguf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=int(os.environ.get("RIVER_FUZZ_CASES", "300")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one case may take before it counts as a hang")
    p.add_argument("--workdir", help="keep the bases, scratch files and worker logs here")
    p.add_argument("--write", nargs=2, metavar=("INDEX", "PATH"),
                   help="write case INDEX's file to PATH, print how it is loaded, and exit (to reproduce a failure)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every case's outcome")
    p.add_argument("--api", choices=APIS, default=os.environ.get("RIVER_FUZZ_API", "model"),
                   help="load with Model (default), with river_gguf.Llama, or both (alternating)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bases", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args.seed, args.bases, args.scratch, args.api)

    def show(r: Result):
        if args.verbose or r.failed:
            print(f"case {r.index} [{r.outcome}] {r.desc} {r.detail}"[:400], flush=True)

    if args.write:
        workdir = args.workdir or tempfile.mkdtemp(prefix="river-fuzz-")
        bases = Bases(prepare_bases(os.path.join(workdir, "bases")))
        case = make_case(args.seed, int(args.write[0]), bases)
        with open(args.write[1], "wb") as f:
            f.write(case.build())
        how = (f"Model({bases.paths['llama']!r}, river={args.write[1]!r}, threshold=0.9)" if case.as_river else
               f"Model({args.write[1]!r}" + (f", river={bases.paths[case.river_base]!r}, threshold=0.9)"
                                              if case.river_base else ")"))
        print(f"case {case.index} ({case.kind}): {case.desc}\nexpect an error: {case.expect_error}\nload: {how}")
        return 0

    report = run_fuzz(args.cases, args.seed, args.workdir, args.timeout, progress=show, api=args.api)
    print(report.summary())
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
