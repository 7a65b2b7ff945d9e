"""Copying GGUFs tensor by tensor: open a file (vetted by the engine first), list its plain and
river tensors, and write a new file with the same metadata and raw bytes. What the converter
(build.py) and the hybrid writer (hybrid.py) share."""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import gguf
import numpy as np
from tqdm import tqdm

from .._loader import native
from . import river_index
from .io import copy_metadata, deferred_interrupts, temp_name
from .reader import GGUFReader
from .writer import GGUFWriter
from .river_index import RIVER_PREFIX, read_field, river_tensors


def check_loadable(path: str) -> dict:
    """Let the engine vet the file (magic, header, tensor extents, architecture, shapes).

    Raises GGUFFormatError (not GGUF, truncated), UnsupportedModelError (architecture) or
    RiverMismatchError before this module reads anything with the gguf package.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"model file not found: {path}")

    with deferred_interrupts():  # libllama's vocab loader logs through a ctypes callback (see _open_model)
        # n_ctx=8: a tiny KV cache; no repacked or joined copies: it opens in milliseconds and
        # reads no weight
        engine = native.Engine(path, "", n_ctx=8, n_threads=1, n_batch=8, repack=False, fuse=False)
    hparams = dict(engine.hparams)
    del engine
    return hparams


def open_reader(path: str):
    return GGUFReader(path)


def reader_path(reader) -> str:
    """The file a reader from open_reader maps."""
    return os.fspath(reader.data.filename)


def arch(reader) -> str:
    return str(reader.fields["general.architecture"].contents())


def np_shape(t) -> Tuple[int, ...]:
    """A reader tensor's shape in numpy order (rows first), as add_tensor_info takes it."""
    return tuple(int(x) for x in reversed(t.shape))


def type_name(t) -> str:
    return gguf.GGMLQuantizationType(int(t.tensor_type)).name


def is_river_gguf(reader) -> bool:
    """True if the file already carries a river (tensors or metadata under ``river.``)."""
    return any(t.name.startswith(RIVER_PREFIX) for t in reader.tensors) or any(
        k.startswith(RIVER_PREFIX) for k in reader.fields
    )


def plain_tensors(reader) -> List[Any]:
    return [t for t in reader.tensors if not t.name.startswith(RIVER_PREFIX)]


def river_tensors_by_name(reader, prefix: str) -> Dict[str, Any]:
    """The river's tensors of ``reader`` by plain name (``prefix`` stripped): from the GGUF index
    (format 1) or the river index (format 2)."""

    try:
        return {t.name[len(prefix):]: t for t in river_tensors(reader) if t.name.startswith(prefix)}
    except ValueError as e:
        raise native.GGUFFormatError(str(e)) from None


def same_file(a: str, b: str) -> bool:
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


@contextlib.contextmanager
def temp_path(near: str, suffix: str):
    """A private temp file name next to ``near`` (``.<name>.<pid>.<random><suffix>``), removed on
    every exit Python sees: an error, KeyboardInterrupt, SystemExit. One that a killed process
    left behind is removed by the next conversion to ``near`` (gguf.io.remove_stale_temp_files)."""

    tmp = temp_name(near, suffix)
    try:
        yield tmp
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def new_writer(path: str, reader, skip_prefix: Optional[str] = RIVER_PREFIX):
    """A GGUFWriter with ``reader``'s metadata (keys under ``skip_prefix`` left out)."""

    w = GGUFWriter(path, arch(reader))
    skip = {"general.alignment"}
    if skip_prefix:
        skip |= {k for k in reader.fields if k.startswith(skip_prefix)}
    copy_metadata(reader, w, skip=skip)
    align = read_field(reader, "general.alignment")
    if align is not None:
        w.add_custom_alignment(int(align))
    return w


def write_tensors(w, plan: Sequence[Tuple[str, Any]], progress: bool, desc: str) -> None:
    """Declare ``(out_name, reader_tensor)`` pairs, write header/KV/info, then stream the raw bytes."""

    for name, t in plan:
        w.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, t in tqdm(plan, desc=desc, unit="tensor", disable=not progress, file=sys.stderr):
        write_one(w, t)


def write_river_file(path: str, reader, entries, plan, river_plan, progress: bool, desc: str) -> None:
    """Write a format-2 River GGUF: ``reader``'s metadata (river.* left out) plus ``entries``, the
    backbone ``plan`` in the GGUF index, and ``river_plan`` after the backbone's data with its
    index in the metadata."""

    with contextlib.closing(new_writer(path, reader)) as w:
        for key, value, vtype in entries:
            if key != river_index.VERSION_KEY:  # add_index writes it
                # Array entries are lists of token ids.
                w.add_key_value(key, value, vtype,
                                sub_type=gguf.GGUFValueType.INT32 if vtype == gguf.GGUFValueType.ARRAY else None)
        offsets = river_index.add_index(w, river_plan)
        alignment = int(w.data_alignment)
        write_tensors(w, plan, progress, desc=desc)
    river_index.append_river_data(path, river_plan, offsets, alignment, progress=progress)


def write_one(w, t) -> None:
    """Copy one tensor's bytes (from the reader's memory map) to the output."""

    w.write_tensor_data(np.ascontiguousarray(t.data))


def write_plain_copy(reader, dst: str) -> None:
    """``reader``'s file without its river tensors and river.* metadata."""
    with contextlib.closing(new_writer(dst, reader)) as w:
        write_tensors(w, [(t.name, t) for t in plain_tensors(reader)], progress=False, desc="strip")
