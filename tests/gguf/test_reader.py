"""river_gguf.gguf.reader.GGUFReader: gguf-py's GGUFReader, field for field and tensor for tensor,
parsed faster."""
import contextlib

import gguf
import numpy as np
import pytest

from river_gguf.gguf.reader import GGUFReader


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


def test_every_value_type(tmp_path):
    path = tmp_path / "values.gguf"
    with contextlib.closing(gguf.GGUFWriter(str(path), "llama")) as w:
        for name, dtype in (("u8", np.uint8), ("i8", np.int8), ("u16", np.uint16), ("i16", np.int16),
                            ("u32", np.uint32), ("i32", np.int32), ("u64", np.uint64), ("i64", np.int64),
                            ("f32", np.float32), ("f64", np.float64)):
            values = (np.arange(5) * 3 - 4).astype(dtype).tolist() if "u" not in name else list(range(5))
            vtype = gguf.GGUFValueType[{"u8": "UINT8", "i8": "INT8", "u16": "UINT16", "i16": "INT16", "u32": "UINT32",
                                        "i32": "INT32", "u64": "UINT64", "i64": "INT64", "f32": "FLOAT32",
                                        "f64": "FLOAT64"}[name]]
            w.add_key_value(f"t.{name}", values, gguf.GGUFValueType.ARRAY, sub_type=vtype)
            w.add_key_value(f"t.{name}.one", values[1], vtype)
        w.add_array("t.bools", [True, False, True])
        w.add_array("t.strings", ["", "a", "\u00e9t\u00e9", "x" * 300])
        w.add_string("t.string", "river")
        w.add_bool("t.bool", True)
        w.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
        w.add_tensor("h", np.ones(8, dtype=np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    r = _same(path)
    assert r.fields["t.strings"].contents() == ["", "a", "\u00e9t\u00e9", "x" * 300]
    assert r.fields["t.bools"].contents() == [True, False, True]


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
