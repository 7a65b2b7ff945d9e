"""Malformed GGUF files end in a clear error at load, naming the key or tensor: one test per finding
of issue 8 (each crashed, hung or silently misbehaved before), plus controls that the rules do not
refuse valid files."""
import math

import numpy as np
import pytest

import river_gguf
from river_gguf import Model
from river_gguf.greedy import greedy
from fuzz_gguf import (ARRAY, F32, F64, I32, STRING, TINY, U32, U64, Gguf, _build_river, _encode, _type_id,
                             _values)
from river_gguf.eval.random_model import write_tiny_model

GGUFFormatError = river_gguf.GGUFFormatError


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    d = tmp_path_factory.mktemp("bases")
    llama = write_tiny_model(d / "llama.gguf", "llama", seed=5, **TINY)
    tied = write_tiny_model(d / "tied.gguf", "qwen2", tied=True, seed=5, **TINY)
    river = str(d / "llama.river.gguf")
    _build_river(llama, river)
    # The same River GGUF in format 1 (river tensors in the GGUF index), which is still read.
    river1 = d / "llama.river1.gguf"
    with open(river, "rb") as f:
        river1.write_bytes(Gguf.parse(f.read()).to_format1().to_bytes())
    return {"llama": llama, "tied": tied, "river": river, "river1": str(river1)}


rivers = pytest.mark.parametrize("river", ["river", "river1"])


def damaged(tmp_path, base: str, edit, name="bad.gguf") -> str:
    """A copy of `base` changed by edit(Gguf)."""
    with open(base, "rb") as f:
        g = Gguf.parse(f.read())
    edit(g)
    if g.river is not None:  # a River GGUF of format 2: its river's tensors are listed in metadata
        g.sync_river_index()
    out = tmp_path / name
    out.write_bytes(g.to_bytes())
    return str(out)


def retype(name: str, tname: str):
    """An edit giving tensor `name` the ggml type `tname`, its values converted."""
    def edit(g: Gguf):
        t = g.tensor(name)
        rng = np.random.default_rng(0)
        blob = _encode(_values(g, t, rng), tname, rng)
        t.ttype = _type_id(tname)
        g.relayout({name: blob})
    return edit


def load_and_run(path, **kw):
    m = Model(path, n_ctx=64, n_threads=1, **kw)
    g = greedy(m, [1, 2, 3], max_tokens=2)
    assert len(g.tokens) == 2
    return m


def refused(path, match, error=GGUFFormatError, **kw):
    with pytest.raises(error, match=match):
        Model(path, n_ctx=64, n_threads=1, **kw)


# --- tensor types -------------------------------------------------------------------------

@pytest.mark.parametrize("tname", ["F16", "Q8_0", "BF16"])
def test_norm_weight_must_be_f32(bases, tmp_path, tname):
    p = damaged(tmp_path, bases["llama"], retype("blk.0.attn_norm.weight", tname))
    refused(p, r"blk\.0\.attn_norm\.weight.*1-D tensors must be F32")


@pytest.mark.parametrize("tname", ["F64", "I8", "I16", "I32", "I64"])
def test_matmul_weight_of_a_type_without_kernel(bases, tmp_path, tname):
    p = damaged(tmp_path, bases["llama"], retype("blk.1.ffn_up.weight", tname))
    refused(p, rf"blk\.1\.ffn_up\.weight.*type {tname.lower()}.*no matrix multiplication")


@pytest.mark.parametrize("tname", ["I32", "F64", "I8"])
@pytest.mark.parametrize("which", ["llama", "tied"])
def test_token_embd_of_integer_or_f64_type(bases, tmp_path, which, tname):
    p = damaged(tmp_path, bases[which], retype("token_embd.weight", tname))
    refused(p, r"token_embd\.weight.*embedding table must be a float or quantized type")


@pytest.mark.parametrize("tname", ["Q8_0", "Q4_0", "BF16", "F32"])
def test_supported_weight_types_still_load(bases, tmp_path, tname):
    # Controls: the type rules refuse only what the CPU cannot run.
    p = damaged(tmp_path, bases["llama"], retype("blk.0.attn_q.weight", tname))
    load_and_run(p)
    p = damaged(tmp_path, bases["tied"], retype("token_embd.weight", tname), name="tied.gguf")
    load_and_run(p)


@rivers
def test_river_tensor_types_are_checked(bases, tmp_path, river):
    p = damaged(tmp_path, bases[river], retype("river.blk.0.ffn_norm.weight", "F16"))
    refused(p, r"river\.blk\.0\.ffn_norm\.weight.*1-D tensors must be F32")
    p = damaged(tmp_path, bases[river], retype("river.blk.1.attn_v.weight", "I16"))
    refused(p, r"river\.blk\.1\.attn_v\.weight.*no matrix multiplication")
    p = damaged(tmp_path, bases[river], retype("river.token_embd.weight", "I32"))
    refused(p, r"river\.token_embd\.weight")


# --- hyperparameter values ----------------------------------------------------------------

@pytest.mark.parametrize("vtype,value", [(U32, 7), (U32, 0), (I32, -2), (U32, 16), (U32, 2**32 - 2)])
def test_rope_dimension_count_even_and_within_the_head(bases, tmp_path, vtype, value):
    # odd or too large hit a rope assert; 0, negative and 2^32-2 looped forever in ggml's rope
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("llama.rope.dimension_count", vtype, value))
    refused(p, r"llama\.rope\.dimension_count")


def test_rope_dimension_count_below_the_head_size_loads(bases, tmp_path):
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("llama.rope.dimension_count", U32, 4))
    load_and_run(p)


@pytest.mark.parametrize("value", [-1e-5, math.nan, math.inf])
def test_rms_epsilon_finite_and_not_negative(bases, tmp_path, value):
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("llama.attention.layer_norm_rms_epsilon", F32, value))
    refused(p, r"layer_norm_rms_epsilon.*finite and >= 0")


@pytest.mark.parametrize("value", [0.0, -10000.0, math.nan, -math.inf])
def test_rope_freq_base_finite_and_positive(bases, tmp_path, value):
    # these gave all-NaN logits: generate() returned '' with finish_reason='stop'
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("llama.rope.freq_base", F32, value))
    refused(p, r"rope\.freq_base.*finite and > 0")


@pytest.mark.parametrize("key", ["rope.scaling.factor", "rope.scale_linear"])
@pytest.mark.parametrize("value", [0.0, -2.0, math.nan])
def test_rope_scale_factors_finite_and_positive(bases, tmp_path, key, value):
    def edit(g):
        g.set("llama.rope.scaling.type", STRING, "linear")
        g.set(f"llama.{key}", F32, value)
    refused(damaged(tmp_path, bases["llama"], edit), rf"llama\.{key}.*finite and > 0")


def test_array_element_type_checked_before_reading(bases, tmp_path):
    # a string array here aborted inside gguf (its data was asked for before its type was checked)
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("llama.feed_forward_length", ARRAY, (STRING, [b"64", b"64"])))
    refused(p, r"llama\.feed_forward_length.*array of str.*expected integers")
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("llama.attention.head_count", ARRAY, (F32, [4.0, 4.0])))
    refused(p, r"llama\.attention\.head_count.*array of f32")


def test_per_layer_integer_arrays_of_any_integer_type_load(bases, tmp_path):
    from fuzz_gguf import U16
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("llama.feed_forward_length", ARRAY, (U16, [64, 64])))
    load_and_run(p)


@pytest.mark.parametrize("key,vtype,value", [
    ("block_count", U64, 2**33 + 4),          # loaded as 4 layers before
    ("embedding_length", U64, 2**32 + 32),
    ("feed_forward_length", U64, 2**32 + 64),
    ("attention.head_count", U64, 2**32 + 4),
    ("context_length", U64, 2**63 + 5),
    ("block_count", I32, -2),
    ("attention.head_count_kv", U32, 0),
])
def test_integer_hyperparameters_fit_their_range(bases, tmp_path, key, vtype, value):
    p = damaged(tmp_path, bases["llama"], lambda g: g.set(f"llama.{key}", vtype, value))
    refused(p, rf"llama\.{key}")


@pytest.mark.parametrize("n", [1, 3])
def test_block_count_must_match_the_layers_present(bases, tmp_path, n):
    # 1 silently ran one layer of two before
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("llama.block_count", U32, n))
    refused(p, r"block_count is %d" % n if n > 2 else r"blk\.1\..*block_count is 1")


def test_layer_tensors_beyond_block_count(bases, tmp_path):
    def edit(g):
        g.tensor("blk.1.attn_q.weight").name = "blk.9.attn_q.weight"
    refused(damaged(tmp_path, bases["llama"], edit), r"blk\.9\.attn_q\.weight.*belongs to layer 9")


# --- vocabulary ---------------------------------------------------------------------------

def _edit_tokens(fn):
    def edit(g):
        toks = g.strings("tokenizer.ggml.tokens")
        fn(toks)
        g.set("tokenizer.ggml.tokens", ARRAY, (STRING, toks))
    return edit


def test_token_with_a_nul_byte(bases, tmp_path):
    # aborted inside libllama's vocabulary loader
    def nul(toks):
        toks[300] = toks[300][:1] + b"\0" + toks[300][1:]
    refused(damaged(tmp_path, bases["llama"], _edit_tokens(nul)), r"token 300 .*contains a NUL byte")


def test_duplicate_tokens(bases, tmp_path):
    def dup(toks):
        toks[1000] = toks[999]
    refused(damaged(tmp_path, bases["llama"], _edit_tokens(dup)), r"token 1000 .*repeats token 999")


def test_token_list_of_wrong_type_or_length(bases, tmp_path):
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("tokenizer.ggml.tokens", ARRAY, (I32, [1, 2, 3])))
    refused(p, r"tokenizer\.ggml\.tokens is not an array of strings")
    p = damaged(tmp_path, bases["llama"], _edit_tokens(lambda toks: toks.pop()))
    refused(p, r"tokenizer\.ggml\.tokens has 49151 tokens but token_embd\.weight has 49152 rows")


@pytest.mark.parametrize("model", ["rwkv", "bert", "none"])
def test_unsupported_tokenizer_model(bases, tmp_path, model):
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("tokenizer.ggml.model", STRING, model))
    refused(p, rf"tokenizer '{model}' is not supported", error=river_gguf.UnsupportedModelError)


def _relabel_spm(with_bytes: bool):
    def edit(g):
        g.set("tokenizer.ggml.model", STRING, "llama")
        if with_bytes:  # SentencePiece's byte tokens in place of 256 ordinary ones
            toks = g.strings("tokenizer.ggml.tokens")
            types = [1] * len(toks)  # normal, and BYTE (6) for the byte tokens
            for b in range(256):
                toks[1000 + b] = f"<0x{b:02X}>".encode()
                types[1000 + b] = 6
            g.set("tokenizer.ggml.tokens", ARRAY, (STRING, toks))
            g.set("tokenizer.ggml.token_type", ARRAY, (I32, types))
    return edit


def test_sentencepiece_vocabulary_without_byte_tokens(bases, tmp_path):
    # libllama's SentencePiece tokenizer threw std::out_of_range across its C API when text
    # fell back to a byte with no token: llama_cpp's tokenize (river_gguf.Llama) aborted.
    p = damaged(tmp_path, bases["llama"], _relabel_spm(with_bytes=False))
    refused(p, r"SentencePiece vocabulary .*no token for byte <0x00>")
    with pytest.raises(GGUFFormatError, match=r"no token for byte"):
        river_gguf.Llama(p, n_ctx=64, n_threads=1, verbose=False)
    # with the byte tokens the same vocabulary loads, and both tokenizers spell unknown bytes
    p = damaged(tmp_path, bases["llama"], _relabel_spm(with_bytes=True), name="spm.gguf")
    text = "Hi\u00e9\U0001F600\n"  # no space: this vocabulary has no "\u2581" piece
    llm = river_gguf.Llama(p, n_ctx=64, n_threads=1, verbose=False)
    try:
        toks = llm.tokenize(text.encode())
        assert toks == Model(p, n_ctx=64, n_threads=1).tokenize(text)
        assert llm.detokenize(toks).decode().endswith(text)
    finally:
        llm.close()


# --- rivers ---------------------------------------------------------------------------------

@rivers
@pytest.mark.parametrize("tensor", ["river.blk.0.attn_q.weight", "river.blk.1.ffn_down.weight", "river.token_embd.weight"])
def test_river_gguf_missing_one_river_tensor(bases, tmp_path, tensor, river):
    # without river.blk.0.attn_q.weight the file loaded as a plain model, ignoring its river
    p = damaged(tmp_path, bases[river], lambda g: g.remove_tensors(lambda n: n == tensor))
    refused(p, rf"'{tensor}'")


@rivers
def test_river_gguf_as_the_river_of_another_file_is_refused(bases, river):
    # it was accepted, and its F16 backbone ran as the "river"
    with pytest.raises(river_gguf.RiverMismatchError, match=r"is a River GGUF .*river\.blk\..*plain GGUF"):
        Model(bases["llama"], river=bases[river], n_ctx=64, n_threads=1, threshold=0.9)


@rivers
def test_river_tensor_of_the_wrong_shape(bases, tmp_path, river):
    def edit(g):
        t = g.tensor("river.blk.0.ffn_up.weight")
        t.dims = [t.dims[1], t.dims[0]] + t.dims[2:]
    refused(damaged(tmp_path, bases[river], edit), r"river\.blk\.0\.ffn_up\.weight.*has shape \[64, 32\], expected \[32, 64\]",
            error=river_gguf.RiverMismatchError)


@rivers
def test_intact_river_gguf_loads_and_runs(bases, river):
    m = load_and_run(bases[river])
    assert m.has_river
    assert len(greedy(m, [1, 2, 3], max_tokens=2, mode="river-only").tokens) == 2


# --- bytes ----------------------------------------------------------------------------------

def test_tensor_data_past_the_end_of_the_file(bases, tmp_path):
    with open(bases["llama"], "rb") as f:
        data = f.read()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:-4096])
    refused(str(p), r"truncated: tensor '")


@pytest.mark.parametrize("key,vtype,value,match", [
    ("river.threshold", STRING, "high", r"river\.threshold.*expected a number"),
    ("river.threshold", F64, math.inf, r"river\.threshold.*must be finite"),
    ("river.min_exit_layer", F64, -math.inf, r"river\.min_exit_layer.*expected an integer"),
    ("river.min_exit_layer", U32, 2, r"river\.min_exit_layer = 2 is invalid"),
    ("river.tail", I32, -1, r"river\.tail = -1 is invalid"),
    ("river.prefill", STRING, "sideways", r"river\.prefill = 'sideways' is invalid"),
    ("river.prefill", U32, 1, r"river\.prefill' is not a string"),
])
def test_river_exit_defaults_are_checked(bases, tmp_path, key, vtype, value, match):
    # these raised plain ValueError/OverflowError from Python's float()/int() before
    refused(damaged(tmp_path, bases["river"], lambda g: g.set(key, vtype, value)), match)


def test_unrelated_64_bit_keys_keep_their_values(bases, tmp_path):
    # Only hyperparameters must fit an int64; other keys load as they are.
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("general.checksum", U64, 2**64 - 1))
    assert load_and_run(p).metadata["general.checksum"] == 2**64 - 1


def test_text_that_is_not_utf8(bases, tmp_path):
    # reached Python as UnicodeDecodeError (metadata, messages) before
    p = damaged(tmp_path, bases["llama"], lambda g: g.set("general.name", STRING, b"tiny \xff\xfe"))
    refused(p, r"the value of general\.name is not UTF-8 text")
    def rename(g):
        g.tensor("blk.0.ffn_up.weight").name = "blk.0.ffn_up.weight\udcff"  # the byte 0xff
    refused(damaged(tmp_path, bases["llama"], rename), r"the name of tensor \d+ is not UTF-8 text")


def test_river_index_under_a_format_without_one(bases, tmp_path):
    # A format-2 river index read as format 1 would leave a plain model without a word.
    with open(bases["river"], "rb") as f:
        g = Gguf.parse(f.read())
    p = damaged(tmp_path, bases["river"], lambda g: g.set("river.format_version", U32, 1))
    if g.river is not None:  # the converter writes format 2
        refused(p, r"has a river index \(river\.tensor_names\) but no river tensors were read .*format_version = 1")
    else:
        assert load_and_run(p).has_river
