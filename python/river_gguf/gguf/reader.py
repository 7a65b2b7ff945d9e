"""gguf-py's GGUFReader, parsed about 20x faster.

gguf-py takes every value of a metadata array as a view of its np.memmap: a 49k-token vocabulary
and its merges are some 200k memmap views, and making a memmap view costs microseconds in
numpy's memmap.__array_finalize__, so opening SmolLM2 costs 1.7-2 s (this reader: 0.1 s) and a
152k-token vocabulary several seconds, on every open. This reader takes the same views of a plain
ndarray over the same mapping, and walks arrays of strings and of numbers without numpy's
per-value bookkeeping. The fields, parts, data indices, types and tensors are gguf-py's, value for
value; tensor data are ndarrays over the mapping (not np.memmap). Files of the other byte order
are parsed as gguf-py parses them."""
from __future__ import annotations

import struct

import gguf
import numpy as np
from gguf.constants import GGUFValueType

_U64 = struct.Struct("<Q")
_ARRAY_TYPE = np.dtype("<u4")
_ARRAY_LEN = np.dtype("<u8")


class GGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader(path, mode) with the same fields and tensors, parsed faster."""

    def _plain(self) -> np.ndarray:
        # The mapping as a plain ndarray: its slices skip memmap's per-view bookkeeping.
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self._plain_data = self.data.view(np.ndarray)
        return plain

    def _get(self, offset, dtype, count=1, override_order=None):
        dt = np.dtype(dtype)
        count = int(count)
        arr = self._plain()[offset:offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(dt.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        plain = self._plain()
        raw_itype = plain[orig_offs:orig_offs + 4].view(_ARRAY_TYPE)
        alen = plain[orig_offs + 4:orig_offs + 12].view(_ARRAY_LEN)
        itype, n = int(raw_itype[0]), int(alen[0])
        offs = orig_offs + 12
        parts: list = [raw_itype, alen]
        if itype == GGUFValueType.STRING:
            # Each string is two parts, its length and its bytes; the data index is the bytes'.
            buf = memoryview(plain)
            if offs + 8 * n > len(plain):
                raise ValueError(f"a string array of {n} values runs past the end of the file")
            for _ in range(n):
                (size,) = _U64.unpack_from(buf, offs)
                end = offs + 8 + size
                if end > len(plain):
                    raise ValueError("a string runs past the end of the file")
                parts.append(plain[offs:offs + 8].view(_ARRAY_LEN))
                parts.append(plain[offs + 8:end])
                offs = end
            return offs - orig_offs, parts, list(range(3, 2 * n + 3, 2)), _types(itype, n)
        nptype = self.gguf_scalar_to_np.get(itype)  # keyed by GGUFValueType, an IntEnum: an int finds it
        if nptype is None:  # nested arrays and unknown types: gguf-py's own walk (and its errors)
            return super()._get_field_parts(orig_offs, raw_type)
        dt = np.dtype(nptype)
        values = plain[offs:offs + dt.itemsize * n].view(dt)
        if len(values) != n:
            raise ValueError(f"an array of {n} values runs past the end of the file")
        parts += [values[i:i + 1] for i in range(n)]
        return 12 + dt.itemsize * n, parts, list(range(2, n + 2)), _types(itype, n)


def _types(itype: int, n: int) -> list:
    # gguf-py names an array's value type from its first value: an empty array has none.
    return [GGUFValueType.ARRAY] + ([GGUFValueType(itype)] if n else [])
