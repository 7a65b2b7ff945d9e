"""The River GGUF layout (format version 2): a plain GGUF of the backbone that stock llama.cpp opens
as it is, with the river's tensors stored after the backbone's data and indexed in `river.*`
metadata (docs/format.md).

llama.cpp refuses a GGUF whose tensor index lists tensors its architecture does not use, so the
river's tensors are not in the index. They follow the backbone's data section, each aligned to
`general.alignment`, starting at the first aligned offset after the backbone's last tensor; the
index lives in four arrays (`river.tensor_names`, `river.tensor_types`, `river.tensor_shapes`,
`river.tensor_offsets`) and `river.data_size`. Readers that know nothing of River see the
backbone; river_gguf (native/gguf_file.cpp, and `river_tensors` here) finds the river.

Format version 1 listed the river's tensors in the GGUF index under a `river.` prefix; it is
still read, and `river-gguf upgrade OLD NEW` rewrites it as version 2.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import GGUFValueType as VT
from gguf.quants import quant_shape_to_byte_shape
from tqdm import tqdm

FORMAT_VERSION = 2
RIVER_PREFIX = "river."
VERSION_KEY = "river.format_version"
NAMES_KEY = "river.tensor_names"
TYPES_KEY = "river.tensor_types"
SHAPES_KEY = "river.tensor_shapes"  # 4 dimensions (ne0..ne3) per tensor, flattened
OFFSETS_KEY = "river.tensor_offsets"  # bytes from the start of the river's data
DATA_SIZE_KEY = "river.data_size"
INDEX_KEYS = (NAMES_KEY, TYPES_KEY, SHAPES_KEY, OFFSETS_KEY, DATA_SIZE_KEY)

_ELEMENT_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                   "I32": np.int32, "I64": np.int64}


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class RiverTensor:
    """A river tensor found through the version-2 index; `data` is a view of the mapped file shaped
    as gguf.GGUFReader shapes its tensors (so writers can copy either kind alike)."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # ne0.. (GGUF order)
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray


def read_field(reader, key: str):
    """A metadata value of a gguf.GGUFReader, or None when the key is absent."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def format_version(reader) -> int:
    """The file's River format version: 0 for a plain GGUF (no river), else river.format_version
    (1 for files written before the key existed but holding river.* tensors)."""
    v = read_field(reader, VERSION_KEY)
    if v is not None:
        return int(v)
    return 1 if any(t.name.startswith(RIVER_PREFIX) for t in reader.tensors) else 0


def river_data_start(reader) -> int:
    """Where a version-2 file's river data begins: the first multiple of the alignment at or after
    the end of the backbone's last tensor (or the data section's start, for a file with none)."""
    align = int(read_field(reader, "general.alignment") or 32)
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=int(reader.data_offset))
    return _align(end, align)


def _typed_view(raw: np.ndarray, qtype, ne: Sequence[int]) -> np.ndarray:
    dims = tuple(int(x) for x in reversed(list(ne)))
    dtype = _ELEMENT_DTYPES.get(qtype.name)
    if dtype is not None:
        return raw.view(dtype).reshape(dims)
    return raw.reshape(quant_shape_to_byte_shape(dims, qtype))


def river_tensors(reader) -> List[Any]:
    """The river's tensors of a River GGUF as (name, ...) reader-like objects with full `river.`
    names: version 1 from the GGUF index, version 2 from the river index. [] for a plain GGUF.
    Raises ValueError when the index is malformed or points outside the file."""

    version = format_version(reader)
    if version <= 1:
        return [t for t in reader.tensors if t.name.startswith(RIVER_PREFIX)]
    if version != FORMAT_VERSION:
        raise ValueError(f"River format version {version} is not supported (this river_gguf reads 1 and "
                         f"{FORMAT_VERSION})")
    names = read_field(reader, NAMES_KEY)
    types = read_field(reader, TYPES_KEY)
    shapes = read_field(reader, SHAPES_KEY)
    offsets = read_field(reader, OFFSETS_KEY)
    size = read_field(reader, DATA_SIZE_KEY)
    if names is None or types is None or shapes is None or offsets is None or size is None:
        missing = [k for k in INDEX_KEYS if read_field(reader, k) is None]
        raise ValueError(f"River format {FORMAT_VERSION} file without its river index ({', '.join(missing)})")
    n = len(names)
    if len(types) != n or len(offsets) != n or len(shapes) != 4 * n:
        raise ValueError("river index arrays disagree in length")
    start = river_data_start(reader)
    file_size = int(reader.data.shape[0])
    if start + int(size) > file_size:
        raise ValueError(f"river data ({int(size)} bytes at {start}) runs past the end of the file ({file_size} bytes)")
    out = []
    for i, name in enumerate(names):
        try:
            qtype = GGMLQuantizationType(int(types[i]))
        except ValueError:
            raise ValueError(f"river tensor {name!r} has unknown type {int(types[i])}") from None
        ne = [int(x) for x in shapes[4 * i:4 * i + 4]]
        block, type_size = GGML_QUANT_SIZES[qtype]
        if any(x < 1 for x in ne) or ne[0] % block:
            raise ValueError(f"river tensor {name!r} has a bad shape {ne} for {qtype.name}")
        n_bytes = int(np.prod(ne)) // block * type_size
        off = int(offsets[i])
        if off < 0 or off + n_bytes > int(size):
            raise ValueError(f"river tensor {name!r} lies outside the river data")
        raw = reader.data[start + off:start + off + n_bytes]
        while len(ne) > 1 and ne[-1] == 1:
            ne.pop()
        out.append(RiverTensor(str(name), qtype, np.array(ne, dtype=np.uint64), n_bytes, start + off,
                               _typed_view(raw, qtype, ne)))
    return out


def index_entries(river: Sequence[Tuple[str, Any]], alignment: int) -> Tuple[List[tuple], List[int], int]:
    """Metadata entries (key, value, GGUFValueType, sub_type) of the river index for `river`, a list
    of (full name, reader tensor); also each tensor's offset and the data size."""

    offsets, pos = [], 0
    for _, t in river:
        pos = _align(pos, alignment)
        offsets.append(pos)
        pos += int(t.n_bytes)
    shapes: List[int] = []
    for _, t in river:
        ne = [int(x) for x in t.shape] + [1] * (4 - len(t.shape))
        shapes += ne[:4]
    entries = [
        (NAMES_KEY, [name for name, _ in river], VT.ARRAY, VT.STRING),
        (TYPES_KEY, [int(t.tensor_type) for _, t in river], VT.ARRAY, VT.UINT32),
        (SHAPES_KEY, shapes, VT.ARRAY, VT.UINT64),
        (OFFSETS_KEY, offsets, VT.ARRAY, VT.UINT64),
        (DATA_SIZE_KEY, pos, VT.UINT64, None),
    ]
    return entries, offsets, pos


def add_index(writer, river: Sequence[Tuple[str, Any]]) -> List[int]:
    """Add the version-2 key and the river index to a GGUFWriter (before its KV data is written);
    returns the tensors' offsets for append_river_data."""

    entries, offsets, _ = index_entries(river, int(writer.data_alignment))
    writer.add_key_value(VERSION_KEY, FORMAT_VERSION, VT.UINT32)
    for key, value, vtype, sub in entries:
        writer.add_key_value(key, value, vtype, sub_type=sub)
    return offsets


def append_river_data(path: str, river: Sequence[Tuple[str, Any]], offsets: Sequence[int], alignment: int,
                      progress: bool = False) -> None:
    """Append the river's bytes to a finished GGUF at `path` (the backbone's data ends the file),
    at `offsets` from the first aligned position after the backbone's data."""

    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        start = _align(f.tell(), alignment)
        for (name, t), off in tqdm(list(zip(river, offsets)), desc="river", unit="tensor", disable=not progress):
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * (start + off - f.tell()))
            f.write(np.ascontiguousarray(t.data).tobytes(order="C"))
        f.seek(0, os.SEEK_END)
        f.write(b"\0" * (_align(f.tell(), alignment) - f.tell()))
