"""Activation-aware (importance-matrix) river: statistics, llama.cpp's imatrix GGUF, the river the
converter makes with llama.cpp's quantizer given the matrix (against ggml's weighted rounding and
llama.cpp's own llama-quantize), and the resulting river against stock llama.cpp."""
import contextlib
import pathlib
import subprocess

import gguf
import numpy as np
import pytest

from river_gguf import GGUFFormatError, Model, _native
from river_gguf.measure import data as eval_data
from river_gguf.eval import report as evaluate
from river_gguf.measure import scoring
from river_gguf.gguf.io import copy_metadata
from river_gguf.convert import build
from river_gguf.convert.build import build_river_gguf
from river_gguf.convert.imatrix import (
    Imatrix,
    calibration_texts,
    collect_imatrix,
    llama_quantize,
    read_imatrix_gguf,
    write_imatrix_gguf,
)
from river_gguf.gguf import io as gguf_io
from river_gguf.gguf.river_index import river_tensors
from river_gguf.eval.random_model import write_tiny_model

from support import LOGIT_TOL, Oracle, PROSE
from river_gguf.gguf.reader import GGUFReader


TEXTS = [PROSE, "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
QKV = ("attn_q", "attn_k", "attn_v")
# One thread: on a busy 2-core machine, two ggml threads spin at every node's barrier and a
# single-token decode step can take seconds; one thread has no barriers.
THREADS = 1


def _copy_with(src, dst, changes):
    """A copy of GGUF ``src`` whose tensors named in ``changes`` are replaced by f(data)."""
    r = GGUFReader(src)
    with contextlib.closing(gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())) as w:
        copy_metadata(r, w)
        for t in r.tensors:
            data = np.array(t.data)
            if t.name in changes:
                data = changes[t.name](data)
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return str(dst)


def _tensors(path):
    return {t.name: t for t in GGUFReader(path).tensors}


# ----- collection -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("imx") / "tiny.gguf", "llama", tied=True, seed=3)


def test_statistic_is_the_sum_of_squared_inputs(tiny):
    """Layer 0's q/k/v read rms_norm(embedding) * attn_norm: recompute that in numpy."""
    imx = collect_imatrix(tiny, TEXTS, n_threads=THREADS, progress=False)
    m = Model(tiny, n_ctx=512, n_threads=THREADS)
    toks = [m.tokenize(t)[:1024] for t in TEXTS]
    n = sum(len(t) for t in toks)
    assert imx.n_tokens == n and imx.chunk_count == 2
    # Every weight mat-mul is observed on every token, the tied head (token_embd) included.
    names = {f"blk.{i}.{w}.weight" for i in range(2)
             for w in QKV + ("attn_output", "ffn_gate", "ffn_up", "ffn_down")} | {"token_embd.weight"}
    assert set(imx.names()) == names
    assert all(imx.counts[k] == n for k in names)

    t = _tensors(tiny)
    emb = np.array(t["token_embd.weight"].data, dtype=np.float64)
    norm = np.array(t["blk.0.attn_norm.weight"].data, dtype=np.float64)
    x = emb[np.concatenate(toks)]
    x = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-5) * norm
    want = (x * x).sum(axis=0)
    for w in QKV:
        np.testing.assert_allclose(imx.sums[f"blk.0.{w}.weight"], want, rtol=2e-5)
        np.testing.assert_allclose(imx.importance(f"blk.0.{w}.weight"), want / n, rtol=2e-5)
    assert imx.sums["blk.0.ffn_down.weight"].shape == (128,)  # ffn_down reads n_ff columns
    # The head's input is the final norm's output, the backbone's embeddings (its statistic is
    # taken from those rows without running the head).
    head = sum((m.embed(tk).astype(np.float64) ** 2).sum(axis=0) for tk in toks)
    np.testing.assert_allclose(imx.sums["token_embd.weight"], head, rtol=1e-5)


def test_importance_scales_with_the_input(tiny, tmp_path):
    """Column j of attn_norm times 3 multiplies column j of the q/k/v input by 3: its mean square
    by 9, every other column of layer 0's q/k/v unchanged."""
    j = 5
    scaled = _copy_with(tiny, tmp_path / "scaled.gguf",
                        {"blk.0.attn_norm.weight": lambda a: a * np.where(np.arange(a.size) == j, 3.0, 1.0).astype(a.dtype)})
    a = collect_imatrix(tiny, TEXTS, n_threads=THREADS, progress=False)
    b = collect_imatrix(scaled, TEXTS, n_threads=THREADS, progress=False)
    for w in QKV:
        name = f"blk.0.{w}.weight"
        ratio = b.importance(name) / a.importance(name)
        assert abs(ratio[j] - 9.0) < 1e-4
        np.testing.assert_allclose(np.delete(ratio, j), 1.0, rtol=1e-5)
        assert a.counts[name] == b.counts[name] == a.n_tokens
    # Downstream inputs do change (the model is different), so the test would see a mix-up.
    assert not np.allclose(a.sums["blk.1.attn_q.weight"], b.sums["blk.1.attn_q.weight"])


def test_collection_errors_and_the_observer_is_removed(tiny, tmp_path):
    wide = write_tiny_model(tmp_path / "wide.gguf", "llama", n_embd=128, tied=True)
    m = Model(tiny, n_ctx=512, n_threads=THREADS)
    toks = m.tokenize(PROSE)
    stats = _native.ActivationStats()
    m.collect_activations(toks, stats)
    assert len(stats) == 15
    with pytest.raises(ValueError):
        m.collect_activations([], stats)
    # The same statistics for a model of another width: refused, not mixed.
    m2 = Model(wide, n_ctx=512, n_threads=THREADS)
    with pytest.raises(RuntimeError, match="input width"):
        m2.collect_activations(toks, stats)
    with pytest.raises(RuntimeError, match="failed collection"):
        m.collect_activations(toks, stats)
    stats.clear()
    assert len(stats) == 0
    # The observer is gone after the failure: decode steps keep their graphs again (they are
    # never kept while observing), and results equal a fresh engine's.
    with m2.session(mode="backbone") as s:
        s.extend(toks[:4])
        s.extend([toks[4]], decode=True)
    assert m2.graph_counts["kept"] == 1
    with pytest.raises(ValueError):
        collect_imatrix(tiny, [], progress=False)
    with pytest.raises(ValueError):
        collect_imatrix(tiny, "one string", progress=False)


# ----- quantize_rows --------------------------------------------------------------------
def test_quantize_rows_checks_its_input():
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q40 = int(gguf.GGMLQuantizationType.Q4_0)
    assert _native.quantize_rows(q40, x, None).shape == (4, 36)  # 2 blocks of 18 bytes per row
    bad = [
        dict(ggml_type=q40, data=x[:, :60]),                                  # not whole blocks
        dict(ggml_type=99, data=x),                                           # no such type
        dict(ggml_type=int(gguf.GGMLQuantizationType.I32), data=x),           # not quantizable
        dict(ggml_type=int(gguf.GGMLQuantizationType.IQ2_XXS), data=np.zeros((1, 256), np.float32)),  # needs importance
        dict(ggml_type=q40, data=x.astype(np.float64)),
        dict(ggml_type=q40, data=x[0]),
        dict(ggml_type=q40, data=x, importance=np.ones(32, np.float32)),
        dict(ggml_type=q40, data=x, importance=-np.ones(64, np.float32)),
        dict(ggml_type=q40, data=np.full((1, 32), np.nan, np.float32)),
        dict(ggml_type=q40, data=x, n_threads=0),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            _native.quantize_rows(**kw)
    # Weighting changes the rounding, and threads do not change the bytes.
    w = np.linspace(0.01, 10, 64).astype(np.float32)
    a = _native.quantize_rows(q40, x, w, n_threads=1)
    assert not np.array_equal(a, _native.quantize_rows(q40, x, None))
    assert np.array_equal(a, _native.quantize_rows(q40, x, w, n_threads=3))


# ----- the SmolLM2 imatrix river --------------------------------------------------------
@pytest.fixture(scope="module")
def smol_imatrix(f16_path):
    # A few calibration texts keep the test fast; the converter uses the whole split.
    texts = calibration_texts()
    assert texts and len(texts) == len(eval_data.select(eval_data.load_domain("gsm8k"), "calibration")) + len(
        eval_data.select(eval_data.load_domain("humaneval"), "calibration"))
    return collect_imatrix(f16_path, texts[:3] + texts[-3:], n_ctx=256, n_threads=THREADS, progress=False)


@pytest.fixture(scope="module")
def imatrix_river(smol_imatrix, f16_path, tmp_path_factory):
    """The Q4_0 river as the converter makes it: llama.cpp's quantizer given the matrix."""
    out = tmp_path_factory.mktemp("imx-river") / "smollm2-imatrix-q4_0.gguf"
    return llama_quantize(f16_path, out, "q4_0", smol_imatrix)


def test_river_is_ggml_weighted_rounding_of_the_mean_squares(smol_imatrix, imatrix_river, f16_path):
    """Oracle: ggml's weighted rounding (quantize_rows) of each F16 weight with the matrix's
    importance, its mean square per column. llama.cpp's quantizer, given the Imatrix, writes those
    bytes for every quantized tensor: the importance reaches it as the statistic, each weight by
    its own name (its imatrix mix decides the types: Q4_1 for the first layers' ffn_down)."""
    src, river = _tensors(f16_path), _tensors(imatrix_river)
    assert river["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
    weighted = 0
    for name, t in river.items():
        if t.tensor_type.name in ("F32", "F16"):
            continue
        assert name in smol_imatrix, name  # 30 layers x 7 mat-muls and the tied head, all observed
        x = gguf.quants.dequantize(src[name].data, src[name].tensor_type).astype(np.float32, copy=False)
        q = _native.quantize_rows(int(t.tensor_type), np.ascontiguousarray(x.reshape(-1, int(t.shape[0]))),
                                  smol_imatrix.importance(name), THREADS)
        assert np.array_equal(q.reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), name
        weighted += 1
    assert weighted == 211


def test_imatrix_river_in_llama_cpp_and_quality(imatrix_river, f16_path, q4_0_path):
    plain, weighted = _tensors(q4_0_path), _tensors(imatrix_river)
    # llama.cpp's mix with a matrix: the first n_layer/8 ffn_down become Q4_1; no other type moves.
    retyped = sorted(n for n in plain if plain[n].tensor_type != weighted[n].tensor_type)
    assert retyped == [f"blk.{i}.ffn_down.weight" for i in range(30 // 8)]
    assert all(weighted[n].tensor_type == gguf.GGMLQuantizationType.Q4_1 for n in retyped)
    changed = [n for n in plain if n not in retyped and not np.array_equal(plain[n].data, weighted[n].data)]
    # Every other Q4_0 tensor changed; the Q8_0 embedding cannot use importance (ggml's Q8_0 ignores it).
    assert len(changed) == 210 - len(retyped) and "token_embd.weight" not in changed

    # threshold given: two plain files would otherwise be profiled for a tau river-only never uses.
    m = Model(f16_path, river=imatrix_river, n_ctx=512, n_threads=THREADS, mode="river-only", river_head=True,
              threshold=0.97)
    toks = m.tokenize(PROSE)
    oracle = Oracle(imatrix_river)
    try:
        assert np.abs(m.logits(toks) - oracle.logits(toks)).max() < LOGIT_TOL
    finally:
        oracle.close()

    # Quality smoke check on evaluation text (never calibration text).
    m_plain = Model(f16_path, river=q4_0_path, n_ctx=512, n_threads=THREADS, threshold=0.97)
    items = []
    for d in eval_data.DOMAINS:
        items += eval_data.select(eval_data.load_domain(d), "evaluation", limit=2)
    prep = evaluate.prepare(m, items, score_tokens=64, prompt_tokens=128)
    ppl_imx = scoring.score_items(m, prep, mode="river-only", river_head=True).perplexity
    ppl_plain = scoring.score_items(m_plain, prep, mode="river-only", river_head=True).perplexity
    assert ppl_imx < ppl_plain


def test_an_importance_matrix_of_another_model_is_refused_before_the_pass(smol_imatrix, tiny, tmp_path,
                                                                          monkeypatch):
    """The converter reads a given matrix and checks it against the input's weights before the
    pass over the input (llama.cpp's quantizer would stop at the first weight it does not fit, after
    that pass, or round every weight plainly where no name matches); llama_quantize checks the
    same. Oracle: SmolLM2's matrix has 576 values per weight where the tiny model has 64 columns."""
    def no_pass(*a, **k):
        raise AssertionError("the pass over the input started before the matrix was checked")

    smol = write_imatrix_gguf(smol_imatrix, tmp_path / "smol.imatrix.gguf")
    name = "mamba.in_proj.weight"  # no weight of the tiny llama
    foreign = write_imatrix_gguf(Imatrix(sums={name: np.ones(64)}, counts={name: 4}), tmp_path / "foreign.imatrix.gguf")
    out = tmp_path / "x.gguf"
    monkeypatch.setattr(build, "_CalibrationPass", no_pass)
    with pytest.raises(ValueError, match="576 importance values but the model's weight has 64 columns"):
        build_river_gguf(tiny, out, imatrix=smol, progress=False, n_threads=THREADS)
    with pytest.raises(ValueError, match="names none of the model's weights"):
        build_river_gguf(tiny, out, imatrix=foreign, progress=False, n_threads=THREADS)
    with pytest.raises(ValueError, match="64 columns"):
        llama_quantize(tiny, out, "q4_0", smol_imatrix)
    with pytest.raises(ValueError):
        llama_quantize(tiny, out, "q4_0", [1, 2])
    with pytest.raises(FileNotFoundError):
        llama_quantize(tmp_path / "missing.gguf", out, "q4_0", smol_imatrix)
    assert not out.exists()


def test_a_quantized_input_is_requantized_with_a_warning(tiny, tmp_path):
    """The river is made from the input, so a quantized input gives a river of 4-bit weights
    rounded again: the converter says so (llama.cpp's quantizer requantizes when told to)."""
    q4 = gguf_io.quantize(tiny, tmp_path / "tiny.q4_0.gguf", "q4_0", n_threads=THREADS)
    with pytest.warns(UserWarning, match="already quantized; the river is requantized"):
        meta = build_river_gguf(q4, tmp_path / "out.gguf", river_type="q4_0", imatrix=None, presets=False,
                                threshold=0.9, progress=False, n_threads=THREADS)
    assert meta["river.backbone_type"] == "as input"  # auto keeps a quantized input's types


# ----- the imatrix GGUF -----------------------------------------------------------------
def test_imatrix_gguf_round_trip(smol_imatrix, tmp_path):
    path = write_imatrix_gguf(smol_imatrix, tmp_path / "smol.imatrix.gguf")
    back = read_imatrix_gguf(path)
    assert back.names() == smol_imatrix.names()
    for n in back.names():
        assert np.array_equal(back.sums[n], smol_imatrix.sums[n]) and back.counts[n] == smol_imatrix.counts[n]
    assert (back.datasets, back.chunk_count, back.chunk_size, back.n_tokens) == (
        smol_imatrix.datasets, smol_imatrix.chunk_count, smol_imatrix.chunk_size, smol_imatrix.n_tokens)

    # llama.cpp's layout: general.type, u32 chunk keys, string-array datasets, no architecture,
    # F32 <name>.in_sum2 [n_cols, 1] and <name>.counts [1, 1].
    r = GGUFReader(path)
    assert r.fields["general.type"].contents() == "imatrix"
    assert "general.architecture" not in r.fields
    assert r.fields["imatrix.chunk_count"].types == [gguf.GGUFValueType.UINT32]
    assert r.fields["imatrix.chunk_size"].types == [gguf.GGUFValueType.UINT32]
    assert r.fields["imatrix.datasets"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]
    t = {x.name: x for x in r.tensors}
    assert [int(v) for v in t["blk.0.ffn_down.weight.in_sum2"].shape] == [1536, 1]
    assert [int(v) for v in t["blk.0.ffn_down.weight.counts"].shape] == [1, 1]
    assert t["blk.0.ffn_down.weight.counts"].tensor_type == gguf.GGMLQuantizationType.F32


def test_read_imatrix_gguf_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="not an imatrix"):
        read_imatrix_gguf(tiny)
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"\x01\x00\x00\x00not a gguf at all" * 8)
    with pytest.raises(GGUFFormatError):
        read_imatrix_gguf(junk)
    with pytest.raises(FileNotFoundError):
        read_imatrix_gguf(tmp_path / "missing.gguf")
    # Sums without counts.
    lone = tmp_path / "lone.gguf"
    with contextlib.closing(gguf.GGUFWriter(lone, "imatrix")) as w:
        w.add_type("imatrix")
        w.add_tensor("blk.0.attn_q.weight.in_sum2", np.ones((1, 8), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    with pytest.raises(ValueError, match="pair up"):
        read_imatrix_gguf(lone)
    with pytest.raises(ValueError):
        write_imatrix_gguf(Imatrix(), tmp_path / "empty.gguf")
    with pytest.raises(ValueError):
        Imatrix(sums={"a.weight": np.ones(4)}, counts={})


#: llama.cpp's own llama-quantize: scripts/build_llama_quantize.sh builds it against .venv's libllama
#: (scripts/test.sh and CI run that first); scripts/build_llama_tools.sh's full build also has one.
LLAMA_QUANTIZE = [pathlib.Path(__file__).resolve().parents[2] / ".cache" / "llama-tools" / p / "llama-quantize"
                  for p in ("quantize", "build/bin")]


def _llama_quantize_binary() -> str:
    found = [str(p) for p in LLAMA_QUANTIZE if p.is_file()]
    assert found, ("llama.cpp's llama-quantize is not built: run ./scripts/build_llama_quantize.sh "
                   "(about 15 s of CPU); looked for " + ", ".join(map(str, LLAMA_QUANTIZE)))
    return found[0]


def test_converted_river_is_llama_quantize_with_the_imatrix(tmp_path):
    """The river a default conversion stores (importance matrix collected on the calibration
    split) is, byte for byte, what llama.cpp's llama-quantize --imatrix FILE writes, run as a
    process on the same F16 with the converter's matrix written out (imatrix_out); and the
    matrix changed the rounding: llama-quantize without it writes other bytes."""
    tool = _llama_quantize_binary()
    src = write_tiny_model(tmp_path / "bb.gguf", "llama", n_layer=4, dtype="f16", seed=21)
    out, imx = tmp_path / "out.gguf", tmp_path / "converter.imatrix.gguf"
    meta = build_river_gguf(src, out, river_type="q4_k_m", backbone_type=None, presets=False, threshold=0.9,
                            progress=False, n_threads=THREADS, calibration_tokens=64, imatrix_out=imx)
    assert meta["river.imatrix"].startswith("collected") and imx.is_file()

    def quantize(dst, *extra):
        r = subprocess.run([tool, *extra, str(src), str(dst), "Q4_K_M", str(THREADS)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return _tensors(dst)

    ref = quantize(tmp_path / "ref.gguf", "--imatrix", str(imx))
    river = {t.name[len("river."):]: t for t in river_tensors(GGUFReader(out))}
    assert river and set(river) <= set(ref)
    for name, t in river.items():
        assert t.tensor_type == ref[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(ref[name].data).view(np.uint8)), name
    plain = quantize(tmp_path / "plain.gguf")
    assert any(not np.array_equal(np.asarray(river[n].data), np.asarray(plain[n].data)) for n in river
               if river[n].tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16))
    # Without a matrix (--imatrix none) the river is llama-quantize's plain rounding, byte for byte.
    build_river_gguf(src, tmp_path / "plain.river.gguf", river_type="q4_k_m", imatrix=None, backbone_type=None,
                     presets=False, threshold=0.9, progress=False, n_threads=THREADS)
    river = {t.name[len("river."):]: t for t in river_tensors(GGUFReader(tmp_path / "plain.river.gguf"))}
    for name, t in river.items():
        assert t.tensor_type == plain[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(plain[name].data).view(np.uint8)), name

