"""gguf-py's GGUFReader, parsed many times faster.

gguf-py takes every value of a metadata array as a view of its np.memmap: a 49k-token vocabulary
and its merges are some 200k memmap views, and making a memmap view costs microseconds in
numpy's memmap.__array_finalize__, so opening SmolLM2 costs 1.7-2 s and a 152k-token vocabulary
several seconds, on every open (a conversion opens its files several times). This reader finds
where each value of an array lies and makes its parts (views of a plain ndarray over the same
mapping) only when they are read: most readers want the tensors and a few keys, never the
vocabulary's every string. The fields, parts, data indices, types and tensors are gguf-py's,
value for value; tensor data are ndarrays over the mapping (not np.memmap). Files of the other
byte order are parsed as gguf-py parses them."""
from __future__ import annotations

import struct
from collections.abc import Sequence

import gguf
import numpy as np
from gguf.constants import GGUFValueType

_U64 = struct.Struct("<Q")
_ARRAY_TYPE = np.dtype("<u4")
_ARRAY_LEN = np.dtype("<u8")


class ArrayParts(Sequence):
    """The parts of an array field, as gguf-py lists them (the key's length and bytes, the value
    type, the item type, the length, then each value's parts), each value's made when it is read.
    strings: ends[i] is where string i ends (its 8-byte length starts at ends[i - 1], or at
    `first` for i = 0); numbers: `values` holds them."""

    def __init__(self, plain: np.ndarray, head: list, first: int = 0, ends=None, values=None):
        self._plain, self._head, self._first = plain, head, first
        self._ends, self._values = ends, values
        self._per_value = 1 if values is not None else 2
        self._n = len(values) if values is not None else len(ends)

    def after(self, head: list) -> "ArrayParts":
        """These parts with `head` (the key's parts) before them."""
        self._head = head + self._head
        return self

    def __len__(self) -> int:
        return len(self._head) + self._per_value * self._n

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(len(self)))]
        n = len(self)
        j = j + n if j < 0 else j
        if not 0 <= j < n:
            raise IndexError("part index out of range")
        h = len(self._head)
        if j < h:
            return self._head[j]
        i, which = divmod(j - h, self._per_value)
        if self._values is not None:
            return self._values[i:i + 1]
        start = self._first if i == 0 else int(self._ends[i - 1])
        if which == 0:
            return self._plain[start:start + 8].view(_ARRAY_LEN)
        return self._plain[start + 8:int(self._ends[i])]

    def values(self) -> list:
        """Every value, as ReaderField.contents() gives them (strings decoded)."""
        if self._values is not None:
            return self._values.tolist()
        buf, out, start = memoryview(self._plain), [], self._first
        for end in self._ends:
            out.append(str(buf[start + 8:end], "utf-8"))
            start = end
        return out


class _Field(gguf.ReaderField):
    """A ReaderField whose whole-array contents() reads the values without making their parts."""

    def contents(self, index_or_slice=slice(None)):
        if isinstance(self.parts, ArrayParts) and index_or_slice == slice(None):
            return self.parts.values()
        return super().contents(index_or_slice)


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

    def _build_fields(self, offs, count):
        if self.byte_order != "I":
            return super()._build_fields(offs, count)
        for _ in range(int(count)):
            at = offs
            klen, kdata = self._get_str(offs)
            offs += 8 + int(klen[0])
            raw_type = self._get(offs, np.uint32)
            offs += 4
            head = [klen, kdata, raw_type]
            size, parts, data, types = self._get_field_parts(offs, raw_type[0])
            parts = parts.after(head) if isinstance(parts, ArrayParts) else head + parts
            self._push_field(_Field(at, str(bytes(kdata), encoding="utf-8"), parts, [i + len(head) for i in data],
                                    types), skip_sum=True)
            offs += size
        return offs

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        plain = self._plain()
        raw_itype = plain[orig_offs:orig_offs + 4].view(_ARRAY_TYPE)
        alen = plain[orig_offs + 4:orig_offs + 12].view(_ARRAY_LEN)
        itype, n = int(raw_itype[0]), int(alen[0])
        offs = orig_offs + 12
        if itype == GGUFValueType.STRING:
            # Where each string ends: its length says, so the walk is sequential; its parts are
            # made when read (ArrayParts).
            if offs + 8 * n > len(plain):
                raise ValueError(f"a string array of {n} values runs past the end of the file")
            buf, size, ends = memoryview(plain), len(plain), [0] * n
            unpack, end = _U64.unpack_from, offs
            for i in range(n):
                end += 8 + unpack(buf, end)[0]
                if end > size:
                    raise ValueError("a string runs past the end of the file")
                ends[i] = end
            parts = ArrayParts(plain, [raw_itype, alen], first=offs, ends=np.array(ends, dtype=np.int64))
            return end - orig_offs, parts, list(range(3, 2 * n + 3, 2)), _types(itype, n)
        nptype = self.gguf_scalar_to_np.get(itype)  # keyed by GGUFValueType, an IntEnum: an int finds it
        if nptype is None:  # nested arrays and unknown types: gguf-py's own walk (and its errors)
            return super()._get_field_parts(orig_offs, raw_type)
        dt = np.dtype(nptype)
        values = plain[offs:offs + dt.itemsize * n].view(dt)
        if len(values) != n:
            raise ValueError(f"an array of {n} values runs past the end of the file")
        return 12 + dt.itemsize * n, ArrayParts(plain, [raw_itype, alen], values=values), list(range(2, n + 2)), \
            _types(itype, n)


def _types(itype: int, n: int) -> list:
    # gguf-py names an array's value type from its first value: an empty array has none.
    return [GGUFValueType.ARRAY] + ([GGUFValueType(itype)] if n else [])
