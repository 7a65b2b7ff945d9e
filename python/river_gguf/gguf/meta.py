"""Rewrite a GGUF's metadata in place (atomically), copying every tensor byte for byte.

Used by `river-gguf calibrate --write` to store the calibrated tau and the numbers behind it:

    set_river_metadata("model.river.gguf", {"river.threshold": 0.975, "river.threshold_source": "calibrated"})
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Dict

import gguf
import numpy as np
from gguf import GGUFValueType as VT
from tqdm import tqdm

from . import river_index
from .io import atomic_output, metadata_items
from .reader import GGUFReader
from .writer import GGUFWriter


def value_type(value: Any, old_type=None):
    if isinstance(value, (list, tuple, np.ndarray)):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            raise TypeError("a list value must hold ints (it is written as an INT32 array)")
        return VT.ARRAY
    if old_type is not None and old_type != VT.ARRAY:
        return old_type  # keep the type the file already uses for this key
    if isinstance(value, (bool, np.bool_)):
        return VT.BOOL
    if isinstance(value, (int, np.integer)):
        return VT.UINT32 if 0 <= int(value) < 2**32 else VT.INT64
    if isinstance(value, (float, np.floating)):
        return VT.FLOAT32
    if isinstance(value, str):
        return VT.STRING
    raise TypeError(f"unsupported metadata value {value!r} ({type(value).__name__})")


def _coerce(value: Any, vtype):
    if vtype == VT.ARRAY:
        return [int(v) for v in value]
    if vtype == VT.BOOL:
        return bool(value)
    if vtype in (VT.FLOAT32, VT.FLOAT64):
        return float(value)
    if vtype == VT.STRING:
        return str(value)
    return int(value)


def _sub_type(vtype):
    return VT.INT32 if vtype == VT.ARRAY else None


def set_river_metadata(path: str, updates: Dict[str, Any], progress: bool = False) -> Dict[str, Any]:
    """Set (add or replace) metadata keys of a GGUF, normally `river.*` ones: scalars, or lists
    of ints (written as INT32 arrays).

    All other metadata (with its exact types and order) and every tensor (raw bytes, same
    types, same alignment; a format-2 River GGUF's river data too) are copied to a temp file next
    to `path`, which then replaces it.
    Returns the values as written (floats rounded to float32 where the key is FLOAT32).
    """

    path = os.fspath(path)
    for k in updates:
        if not isinstance(k, str) or not k or k.startswith("GGUF.") or k == "general.architecture":
            raise ValueError(f"cannot set metadata key {k!r}")
    reader = GGUFReader(path)

    # A format-2 River GGUF keeps its river after the backbone's data: carried over as it is, at
    # the same offsets from the river's start (the index in the metadata does not change).
    river = river_index.river_tensors(reader) if river_index.format_version(reader) >= 2 else []
    river_start = river_index.river_data_start(reader) if river else 0
    arch = reader.fields["general.architecture"].contents()
    align_field = reader.fields.get("general.alignment")
    written: Dict[str, Any] = {}
    f32_keys = set()
    with atomic_output(path) as tmp:
        with contextlib.closing(GGUFWriter(tmp, arch)) as w:
            done = set()
            for key, value, vtype, sub in metadata_items(reader, skip={"general.alignment"}):
                if key in updates:
                    vt = value_type(updates[key], vtype)
                    value, vtype, sub = _coerce(updates[key], vt), vt, _sub_type(vt)
                    written[key] = value
                    done.add(key)
                    if vt == VT.FLOAT32:
                        f32_keys.add(key)
                w.add_key_value(key, value, vtype, sub_type=sub)
            for key, value in updates.items():
                if key not in done:
                    vt = value_type(value)
                    written[key] = _coerce(value, vt)
                    if vt == VT.FLOAT32:
                        f32_keys.add(key)
                    w.add_key_value(key, written[key], vt, sub_type=_sub_type(vt))
            if align_field is not None:
                w.add_custom_alignment(int(align_field.contents()))
            for t in reader.tensors:
                w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for t in tqdm(reader.tensors, desc="rewrite", unit="tensor", disable=not progress):
                w.write_tensor_data(np.ascontiguousarray(t.data))
            alignment = int(w.data_alignment)
        if river:
            river_index.append_river_data(tmp, [(t.name, t) for t in river],
                                           [t.data_offset - river_start for t in river], alignment)
    del reader, river
    for k in f32_keys:
        written[k] = float(np.float32(written[k]))
    return written
