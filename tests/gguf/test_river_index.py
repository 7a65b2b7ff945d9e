"""River GGUF format 2: stock llama.cpp opens a River GGUF as its plain backbone (bit-identical
logits), river_gguf still finds the river, format-1 files are read and upgraded, and a damaged
river index is a clear error."""
import contextlib
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from river_gguf import GGUFFormatError, Model
from river_gguf.gguf import river_index
from river_gguf.convert.build import FORMAT_VERSION, RIVER_PREFIX, build_river_gguf, upgrade_river_gguf
from river_gguf.gguf.copy import new_writer, plain_tensors, write_tensors
from river_gguf.gguf.meta import set_river_metadata
from river_gguf.eval.random_model import write_tiny_model

from support import Oracle
from river_gguf.gguf.reader import GGUFReader

TEXT = "The quick brown fox jumps over the lazy dog, and the river runs to the sea."


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("format")
    bb = write_tiny_model(d / "bb.gguf", "llama", n_layer=4, dtype="f16", seed=5)
    river = d / "m.river.gguf"
    build_river_gguf(bb, river, threshold=0.9, progress=False, presets=False, imatrix=None, n_threads=1,
                     backbone_type=None, river_type="q4_0")
    return bb, str(river), d


def _write_format1(river_path, out):
    """The old layout: river tensors in the GGUF index, river.format_version 1, no river index."""
    r = GGUFReader(river_path)
    rv = river_index.river_tensors(r)
    with contextlib.closing(new_writer(str(out), r)) as w:  # river.* keys left out, then put back
        for key, field in r.fields.items():
            if key.startswith(RIVER_PREFIX) and key not in river_index.INDEX_KEYS + (river_index.VERSION_KEY,):
                w.add_key_value(key, field.contents(), field.types[0])
        w.add_key_value(river_index.VERSION_KEY, 1, gguf.GGUFValueType.UINT32)
        write_tensors(w, [(t.name, t) for t in plain_tensors(r)] + [(t.name, t) for t in rv], False, "v1")
    return out


def test_llama_cpp_opens_a_river_gguf_as_its_backbone(files):
    bb, river, _ = files
    assert river_index.format_version(GGUFReader(river)) == FORMAT_VERSION == 2
    toks = Model(bb, n_ctx=64, n_threads=1).tokenize(TEXT)
    ours = Oracle(river, n_ctx=64).logits(toks)
    assert np.array_equal(ours, Oracle(bb, n_ctx=64).logits(toks))


def test_the_river_lies_outside_the_gguf_index(files):
    _, river, _ = files
    r = GGUFReader(river)
    assert not any(t.name.startswith(RIVER_PREFIX) for t in r.tensors)
    rv = river_index.river_tensors(r)
    assert {t.name for t in rv} >= {"river.blk.0.attn_q.weight", "river.token_embd.weight"}
    assert all(t.data_offset >= river_index.river_data_start(r) for t in rv)
    assert all(t.data_offset % 32 == 0 for t in rv)


def test_river_gguf_finds_the_river(files):
    bb, river, d = files
    # river-only with the river's head equals a plain GGUF of the river's tensors in llama.cpp
    from river_gguf.convert.hybrid import write_hybrid_gguf

    plain_river = d / "river-as-plain.gguf"
    write_hybrid_gguf(river, river, plain_river, exit_layer=-1, river_head=True)
    m = Model(river, n_ctx=64, n_threads=1)
    toks = m.tokenize(TEXT)
    ours = m.logits(toks, mode="river-only", river_head=True)
    assert np.abs(ours - Oracle(str(plain_river), n_ctx=64).logits(toks)).max() < 2e-3
    assert not np.array_equal(ours, m.logits(toks, mode="backbone"))


def test_format1_is_read_and_upgraded(files, tmp_path):
    bb, river, _ = files
    v1 = _write_format1(river, tmp_path / "old.river.gguf")
    r1 = GGUFReader(str(v1))
    assert river_index.format_version(r1) == 1 and any(t.name.startswith(RIVER_PREFIX) for t in r1.tensors)
    del r1
    m1 = Model(str(v1), n_ctx=64, n_threads=1)
    toks = m1.tokenize(TEXT)
    want = m1.logits(toks, mode="river-only", river_head=True)
    with pytest.raises(Exception):  # llama.cpp refuses format 1 ("wrong number of tensors")
        Oracle(str(v1), n_ctx=64).logits(toks)

    v2 = tmp_path / "new.river.gguf"
    assert upgrade_river_gguf(str(v1), str(v2), progress=False) == {"from": 1, "to": 2}
    m2 = Model(str(v2), n_ctx=64, n_threads=1)
    assert np.array_equal(m2.logits(toks, mode="river-only", river_head=True), want)
    assert m2.metadata["river.threshold"] == m1.metadata["river.threshold"]
    assert np.array_equal(Oracle(str(v2), n_ctx=64).logits(toks), Oracle(bb, n_ctx=64).logits(toks))
    with pytest.raises(ValueError, match="already"):
        upgrade_river_gguf(str(v2), str(tmp_path / "again.gguf"), progress=False)
    with pytest.raises(ValueError, match="not a River GGUF"):
        upgrade_river_gguf(bb, str(tmp_path / "plain.gguf"), progress=False)


def test_upgrade_cli(files, tmp_path):
    _, river, _ = files
    v1 = _write_format1(river, tmp_path / "old.river.gguf")
    out = tmp_path / "new.river.gguf"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-m", "river_gguf.cli", "upgrade", str(v1), str(out), "-q"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "format 1 -> 2" in r.stdout
    assert river_index.format_version(GGUFReader(str(out))) == 2


def test_metadata_rewrite_keeps_the_river(files, tmp_path):
    _, river, _ = files
    copy = tmp_path / "copy.river.gguf"
    copy.write_bytes(open(river, "rb").read())
    m = Model(str(copy), n_ctx=64, n_threads=1)
    toks = m.tokenize(TEXT)
    want = m.logits(toks, mode="river-only", river_head=True)
    del m
    set_river_metadata(str(copy), {"river.threshold": 0.5, "river.note": "x" * 300})  # header grows
    m = Model(str(copy), n_ctx=64, n_threads=1)
    assert np.array_equal(m.logits(toks, mode="river-only", river_head=True), want)
    assert m.metadata["river.threshold"] == pytest.approx(0.5)


@pytest.mark.parametrize("damage", ["truncated", "offset", "type", "version", "names"])
def test_a_damaged_river_index_is_a_clear_error(files, tmp_path, damage):
    _, river, _ = files
    bad = tmp_path / f"{damage}.gguf"
    data = open(river, "rb").read()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) - 4096])
    else:
        bad.write_bytes(data)
        r = GGUFReader(river)
        n = len(r.fields[river_index.NAMES_KEY].contents())
        del r
        up = {"offset": {river_index.DATA_SIZE_KEY: 64}, "version": {river_index.VERSION_KEY: 3}}.get(damage)
        if up is not None:
            set_river_metadata(str(bad), up)
        else:
            _rewrite_array(bad, damage, n)
    with pytest.raises(GGUFFormatError, match="river|River"):
        Model(str(bad), n_ctx=64, n_threads=1)


def _rewrite_array(path, damage, n):
    """Rewrite one river index array in place of the file (types: an unknown type id; names: too few)."""
    from river_gguf.gguf.io import atomic_output, metadata_items

    r = GGUFReader(str(path))
    river = river_index.river_tensors(r)
    start = river_index.river_data_start(r)
    with atomic_output(str(path)) as tmp:
        with contextlib.closing(gguf.GGUFWriter(tmp, r.fields["general.architecture"].contents())) as w:
            for key, value, vtype, sub in metadata_items(r, skip={"general.alignment"}):
                if damage == "type" and key == river_index.TYPES_KEY:
                    value = [999] + list(value)[1:]
                if damage == "names" and key == river_index.NAMES_KEY:
                    value = list(value)[:-1]
                w.add_key_value(key, value, vtype, sub_type=sub)
            for t in r.tensors:
                w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for t in r.tensors:
                w.write_tensor_data(np.ascontiguousarray(t.data))
        river_index.append_river_data(tmp, [(t.name, t) for t in river], [t.data_offset - start for t in river], 32)
