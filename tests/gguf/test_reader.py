"""river_gguf.gguf.reader.GGUFReader: gguf-py's GGUFReader, field for field and tensor for tensor,
parsed faster."""
import contextlib
import struct

import gguf
import numpy as np
import pytest

from river_gguf.gguf.io import copy_metadata
from river_gguf.gguf.reader import GGUFReader
from river_gguf.gguf.writer import GGUFWriter


def _same(path):
    ours, theirs = GGUFReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, b in theirs.fields.items():
        a = ours.fields[key]
        assert (a.offset, a.name, a.types, list(a.data)) == (b.offset, b.name, b.types, list(b.data)), key
        assert len(a.parts) == len(b.parts), key
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.parts, b.parts)), key
        if b.types:
            assert a.contents() == b.contents(), key
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape) and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    return ours


def test_a_real_model_reads_as_gguf_py_reads_it(q4_1_path):
    r = _same(q4_1_path)
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 49152


def _every_value_type(path, writer_class):
    with contextlib.closing(writer_class(str(path), "llama")) as w:
        for name, dtype in (("u8", np.uint8), ("i8", np.int8), ("u16", np.uint16), ("i16", np.int16),
                            ("u32", np.uint32), ("i32", np.int32), ("u64", np.uint64), ("i64", np.int64),
                            ("f32", np.float32), ("f64", np.float64)):
            values = (np.arange(5) * 3 - 4).astype(dtype).tolist() if "u" not in name else list(range(5))
            vtype = gguf.GGUFValueType[{"u8": "UINT8", "i8": "INT8", "u16": "UINT16", "i16": "INT16", "u32": "UINT32",
                                        "i32": "INT32", "u64": "UINT64", "i64": "INT64", "f32": "FLOAT32",
                                        "f64": "FLOAT64"}[name]]
            w.add_key_value(f"t.{name}", values, gguf.GGUFValueType.ARRAY, sub_type=vtype)
            w.add_key_value(f"t.{name}.one", values[1], vtype)
        w.add_key_value("t.f32.inexact", [0.1, -2.5e-7, 3e38, float("inf")], gguf.GGUFValueType.ARRAY,
                        sub_type=gguf.GGUFValueType.FLOAT32)
        w.add_key_value("t.u64.big", [2**64 - 1, 0], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
        w.add_key_value("t.i32.bools", [True, 2], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        w.add_array("t.bools", [True, False, True])
        w.add_array("t.strings", ["", "a", "\u00e9t\u00e9", "x" * 300])
        w.add_string("t.string", "river")
        w.add_bool("t.bool", True)
        w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.add_tensor("h", np.ones(8, dtype=np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()


def test_every_value_type(tmp_path):
    """Our reader reads every value type as gguf-py's does, and our writer writes gguf-py's bytes."""
    _every_value_type(tmp_path / "values.gguf", gguf.GGUFWriter)
    _every_value_type(tmp_path / "ours.gguf", GGUFWriter)
    assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "values.gguf").read_bytes()
    r = _same(tmp_path / "values.gguf")
    assert r.fields["t.strings"].contents() == ["", "a", "\u00e9t\u00e9", "x" * 300]
    assert r.fields["t.bools"].contents() == [True, False, True]
    assert r.fields["t.strings"].contents(slice(1, 3)) == ["a", "\u00e9t\u00e9"]
    assert r.fields["t.i16"].contents(2) == 2 and r.fields["t.strings"].contents(-1) == "x" * 300


@pytest.mark.parametrize("values,sub_type", [([256], gguf.GGUFValueType.UINT8), ([-1], gguf.GGUFValueType.UINT32),
                                             ([1.5], gguf.GGUFValueType.INT32), ([1e39], gguf.GGUFValueType.FLOAT32)])
def test_values_that_do_not_fit_are_refused_as_gguf_py_refuses_them(tmp_path, values, sub_type):
    for cls in (gguf.GGUFWriter, GGUFWriter):
        with contextlib.closing(cls(str(tmp_path / f"{cls.__module__}.gguf"), "llama")) as w:
            w.add_key_value("t.bad", values, gguf.GGUFValueType.ARRAY, sub_type=sub_type)
            w.write_header_to_file()
            with pytest.raises((struct.error, OverflowError)):
                w.write_kv_data_to_file()


def test_a_real_vocabulary_is_written_byte_for_byte(tmp_path, q4_1_path):
    """Copying a real file's metadata with our writer gives gguf-py's bytes."""
    reader = GGUFReader(q4_1_path)
    for cls, name in ((gguf.GGUFWriter, "theirs"), (GGUFWriter, "ours")):
        with contextlib.closing(cls(str(tmp_path / f"{name}.gguf"), "llama")) as w:
            copy_metadata(reader, w)
            w.write_header_to_file()
            w.write_kv_data_to_file()
    assert (tmp_path / "ours.gguf").read_bytes() == (tmp_path / "theirs.gguf").read_bytes()


@pytest.mark.parametrize("sub_type,value,size", [(gguf.GGUFValueType.INT32, 7, 4),
                                                 (gguf.GGUFValueType.STRING, "abc", 8 + 3)])
def test_an_empty_array(tmp_path, sub_type, value, size):
    # gguf-py's writer refuses empty arrays, which other writers write: one value, cut out.
    path = tmp_path / "empty.gguf"
    with contextlib.closing(gguf.GGUFWriter(str(path), "llama")) as w:
        w.add_key_value("t.empty", [value], gguf.GGUFValueType.ARRAY, sub_type=sub_type)
        w.add_string("t.after", "still read")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    data = bytearray(path.read_bytes())
    at = data.index(b"t.empty") + len("t.empty") + 4 + 4  # past the key, the value type and the array's type
    assert int.from_bytes(data[at:at + 8], "little") == 1
    data[at:at + 8] = (0).to_bytes(8, "little")
    del data[at + 8:at + 8 + size]
    path.write_bytes(bytes(data))
    r = _same(path)
    assert r.fields["t.empty"].contents() == [] and r.fields["t.after"].contents() == "still read"


def test_a_string_array_past_the_end_is_refused(tmp_path, q4_1_path):
    # Cut inside the vocabulary: the array says more strings than the file holds.
    src = open(q4_1_path, "rb").read()
    at = src.index(b"tokenizer.ggml.tokens") + 200_000
    path = tmp_path / "cut.gguf"
    path.write_bytes(src[:at])
    with pytest.raises(ValueError, match="past the end"):
        GGUFReader(path)
