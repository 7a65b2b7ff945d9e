"""Embeddings: river_gguf.Llama(embedding=True) against llama_cpp.Llama(embedding=True) on the
same file (SmolLM2-135M-Instruct Q4_1), in every pooling mode; and what they are in River terms
(the backbone's final norm, whatever exit options the Llama carries)."""
import llama_cpp
import numpy as np
import pytest

import river_gguf
from river_gguf import Llama, Model
from river_gguf.gguf.reader import GGUFReader

TEXT = "Hello World, embeddings from the backbone."
POOLINGS = {"none": llama_cpp.LLAMA_POOLING_TYPE_NONE, "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
            "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}


def pair(path, **kw):
    ref = llama_cpp.Llama(path, n_ctx=256, n_threads=1, n_threads_batch=1, embedding=True, flash_attn=True,
                          verbose=False, **kw)
    ours = Llama(path, n_ctx=256, n_threads=1, embedding=True, flash_attn=True, verbose=False, **kw)
    return ref, ours


@pytest.mark.parametrize("pooling", list(POOLINGS))
def test_embeddings_equal_llama_cpp(q4_1_path, pooling):
    ref, ours = pair(q4_1_path, pooling_type=POOLINGS[pooling])
    try:
        assert ours.pooling_type() == ref.pooling_type() == POOLINGS[pooling]
        for normalize in (False, True):
            a, b = np.array(ref.embed(TEXT, normalize=normalize)), np.array(ours.embed(TEXT, normalize=normalize))
            assert a.shape == b.shape == ((len(ours.tokenize(TEXT.encode())), 576) if pooling == "none" else (576,))
            # The same graph as llama.cpp's prompt pass: the rows are bit-identical; the mean is
            # summed in another order (numpy's pairwise float32 sum, ggml's mat-mul).
            if pooling == "mean" or normalize:
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
            else:
                assert np.array_equal(a, b)
            if normalize:
                assert np.allclose(np.linalg.norm(b, axis=-1), 1.0, atol=1e-5)
        # A list: each input on its own; with pooling its vectors equal llama_cpp's batch.
        texts = [TEXT, "def add(a, b):\n    return a + b\n"]
        many = ours.embed(texts)
        assert [np.array(x).tolist() for x in many] == [np.array(ours.embed(t)).tolist() for t in texts]
        theirs = ref.embed(texts)
        if pooling == "none":  # llama_cpp reads inputs after the first at a wrong offset: first only
            assert np.array_equal(np.array(many[0]), np.array(theirs[0]))
        else:
            np.testing.assert_allclose(np.array(many), np.array(theirs), rtol=1e-4, atol=1e-4)
    finally:
        ref.close()
        ours.close()


def test_create_embedding_response_matches_llama_cpp(q4_1_path):
    ref, ours = pair(q4_1_path, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_LAST)
    try:
        a, b = ref.create_embedding(["one", "two words"]), ours.create_embedding(["one", "two words"])
        assert set(a) == set(b) and a["object"] == b["object"] == "list" and a["model"] == b["model"]
        assert a["usage"] == b["usage"]
        assert [{k: v for k, v in d.items() if k != "embedding"} for d in a["data"]] == \
            [{k: v for k, v in d.items() if k != "embedding"} for d in b["data"]]
        for x, y in zip(a["data"], b["data"]):
            assert isinstance(y["embedding"][0], float)
            np.testing.assert_allclose(y["embedding"], x["embedding"], rtol=1e-4, atol=1e-4)
        single = ours.create_embedding("one")
        assert len(single["data"]) == 1 and single["usage"]["prompt_tokens"] == len(ours.tokenize(b"one"))
    finally:
        ref.close()
        ours.close()


def test_embeddings_are_the_rows_the_head_reads(q4_1_path):
    """The final norm's output: times the head (SmolLM2 ties it to the token embedding), they
    give the prompt pass's logits."""
    import gguf

    m = Model(q4_1_path, n_ctx=128, n_threads=1)
    toks = m.tokenize(TEXT)
    rows = m.embed(toks)
    assert rows.shape == (len(toks), m.n_embd) and rows.dtype == np.float32
    # The cache is left empty: a later computation cannot continue from the text's rows.
    assert m.n_past == 0
    w = next(t for t in GGUFReader(q4_1_path).tensors if t.name == "token_embd.weight")
    head = gguf.dequantize(w.data, w.tensor_type).reshape(m.n_vocab, m.n_embd)
    logits = m.logits(toks)
    np.testing.assert_allclose(rows @ head.T, logits, atol=0.05 * np.abs(logits).max())


def test_embeddings_come_from_the_backbone_whatever_the_exit_options(river_gguf_path):
    """A River GGUF embeds with its backbone: the river-only preset changes nothing."""
    with Llama(river_gguf_path, n_ctx=128, n_threads=1, embedding=True, verbose=False, mode="river-only") as a, \
            Llama(river_gguf_path, n_ctx=128, n_threads=1, embedding=True, verbose=False, mode="backbone") as b:
        assert np.array_equal(np.array(a.embed(TEXT)), np.array(b.embed(TEXT)))


def test_embed_then_complete_equals_a_fresh_completion(q4_1_path):
    with Llama(q4_1_path, n_ctx=256, n_threads=1, embedding=True, verbose=False) as llm:
        first = llm.create_completion("The capital of France is", max_tokens=6, temperature=0.0)["choices"][0]["text"]
        llm.embed("something else entirely, to overwrite the cache")
        assert llm.n_tokens == 0
        again = llm.create_completion("The capital of France is", max_tokens=6, temperature=0.0)["choices"][0]["text"]
        assert again == first


def test_embedding_errors(q4_1_path):
    with Llama(q4_1_path, n_ctx=64, n_batch=8, n_threads=1, embedding=True, verbose=False) as llm:
        long = "one two three four five six seven eight nine ten eleven twelve"
        assert len(llm.embed(long)) == 8  # truncated to n_batch tokens, as llama_cpp
        with pytest.raises(ValueError, match="exceed batch size of 8"):
            llm.embed(long, truncate=False)
        with pytest.raises(TypeError):
            llm.embed([1, 2, 3])
    with pytest.raises(NotImplementedError, match="rank pooling"):
        Llama(q4_1_path, n_ctx=64, n_threads=1, embedding=True, verbose=False,
              pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK)
    with pytest.raises(ValueError, match="unknown pooling_type 9"):
        Llama(q4_1_path, n_ctx=64, n_threads=1, verbose=False, pooling_type=9)
    m = Model(q4_1_path, n_ctx=16, n_threads=1)
    with pytest.raises(river_gguf.ContextOverflowError):
        m.embed(list(range(1, 20)))
    with pytest.raises(ValueError, match="no tokens"):
        m.embed([])
