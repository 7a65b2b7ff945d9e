"""benchmarks/draft_floor.py's byte count, on a tiny River GGUF: each step reads every tensor of
its side of the file once (its embedding table one row, where the head is another tensor); a
draft vocabulary's head is its tokens and the 512 context rows of the river's head; and the
backbone with llama.cpp's static quant of it as a separate river (what --shapes times where the
cache has no River GGUF) drafts the River GGUF's bytes."""
import os
import runpy
from types import SimpleNamespace

import pytest

from river_gguf.calibrate import cost_model
from river_gguf.gguf.io import quantize

from support import THREADS

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "draft_floor.py")


@pytest.fixture(scope="module")
def floor():
    return runpy.run_path(SCRIPT)


MODEL = dict(n_layer=4, seed=3)


@pytest.fixture(scope="module")
def tiny_river(tiny):
    return tiny.river("llama", model=MODEL)  # a Q4_0 river, no importance matrix


def _bytes(floor, path, draft_vocab, kv_rows=0.0):
    """(table, draft step's parts, backbone step's parts, model) with `kv_rows` rows a layer read."""
    table = floor["tensor_table"](path)
    m = floor["open_model"](path, SimpleNamespace(threads=THREADS), draft_vocab)
    opts = floor["draft_options"](m)
    assert (opts.tail, opts.river_head, opts.river_attention) == (0, True, "river"), "the file's own draft setting"
    layers, heads = cost_model.weight_bytes(m)
    row = floor["kv_row_bytes"](table, m)
    rows = floor["head_rows"](m, draft_vocab)
    draft = floor["step_bytes"](table, layers, heads, m.n_layer, opts, row, kv_rows, rows)
    backbone = floor["step_bytes"](table, layers, heads, m.n_layer, None, row, kv_rows)
    return table, draft, backbone, m


def _read_once(tensors: dict, extra: dict) -> int:
    """Every tensor's bytes once (`extra`: the backbone's tensors outside the layers a river step
    reads too); an embedding table that is not the head counts one row."""
    total = sum(t["bytes"] for t in tensors.values()) + sum(t["bytes"] for t in extra.values())
    if "output.weight" in tensors:
        embd = tensors["token_embd.weight"]
        total += embd["bytes"] // embd["rows"] - embd["bytes"]
    else:
        total += tensors["token_embd.weight"]["bytes"] // tensors["token_embd.weight"]["rows"]
    return total


def test_each_step_reads_its_sides_tensors_once(floor, tiny_river):
    table, draft, backbone, m = _bytes(floor, tiny_river, draft_vocab=0)
    assert floor["head_rows"](m, 0) == m.n_vocab
    assert backbone["total"] == _read_once(table["backbone"], {})
    # The river step: every river tensor, and the backbone's final norm (a river has none).
    shared = {n: t for n, t in table["backbone"].items() if not n.startswith("blk.") and n not in table["river"]
              and n != "output.weight"}
    assert "output_norm.weight" in shared
    assert draft["total"] == _read_once(table["river"], shared)
    assert draft["kv_cache"] == backbone["kv_cache"] == 0


def test_draft_vocabulary_head_and_kv_rows(floor, tiny_river):
    table, eight, backbone, m = _bytes(floor, tiny_river, draft_vocab=8, kv_rows=10.0)
    head = table["river"]["output.weight" if "output.weight" in table["river"] else "token_embd.weight"]
    assert eight["head"] == (8 + 512) * head["bytes"] // head["rows"]
    k, v = table["backbone"]["blk.0.attn_k.weight"]["rows"], table["backbone"]["blk.0.attn_v.weight"]["rows"]
    assert eight["kv_cache"] == backbone["kv_cache"] == 10 * 2 * (k + v) * m.n_layer  # F16 K and V


def test_a_separate_static_river_drafts_the_river_ggufs_bytes(floor, tiny, tiny_river, tmp_path):
    plain = tiny.model("llama", **MODEL)
    static = str(tmp_path / "q4_0.gguf")
    quantize(plain, static, "q4_0", n_threads=THREADS)
    # A draft vocabulary: the river's head runs (river_head, which a plain backbone does not store).
    in_file = _bytes(floor, tiny_river, draft_vocab=100, kv_rows=3.0)[1]
    separate = _bytes(floor, f"{plain},{static}", draft_vocab=100, kv_rows=3.0)[1]
    assert separate == in_file


@pytest.mark.parametrize("tied", [False, True])
def test_llama_cpps_step_on_the_river_file_reads_every_tensor_once(floor, tiny, tmp_path, tied):
    """The anchor beside a separate river: llama.cpp decoding that file alone reads each tensor
    once, the embedding table one row unless the head is that table."""
    from river_gguf.gguf.reader import GGUFReader

    plain = tiny.model("llama", **dict(MODEL, tied=tied))
    static = str(tmp_path / "q4_0.gguf")
    quantize(plain, static, "q4_0", n_threads=THREADS)
    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(static).tensors}
    embd = next(t for t in GGUFReader(static).tensors if t.name == "token_embd.weight")
    got = floor["llama_step"](static, THREADS, context=8, rounds=1, steps=3, kv_bytes=1000.0, bandwidth=1e9)
    whole = sum(tensors.values())
    want = whole if tied else whole - tensors["token_embd.weight"] + tensors["token_embd.weight"] // int(embd.shape[1])
    assert got["bytes"] == {"weights": want, "kv_cache": 1000.0, "total": want + 1000.0}
    assert got["seconds"] > 0 and got["ratio"] == pytest.approx(got["seconds"] / got["floor_s"])
