"""Activation-aware (importance-matrix) river: statistics, llama.cpp's imatrix GGUF, weighted
quantization, and the resulting river against stock llama.cpp."""
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
from river_gguf.convert.imatrix import (
    Imatrix,
    calibration_texts,
    collect_imatrix,
    llama_quantize,
    quantize_with_imatrix,
    read_imatrix_gguf,
    write_imatrix_gguf,
)
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


def test_plain_requantization_is_llama_cpps_q4_0(f16_path, q4_0_path, tmp_path):
    """Without importance, quantize_with_imatrix rebuilds every quantized tensor of llama.cpp's
    Q4_0 from the F16 backbone byte for byte (Q4_0 layers and the Q8_0 embedding)."""
    out = tmp_path / "plain.gguf"
    s = quantize_with_imatrix(f16_path, q4_0_path, out, Imatrix(), progress=False, plain_missing=True)
    ref, got = _tensors(q4_0_path), _tensors(out)
    n_quant = sum(1 for t in ref.values() if t.tensor_type.name not in ("F32", "F16"))
    assert s.plain == n_quant > 200 and s.weighted == 0
    assert list(ref) == list(got)
    for name, t in ref.items():
        assert got[name].tensor_type == t.tensor_type and np.array_equal(got[name].data, t.data), name
    ra, rb = GGUFReader(q4_0_path), GGUFReader(out)
    assert {k for k in ra.fields if not k.startswith("GGUF.")} == {k for k in rb.fields if not k.startswith("GGUF.")}


# ----- the SmolLM2 imatrix river --------------------------------------------------------
@pytest.fixture(scope="module")
def smol_imatrix(f16_path):
    # A few calibration texts keep the test fast; the converter uses the whole split.
    texts = calibration_texts()
    assert texts and len(texts) == len(eval_data.select(eval_data.load_domain("gsm8k"), "calibration")) + len(
        eval_data.select(eval_data.load_domain("humaneval"), "calibration"))
    return collect_imatrix(f16_path, texts[:3] + texts[-3:], n_ctx=256, n_threads=THREADS, progress=False)


@pytest.fixture(scope="module")
def imatrix_river(smol_imatrix, f16_path, q4_0_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("imx-river") / "smollm2-imatrix-q4_0.gguf"
    s = quantize_with_imatrix(f16_path, q4_0_path, out, smol_imatrix, progress=False)
    assert s.weighted == 211 and s.plain == 0  # 30 layers x 7 mat-muls + the tied head
    return str(out)


def test_weighted_quantization_is_llama_cpps(smol_imatrix, f16_path, tmp_path):
    """llama.cpp's quantizer given the same importance writes the same bytes as ours (its file
    also decides the types, including its imatrix mix's Q4_1 ffn_down in the first layers)."""
    ref = llama_quantize(f16_path, tmp_path / "llama-imx.gguf", "q4_0", smol_imatrix)
    out = tmp_path / "ours.gguf"
    s = quantize_with_imatrix(f16_path, ref, out, smol_imatrix, progress=False)
    assert s.weighted == 211
    a, b = _tensors(ref), _tensors(out)
    assert a["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1
    for name, t in a.items():
        assert np.array_equal(b[name].data, t.data), name


def test_imatrix_river_in_llama_cpp_and_quality(imatrix_river, f16_path, q4_0_path):
    plain, weighted = _tensors(q4_0_path), _tensors(imatrix_river)
    changed = [n for n in plain if not np.array_equal(plain[n].data, weighted[n].data)]
    # Every Q4_0 tensor changed; the Q8_0 embedding cannot use importance (ggml's Q8_0 ignores it).
    assert len(changed) == 210 and "token_embd.weight" not in changed

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


def test_quantize_with_imatrix_refuses_bad_input(smol_imatrix, tiny, f16_path, q4_0_path, tmp_path):
    out = tmp_path / "x.gguf"
    # An imatrix of another model: widths differ.
    with pytest.raises(ValueError, match="columns"):
        quantize_with_imatrix(f16_path, q4_0_path, out, {"blk.0.attn_q.weight": np.ones(64, np.float32)},
                              progress=False)
    # A 4-bit source is not precise enough to requantize from.
    with pytest.raises(ValueError, match="precise"):
        quantize_with_imatrix(q4_0_path, q4_0_path, out, smol_imatrix, progress=False)
    # Another architecture's / size's file.
    with pytest.raises(ValueError):
        quantize_with_imatrix(tiny, q4_0_path, out, smol_imatrix, progress=False)
    with pytest.raises(FileNotFoundError):
        quantize_with_imatrix(tmp_path / "missing.gguf", q4_0_path, out, smol_imatrix, progress=False)
    with pytest.raises(ValueError):
        quantize_with_imatrix(f16_path, q4_0_path, out, [1, 2], progress=False)
    assert not out.exists()


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
    from river_gguf.convert.build import build_river_gguf
    from river_gguf.gguf.river_index import river_tensors

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

