"""River GGUF writer (convert/build.py), hybrid oracle files (convert/hybrid.py) and tools/add_river_gguf.py."""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import gguf
import llama_cpp

import river_gguf  # noqa: E402
from river_gguf import Model  # noqa: E402
from river_gguf.convert.build import build_river_gguf  # noqa: E402
from river_gguf.convert.hybrid import write_hybrid_gguf  # noqa: E402
from river_gguf.eval.random_model import write_tiny_model  # noqa: E402

from support import PROSE, REPO, THREADS, Oracle, truncate_copy, write_unsupported_arch
from river_gguf.gguf.reader import GGUFReader


QT = gguf.GGMLQuantizationType
TOOL = REPO / "tools" / "add_river_gguf.py"

# river_gguf_path, f16_path, q4_0_path and oracle_factory come from conftest.py.


@functools.lru_cache(maxsize=None)
def _reader(path: str):
    # Only for files never rewritten in the session (GGUFReader on SmolLM2 takes seconds).
    return GGUFReader(path)


def _sha(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def _tiny(tmp_path, name="bb.gguf", **kw):
    kw.setdefault("dtype", "f16")
    return write_tiny_model(tmp_path / name, kw.pop("arch", "llama"), **kw)


def _build_tiny(src, dst, **kw):
    kw.setdefault("threshold", 0.9)  # skip profiling: tiny random models have no meaningful tau
    kw.setdefault("progress", False)
    kw.setdefault("imatrix", None)    # plain rounding and no preset calibration: fast, and the
    kw.setdefault("presets", False)   # file's options stay the ones under test
    kw.setdefault("backbone_type", None)  # the input's backbone as given, and the river the tests
    kw.setdefault("river_type", "q4_0")   # were written for (not the converter's defaults)
    return build_river_gguf(src, dst, **kw)


# ----- the real round trip (SmolLM2 F16 + Q4_0) -------------------------------------------
def test_round_trip_metadata(river_gguf_path, f16_path):
    out, bb = _reader(river_gguf_path), _reader(f16_path)
    for key, field in bb.fields.items():
        if key.startswith("GGUF."):
            continue
        assert key in out.fields, key
        assert out.fields[key].types == field.types, key
        assert out.fields[key].contents() == field.contents(), key
    md = {k: f.contents() for k, f in out.fields.items() if k.startswith("river.")}
    assert md["river.format_version"] == 2
    assert md["river.type"] == "q4_0"
    assert md["river.threshold_source"] == "profile-q0.70"
    assert 0.5 < md["river.threshold"] < 1.0
    assert md["river.min_exit_layer"] == 0
    assert md["river.prefill"] == "backbone"
    assert md["river.head"] is True
    assert md["river.backbone_file"] == os.path.basename(f16_path)
    assert md["river.backbone_sha256"] == _sha(f16_path)
    assert len(md["river.river_sha256"]) == 64
    assert 0 <= md["river.profile_predicted_mean_exit_layer"] < 30
    types = {k: out.fields[k].types[0] for k in md}
    VT = gguf.GGUFValueType
    assert types["river.threshold"] == VT.FLOAT32 and types["river.min_exit_layer"] == VT.UINT32
    assert types["river.head"] == VT.BOOL and types["river.format_version"] == VT.UINT32


def test_round_trip_tensors(river_gguf_path, f16_path, q4_0_path):
    from river_gguf.gguf.river_index import river_tensors

    out, bb, q4 = _reader(river_gguf_path), _reader(f16_path), _reader(q4_0_path)
    # The GGUF index is the backbone's, in its order, with its types and bytes (format 2).
    assert len(out.tensors) == len(bb.tensors)
    for a, b in zip(out.tensors, bb.tensors):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert np.array_equal(a.data, b.data), a.name
    # After it, the river: llama.cpp's Q4_0 of the backbone, byte for byte (quantizing is deterministic).
    river = {t.name: t for t in river_tensors(out)}
    q4_by_name = {t.name: t for t in q4.tensors}
    expected = {"river." + n for n in q4_by_name if n.startswith("blk.")} | {"river.token_embd.weight"}
    assert "output.weight" not in q4_by_name  # SmolLM2 is tied: no river.output.weight
    assert set(river) == expected
    for name, t in river.items():
        src = q4_by_name[name.removeprefix("river.")]
        assert t.tensor_type == src.tensor_type and list(t.shape) == list(src.shape), name
        assert np.array_equal(t.data, src.data), name
    assert river["river.blk.0.attn_q.weight"].tensor_type == QT.Q4_0


def test_round_trip_loads_in_engine(river_gguf_path):
    m = Model(river_gguf_path, n_ctx=128, n_threads=THREADS)
    assert m.has_river
    assert m.exit_options.mode == "river"
    assert m.exit_options.threshold == m.metadata["river.threshold"]
    assert m.exit_options.threshold == pytest.approx(_reader(river_gguf_path).fields["river.threshold"].contents())
    assert m.exit_options.river_head is True
    assert m.exit_options.prefill == "backbone" and m.exit_options.min_exit_layer == 0


def test_stock_llama_cpp_opens_river_gguf_as_the_backbone(river_gguf_path, f16_path):
    """Format 2 keeps the river out of the GGUF tensor index, so llama.cpp loads the file as its
    backbone: the same logits as the backbone file, bit for bit."""

    toks = Model(f16_path, n_ctx=128, n_threads=THREADS).tokenize(PROSE)[:48]
    a = Oracle(river_gguf_path, n_ctx=128).logits(toks)
    assert np.array_equal(a, Oracle(f16_path, n_ctx=128).logits(toks))


# ----- validation -------------------------------------------------------------------------
def test_wrong_architecture_refused(tmp_path, f16_path):
    river = write_tiny_model(tmp_path / "qwen2.gguf", "qwen2")
    out = tmp_path / "out.gguf"
    with pytest.raises(river_gguf.RiverMismatchError, match=r"architecture 'qwen2' but the backbone has 'llama'"):
        _build_tiny(f16_path, out, river_path=river)
    assert not out.exists()


def test_mismatched_shapes_refused(tmp_path):
    bb = _tiny(tmp_path, "bb.gguf", n_ff=128)
    rv = _tiny(tmp_path, "rv.gguf", n_ff=96)
    out = tmp_path / "out.gguf"
    with pytest.raises(river_gguf.RiverMismatchError) as e:
        _build_tiny(bb, out, river_path=rv)
    msg = str(e.value)
    assert "feed_forward_length is 96 in the river but 128 in the backbone" in msg
    assert "blk.0.ffn_up.weight: shape (96, 64) in the river but (128, 64) in the backbone" in msg
    assert isinstance(e.value, ValueError)
    assert not out.exists()


def test_missing_layer_tensor_refused(tmp_path):
    bb = _tiny(tmp_path, "bb.gguf", n_layer=2)
    rv = _tiny(tmp_path, "rv.gguf", n_layer=3)
    with pytest.raises(river_gguf.RiverMismatchError, match=r"block_count is 3 in the river but 2 in the backbone.*"
                       r"blk\.2\.\S+: in the river but not in the backbone"):
        _build_tiny(bb, tmp_path / "out.gguf", river_path=rv)


def test_given_river_checked_before_the_pass_over_the_input(tmp_path, monkeypatch):
    # Another model, or a River GGUF, as --river is refused before the calibration pass (the
    # input's whole F16 pass: minutes on a large model), with the defaults that run it.
    from river_gguf.convert import build

    def no_pass(*a, **k):
        raise AssertionError("the pass over the input started before the river was checked")

    monkeypatch.setattr(build, "_CalibrationPass", no_pass)
    bb = _tiny(tmp_path, "bb.gguf", n_ff=128)
    other = _tiny(tmp_path, "other.gguf", n_ff=96)
    with pytest.raises(river_gguf.RiverMismatchError, match="feed_forward_length"):
        build_river_gguf(bb, tmp_path / "out.gguf", river_path=other, progress=False, n_threads=1)
    river = tmp_path / "first.river.gguf"
    monkeypatch.undo()
    _build_tiny(bb, river, river_type="q8_0")
    monkeypatch.setattr(build, "_CalibrationPass", no_pass)
    with pytest.raises(ValueError, match="itself a River GGUF"):
        build_river_gguf(bb, tmp_path / "out.gguf", river_path=river, progress=False, n_threads=1)
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize("which", ["backbone", "river"])
def test_truncated_input_refused(tmp_path, which):
    good = _tiny(tmp_path, "good.gguf")
    bad = truncate_copy(good, tmp_path / "bad.gguf", 0.6)
    out = tmp_path / "out.gguf"
    args = (bad, out, {}) if which == "backbone" else (good, out, {"river_path": bad})
    with pytest.raises(river_gguf.GGUFFormatError):
        _build_tiny(args[0], args[1], **args[2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf", "good.gguf"]


def test_not_gguf_and_unsupported_refused(tmp_path):
    txt = tmp_path / "notes.gguf"
    txt.write_text("not a model\n" * 100)
    with pytest.raises(river_gguf.GGUFFormatError):
        _build_tiny(txt, tmp_path / "out.gguf")
    mamba = write_unsupported_arch(tmp_path / "mamba.gguf")
    with pytest.raises(river_gguf.UnsupportedModelError):
        _build_tiny(mamba, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_bad_options_refused(tmp_path):
    bb = _tiny(tmp_path)
    for kw in ({"min_exit_layer": 2}, {"min_exit_layer": -1}, {"prefill": "sometimes"}, {"threshold": float("nan")},
               {"river_type": "q9_9"}):
        with pytest.raises(ValueError):
            _build_tiny(bb, tmp_path / "out.gguf", **kw)
    with pytest.raises(ValueError, match="overwrite"):
        _build_tiny(bb, bb)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bb.gguf"]


@pytest.mark.parametrize("river_type", ["q4_1", "q5_1"])
def test_q4_1_grid_river_warns(tmp_path, river_type):
    bb = _tiny(tmp_path, n_embd=64)
    with pytest.warns(UserWarning, match=river_type):
        _build_tiny(bb, tmp_path / "out.gguf", river_type=river_type)


# ----- writing ------------------------------------------------------------------------------
def test_options_written_and_inputs_unchanged(tmp_path):
    bb = _tiny(tmp_path, "bb.gguf", seed=1)
    rv = _tiny(tmp_path, "rv.gguf", seed=2, dtype="f32")  # any same-shaped model may serve as river
    before = {p: _sha(p) for p in (bb, rv)}
    out = tmp_path / "out.gguf"
    meta = _build_tiny(bb, out, river_path=rv, threshold=0.8, min_exit_layer=1, river_head=False, prefill="river")
    assert {p: _sha(p) for p in (bb, rv)} == before
    assert meta["river.type"] == "from-file" and meta["river.threshold_source"] == "user"
    assert meta["river.river_file"] == "rv.gguf" and meta["river.river_sha256"] == before[rv]
    assert "river.profile_predicted_mean_exit_layer" not in meta
    from river_gguf.gguf.river_index import river_tensors

    r = GGUFReader(out)
    river = {t.name: t for t in river_tensors(r)}
    assert "river.output.weight" in river and "river.token_embd.weight" in river  # untied river
    assert river["river.blk.1.ffn_up.weight"].tensor_type == QT.F32
    m = Model(str(out), n_ctx=64, n_threads=1)
    o = m.exit_options
    assert m.has_river and (o.threshold, o.min_exit_layer, o.river_head, o.prefill) == (
        pytest.approx(0.8), 1, False, "river")


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    bb = _tiny(tmp_path)
    before = _sha(bb)
    calls = []
    from river_gguf.gguf import copy as gguf_copy

    real = gguf_copy.write_one

    def flaky(w, t):
        calls.append(t.name)
        if len(calls) == 10:
            raise KeyboardInterrupt("simulated ^C mid-write")
        real(w, t)

    monkeypatch.setattr(gguf_copy, "write_one", flaky)
    with pytest.raises(KeyboardInterrupt):
        _build_tiny(bb, tmp_path / "out.gguf")
    assert len(calls) == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bb.gguf"]  # no output, no temp files
    assert _sha(bb) == before


def test_river_gguf_input_refused_then_replaced(tmp_path):
    bb = _tiny(tmp_path)
    first = tmp_path / "first.river.gguf"
    _build_tiny(bb, first, river_type="q8_0")
    with pytest.raises(ValueError, match="already is a River GGUF.*replace_river"):
        _build_tiny(first, tmp_path / "again.gguf")
    with pytest.raises(ValueError, match="itself a River GGUF"):
        _build_tiny(bb, tmp_path / "again.gguf", river_path=first)
    assert not (tmp_path / "again.gguf").exists()

    again = tmp_path / "again.gguf"
    meta = _build_tiny(first, again, river_type="q4_0", threshold=0.7, replace_river=True)
    assert meta["river.type"] == "q4_0"
    r, b = GGUFReader(again), GGUFReader(bb)
    names = [t.name for t in r.tensors]
    assert len(names) == len(set(names))
    plain = [t for t in r.tensors if not t.name.startswith("river.")]
    assert [t.name for t in plain] == [t.name for t in b.tensors]
    for x, y in zip(plain, b.tensors):
        assert x.tensor_type == y.tensor_type and np.array_equal(x.data, y.data)
    from river_gguf.gguf.river_index import river_tensors

    river = river_tensors(r)
    n_layer_tensors = sum(t.name.startswith("blk.") for t in b.tensors)
    assert len(river) == n_layer_tensors + 2  # + river.token_embd + river.output (untied)
    assert {t.name: t for t in river}["river.blk.0.attn_q.weight"].tensor_type == QT.Q4_0
    assert r.fields["river.threshold"].contents() == pytest.approx(0.7)
    assert r.fields["river.type"].contents() == "q4_0"
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == ["again.gguf", "bb.gguf", "first.river.gguf"]
    assert Model(str(again), n_ctx=64, n_threads=1).has_river


# ----- the command-line tool ------------------------------------------------------------------
def _run_tool(*args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tool must find ../python itself
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_tool_end_to_end(tmp_path):
    bb = _tiny(tmp_path)
    out = tmp_path / "bb.river.gguf"
    p = _run_tool(bb, "-o", out, "--river-type", "q8_0", "--threshold", "0.93", "--min-exit-layer", "1",
                  "--no-river-head", "--prefill", "river", "--imatrix", "none", "--no-presets", "-q")
    assert p.returncode == 0, p.stderr
    assert "q8_0" in p.stdout and "0.9300 (cosine, user)" in p.stdout and "MiB" in p.stdout
    o = Model(str(out), n_ctx=64, n_threads=1).exit_options
    assert (o.threshold, o.min_exit_layer, o.river_head, o.prefill) == (pytest.approx(0.93), 1, False, "river")

    p = _run_tool(out, "-o", tmp_path / "x.gguf", "--threshold", "0.9", "-q", "--no-presets")
    assert p.returncode == 2 and "already is a River GGUF" in p.stderr and "Traceback" not in p.stderr
    bad = truncate_copy(bb, tmp_path / "bad.gguf", 0.5)
    p = _run_tool(bad, "-o", tmp_path / "x.gguf", "--threshold", "0.9", "-q")
    assert p.returncode == 2 and p.stderr.startswith("error:")
    assert not (tmp_path / "x.gguf").exists()


# ----- hybrid files (the stock llama.cpp oracle for forced exits) ----------------------------
def test_hybrid_layer_types_and_llama_cpp_loads(tmp_path, river_gguf_path, oracle_factory):
    out = tmp_path / "hybrid10.gguf"
    write_hybrid_gguf(river_gguf_path, river_gguf_path, out, exit_layer=10, river_head=True)
    r = GGUFReader(out)
    t = {x.name: x for x in r.tensors}
    assert not any(n.startswith("river.") for n in t) and not any(k.startswith("river.") for k in r.fields)
    for i in range(30):
        want = QT.F16 if i <= 10 else QT.Q4_0
        assert t[f"blk.{i}.attn_q.weight"].tensor_type == want, i
        assert t[f"blk.{i}.attn_norm.weight"].tensor_type == QT.F32
    assert t["token_embd.weight"].tensor_type == QT.F16  # the backbone's embedding
    assert t["output.weight"].tensor_type == QT.Q8_0  # the river's tied head, written explicitly
    o = oracle_factory(str(out), 256)
    toks = o.llm.tokenize(PROSE.encode())[:32]
    logits = o.logits(toks)
    assert logits.shape == (len(toks), 49152) and np.isfinite(logits).all()


def test_hybrid_endpoints_equal_plain_files(tmp_path, river_gguf_path, f16_path, q4_0_path, oracle_factory):
    """exit -1 with the river head is the Q4_0 model; exit n_layer-1 with the backbone head is the F16 one."""
    # The River GGUF as both inputs: its plain tensors are the backbone, its river.* ones the river.
    river_only = write_hybrid_gguf(river_gguf_path, river_gguf_path, tmp_path / "all-river.gguf", -1, True)
    backbone = write_hybrid_gguf(river_gguf_path, river_gguf_path, tmp_path / "all-backbone.gguf", 29, False)
    toks = oracle_factory(f16_path, 256).llm.tokenize(PROSE.encode())[:24]
    for hybrid, plain in ((river_only, q4_0_path), (backbone, f16_path)):
        a = oracle_factory(hybrid, 256).logits(toks)
        b = oracle_factory(plain, 256).logits(toks)
        assert np.array_equal(a, b), (hybrid, np.abs(a - b).max())
    with pytest.raises(ValueError, match="exit_layer"):
        write_hybrid_gguf(river_gguf_path, river_gguf_path, tmp_path / "bad.gguf", 30, False)


def test_hybrid_untied_tiny(tmp_path):
    bb = _tiny(tmp_path, "bb.gguf", seed=1)
    rv = _tiny(tmp_path, "rv.gguf", seed=2, dtype="f32")
    h = write_hybrid_gguf(bb, rv, tmp_path / "h.gguf", exit_layer=0, river_head=True)
    t = {x.name: x for x in GGUFReader(h).tensors}
    src_b = {x.name: x for x in GGUFReader(bb).tensors}
    src_r = {x.name: x for x in GGUFReader(rv).tensors}
    assert np.array_equal(t["blk.0.ffn_up.weight"].data, src_b["blk.0.ffn_up.weight"].data)
    assert np.array_equal(t["blk.1.ffn_up.weight"].data, src_r["blk.1.ffn_up.weight"].data)
    assert np.array_equal(t["output.weight"].data, src_r["output.weight"].data)
    assert np.array_equal(t["token_embd.weight"].data, src_b["token_embd.weight"].data)
    h2 = write_hybrid_gguf(bb, rv, tmp_path / "h2.gguf", exit_layer=-1, river_head=True)
    t2 = {x.name: x for x in GGUFReader(h2).tensors}
    assert np.array_equal(t2["token_embd.weight"].data, src_r["token_embd.weight"].data)
    llm = llama_cpp.Llama(str(h2), n_ctx=64, verbose=False)
    llm.close()


def test_river_head_type(tmp_path):
    bb = _tiny(tmp_path, n_embd=64, tied=True)
    out = tmp_path / "h.river.gguf"
    _build_tiny(bb, out, river_type="q4_0", river_head_type="q8_0")
    from river_gguf.gguf.river_index import river_tensors

    types = {t.name: t.tensor_type for t in river_tensors(GGUFReader(out))}
    assert types["river.token_embd.weight"] == QT.Q8_0 and types["river.blk.0.attn_q.weight"] == QT.Q4_0
    # A type whose block does not divide the head's rows is refused before llama.cpp sees it.
    with pytest.raises(ValueError, match="multiple of 256"):
        _build_tiny(bb, tmp_path / "bad.gguf", river_type="q4_0", river_head_type="q6_k")
    assert not (tmp_path / "bad.gguf").exists()


def test_q8_0_backbone_parity(tmp_path, f16_path, derived, oracle_factory):
    # --backbone-type q8_0 stores llama.cpp's own Q8_0 of the input as the backbone: its
    # backbone mode equals stock llama.cpp on the plain Q8_0 file, and the river is still made
    # from the F16 (identical to a river built beside the F16 backbone).
    out = tmp_path / "q8.river.gguf"
    meta = build_river_gguf(f16_path, out, river_type="q4_0", threshold=0.97, progress=False, imatrix=None,
                            presets=False, backbone_type="q8_0")
    assert meta["river.backbone_type"] == "q8_0"
    q8 = derived("q8_0")
    got = {t.name: t for t in GGUFReader(out).tensors}
    for t in _reader(q8).tensors:
        assert got[t.name].tensor_type == t.tensor_type and np.array_equal(got[t.name].data, t.data), t.name
    m = Model(str(out), n_ctx=256, n_threads=THREADS)
    toks = m.tokenize(PROSE)
    ours = m.logits(toks, mode="backbone")
    ref = oracle_factory(q8, 256).logits(toks)
    assert np.abs(ours - ref).max() < 2e-3 and (ours.argmax(1) == ref.argmax(1)).all()
    from river_gguf.gguf.river_index import river_tensors

    assert any(t.name.startswith("river.blk.") and t.tensor_type == QT.Q4_0 for t in river_tensors(_reader(str(out))))
