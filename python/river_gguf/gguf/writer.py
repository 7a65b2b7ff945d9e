"""gguf-py's GGUFWriter, with metadata arrays packed in one step each.

gguf-py packs an array's values one call at a time: a 152k-token vocabulary and its merges are
some 450k calls, about 1.8 s on every file written. This writer packs an array of strings or
numbers of a known item type in one go; the bytes are the same (tests/gguf/test_reader.py writes
every value type both ways). Other values, and files of the other byte order, go through
gguf-py's own packing."""
from __future__ import annotations

import struct

import gguf
import numpy as np
from gguf.constants import GGUFEndian, GGUFValueType

_HEAD = struct.Struct("<IQ")  # the item type and the length of an array
_LEN = struct.Struct("<Q")
_INT, _REAL = (int,), (int, float)
#: Item types packed by numpy: the GGUF width (little-endian), and the Python types taken as they
#: are (others, e.g. a float for an integer type, go through gguf-py's packing and its errors).
_NUMPY_TYPES = {
    GGUFValueType.UINT8: ("<u1", _INT), GGUFValueType.INT8: ("<i1", _INT), GGUFValueType.UINT16: ("<u2", _INT),
    GGUFValueType.INT16: ("<i2", _INT), GGUFValueType.UINT32: ("<u4", _INT), GGUFValueType.INT32: ("<i4", _INT),
    GGUFValueType.UINT64: ("<u8", _INT), GGUFValueType.INT64: ("<i8", _INT), GGUFValueType.FLOAT32: ("<f4", _REAL),
    GGUFValueType.FLOAT64: ("<f8", _REAL), GGUFValueType.BOOL: ("?", (bool,)),
}


def _packed(values: list, dtype: str):
    """The values' bytes as `dtype`, or None where a value does not fit it (gguf-py's packing then
    raises its own error)."""
    with np.errstate(over="ignore"):
        try:
            arr = np.asarray(values, dtype=dtype)
        except (OverflowError, ValueError):
            return None
    if arr.dtype.kind == "f":
        wide = np.asarray(values, dtype=np.float64)
        fits = bool(np.all(np.isfinite(arr) | ~np.isfinite(wide)))
    else:
        fits = arr.tolist() == list(values)
    return arr.tobytes() if fits else None


class GGUFWriter(gguf.GGUFWriter):
    """gguf.GGUFWriter, the same bytes, arrays packed faster."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None, **kw):
        fast = (vtype == GGUFValueType.ARRAY and sub_type is not None and not kw
                and self.endianess == GGUFEndian.LITTLE and isinstance(val, (list, tuple)) and len(val) > 0)
        if fast and sub_type == GGUFValueType.STRING and all(type(v) is str for v in val):
            encoded = [v.encode("utf-8") for v in val]
            body = b"".join(_LEN.pack(len(e)) + e for e in encoded)
        elif fast and sub_type in _NUMPY_TYPES and all(type(v) in _NUMPY_TYPES[sub_type][1] for v in val) \
                and (packed := _packed(val, _NUMPY_TYPES[sub_type][0])) is not None:
            body = packed
        else:
            return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type, **kw)
        head = _HEAD.pack(int(sub_type), len(val))
        return (struct.pack("<I", int(vtype)) if add_vtype else b"") + head + body
