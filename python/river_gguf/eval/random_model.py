"""Random-weight GGUF models of any supported architecture and shape, that llama.cpp and the
engine both load: for timing what does not depend on the weights (a decode step, a batch, a
conversion: RANDOM_SHAPES, benchmarks/random_models.py) and for the tests' parity models.

The models borrow SmolLM2's tokenizer metadata (the default model's, or $RIVER_GGUF_TOKENIZER's),
so llama.cpp has a real vocabulary to load; that fixes n_vocab at 49152 unless a shape pads it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Optional, Union

import gguf
import numpy as np

from ..default_model import default_model_path
from ..gguf.io import atomic_output, metadata_items
from ..gguf.reader import GGUFReader
from ..gguf.writer import GGUFWriter

#: The architectures write_tiny_model writes: the engine's families (native ARCHITECTURES, which
#: a test checks this against).
ARCHS = ("llama", "qwen2", "qwen3", "granite", "olmo2", "gemma2", "gemma3", "phi3", "mistral3")
#: Architectures whose files may set a sliding window (gemma2 and gemma3 require one).
SLIDING_WINDOW_ARCHS = ("olmo2", "gemma2", "gemma3")

_CONTEXT_LENGTH = 512
LONGROPE_ORIG_CTX = 300  # phi3 longrope files: contexts rounded up past it run the long factors
# mistral3 files: YaRN's original context, short so that a test's prompt runs past it (where the
# attention temperature starts to grow), and Ministral 3's YaRN and temperature settings.
YARN_ORIG_CTX = 40
MINISTRAL3_ROPE = dict(factor=16.0, beta_fast=32.0, beta_slow=1.0, log_multiplier=1.0, temperature_scale=0.1)
# Llama 3.1 and 3.2's rope scaling (rope_freqs computed from these, as llama.cpp's converter does).
LLAMA3_ROPE = {"llama3.1": dict(base=500000.0, factor=8.0, low=1.0, high=4.0, original=8192),
               "llama3.2": dict(base=500000.0, factor=32.0, low=1.0, high=4.0, original=8192)}
_RMS_EPS = 1e-5  # also what SmolLM2 uses
_ROPE_BASE = 10000.0


#: A GGUF holding only a tokenizer (tokenizer.* keys, no tensors: write_tokenizer_gguf) to give the
#: random models instead of the default model's, where that model is not installed (a GPU machine
#: without network gets one in scripts/gpu_bundle.sh's bundle).
TOKENIZER_ENV = "RIVER_GGUF_TOKENIZER"


@functools.lru_cache(maxsize=1)
def _tokenizer_kvs() -> tuple:
    """tokenizer.* KVs of the default model (or of $RIVER_GGUF_TOKENIZER), read once per process
    (parsing ~100k strings takes seconds)."""
    reader = GGUFReader(os.environ.get(TOKENIZER_ENV) or default_model_path())
    skip = [k for k in reader.fields if not k.startswith("tokenizer.")]
    return tuple(metadata_items(reader, skip))


def write_tokenizer_gguf(path: str | os.PathLike) -> str:
    """A GGUF with the default model's tokenizer.* keys and nothing else (about 2 MB)."""
    with atomic_output(path) as tmp, contextlib.closing(GGUFWriter(tmp, "llama")) as w:
        _copy_tokenizer(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return os.fspath(path)


#: llama.cpp's token type of the tokens that pad a vocabulary to a model's size: never produced
#: by the tokenizer, so the text a test writes tokenizes as with SmolLM2's own vocabulary.
_UNUSED_TOKEN = 5


def _copy_tokenizer(writer: gguf.GGUFWriter, n_vocab: int | None = None) -> int:
    """Give ``writer`` SmolLM2's tokenizer, padded with unused tokens to n_vocab when that is
    larger (the shapes of Llama 3's 128256-token vocabulary); return its vocab size."""
    kvs = list(_tokenizer_kvs())
    base = next(len(v) for k, v, _, _ in kvs if k == "tokenizer.ggml.tokens")
    if n_vocab is not None and n_vocab < base:
        raise ValueError(f"n_vocab must be at least SmolLM2's {base}, got {n_vocab}")
    extra = 0 if n_vocab is None else n_vocab - base
    pad = {"tokenizer.ggml.tokens": [f"<|unused_{i}|>" for i in range(extra)],
           "tokenizer.ggml.token_type": [_UNUSED_TOKEN] * extra,
           "tokenizer.ggml.scores": [0.0] * extra}
    for key, value, vtype, sub_type in kvs:
        if extra and key in pad:
            value = list(value) + pad[key]
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    return base + extra


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What write_tiny_model writes, checked and with its defaults filled in (head_dim, n_rot and
    a gemma's sliding window)."""
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    head_dim: int
    n_rot: int
    tied: bool
    rope_freqs: Union[bool, str]
    dtype: str
    sliding_window: Optional[int]
    longrope: bool
    attn_temperature: Optional[float]

    @property
    def gemma(self) -> bool:
        return self.arch in ("gemma2", "gemma3")

    @property
    def wdt(self):
        """The weight matrices' numpy type (norms and factors are always F32)."""
        return np.float16 if self.dtype == "f16" else np.float32


def _spec(arch: str, *, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int,
          head_dim: int | None, tied: bool, rope_freqs: bool | str, dtype: str, sliding_window: int | None,
          n_rot: int | None, longrope: bool, attn_temperature: float | None) -> _Spec:
    """write_tiny_model's arguments checked against what each architecture takes."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid: {', '.join(ARCHS)}")
    if dtype not in ("f32", "f16"):
        raise ValueError("dtype must be 'f32' or 'f16'")
    if rope_freqs and arch not in ("llama", "granite", "mistral3"):
        raise ValueError("rope_freqs is only supported for llama, granite and mistral3")
    if isinstance(rope_freqs, str) and rope_freqs not in LLAMA3_ROPE:
        raise ValueError(f"rope_freqs must be a bool or one of {', '.join(LLAMA3_ROPE)}")
    if longrope and arch != "phi3":
        raise ValueError("longrope is only supported for phi3")
    if sliding_window is not None and arch not in SLIDING_WINDOW_ARCHS:
        raise ValueError(f"sliding_window is only supported for {', '.join(SLIDING_WINDOW_ARCHS)}")
    if tied and arch == "olmo2":
        raise ValueError("olmo2 has no tied head in llama.cpp")
    if arch in ("gemma2", "gemma3") and sliding_window is None:
        sliding_window = 8
    hd = head_dim or n_embd // n_head
    if arch in ("olmo2", "phi3") and hd * n_head != n_embd:
        raise ValueError(f"{arch} needs head_dim * n_head == n_embd")
    return _Spec(arch, n_layer, n_embd, n_head, n_head_kv, n_ff, hd, n_rot or hd, tied, rope_freqs, dtype,
                 sliding_window, longrope, attn_temperature)


def write_tiny_model(
    path: str | os.PathLike,
    arch: str,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    head_dim: int | None = None,
    tied: bool = False,
    rope_freqs: bool | str = False,
    seed: int = 0,
    dtype: str = "f32",
    sliding_window: int | None = None,
    n_rot: int | None = None,
    longrope: bool = False,
    n_vocab: int | None = None,
    attn_temperature: float | None = None,
) -> str:
    """Write a random model of ``arch`` (one of ARCHS) that llama.cpp can run; small by default.

    Weights are drawn with std ~ 1/sqrt(fan_in) so each projection keeps
    activations O(1): logits then have a clear argmax without overflow.
    ``head_dim`` defaults to n_embd // n_head; a different value is written as
    attention.key_length/value_length (always written for qwen3).

    Per architecture, with the keys and tensor names llama.cpp expects:
      granite  llama's tensors, plus embedding, attention, residual and logit multipliers
               (all different from 1, so each one shows in the logits)
      olmo2    no input norms; q/k norms over the whole projection; post-attention and
               post-FFN norms; an untied head (llama.cpp requires output.weight)
      gemma2   pre- and post-norms around attention and FFN, GELU gate, attention and final
               logit soft-capping (caps small enough to bite); every other layer slides its window
      gemma3   gemma2's layout with per-head q/k norms and no caps; 5 of every 6 layers slide
               their window, with rope base 10000 while the global layers use this file's base
      phi3     joined attn_qkv, joined gate+up in ffn_up (2 x n_ff rows)
    ``sliding_window``: the window length (gemma2/gemma3 default 8; olmo2 none, where a window
    makes 3 of every 4 layers slide). ``n_rot``: rotated dims per head (partial rotary, phi3;
    default the head size). ``longrope`` (phi3): LongRoPE's two factor sets (long and short,
    unlike each other and 1), an original context of LONGROPE_ORIG_CTX positions (not a multiple of 256,
    so llama.cpp's rounding of the context decides some choices) and a rope attn_factor.
    ``n_vocab``: pad SmolLM2's vocabulary with unused tokens to this size (RANDOM_SHAPES).
    ``rope_freqs``: True writes made-up per-dimension factors; "llama3.1" or "llama3.2" writes
    the rope base and the factors those models use (LLAMA3_ROPE), computed as llama.cpp's
    converter computes them. mistral3 files get Ministral 3's YaRN and attention temperature
    (MINISTRAL3_ROPE) over an original context of YARN_ORIG_CTX positions; ``attn_temperature``
    replaces its temperature scale (0: none written).

    Tensors are drawn and written one at a time, in the order they are listed, so a model of
    any size (RANDOM_SHAPES: Llama 3.1 8B's shape is 16 GB in F16) never sits in memory whole
    and the same seed gives the same weights at any size.
    """
    s = _spec(arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
              head_dim=head_dim, tied=tied, rope_freqs=rope_freqs, dtype=dtype, sliding_window=sliding_window,
              n_rot=n_rot, longrope=longrope, attn_temperature=attn_temperature)
    draws = _Draws(np.random.default_rng(seed), s.wdt)
    with atomic_output(path) as tmp, contextlib.closing(_StreamingWriter(tmp, arch)) as w:
        # llama.cpp's vocabulary loader looks up Phi-3's own special tokens ("</s>", ...) in
        # any model whose general.name contains "phi3" or "phi-3"; SmolLM2's vocabulary has
        # none of them, so that name would not load.
        w.add_name("tiny-phi-family" if arch == "phi3" else f"tiny-{arch}")
        n_vocab = _copy_tokenizer(w, n_vocab)
        w.add_file_type(1 if dtype == "f16" else 0)  # MOSTLY_F16 / ALL_F32
        _add_hparams(w, s, n_vocab)
        _add_rope_scaling(w, s)
        _add_multipliers(w, s)
        _add_model_tensors(w, s, draws, n_vocab)
        for i in range(n_layer):
            _add_layer_tensors(w, s, draws, f"blk.{i}.")
        w.write_streamed()
    return os.fspath(path)


def _add_hparams(w: gguf.GGUFWriter, s: _Spec, n_vocab: int) -> None:
    """The shape keys every architecture has: sizes, heads, rope base, norm epsilon, head size
    where it is not n_embd // n_head, sliding window."""
    a = s.arch
    w.add_uint32(f"{a}.block_count", s.n_layer)
    w.add_uint32(f"{a}.context_length", _CONTEXT_LENGTH)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    w.add_uint32(f"{a}.feed_forward_length", s.n_ff)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    # gemma3: a base unlike the sliding layers' fixed 10000, so a layer that takes the wrong one shows.
    base = LLAMA3_ROPE[s.rope_freqs]["base"] if isinstance(s.rope_freqs, str) else _ROPE_BASE
    w.add_float32(f"{a}.rope.freq_base", 100000.0 if a == "gemma3" else base)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", _RMS_EPS)
    w.add_uint32(f"{a}.vocab_size", n_vocab)
    w.add_uint32(f"{a}.rope.dimension_count", s.n_rot)
    if a in ("qwen3", "gemma2", "gemma3") or s.head_dim != s.n_embd // s.n_head:
        w.add_uint32(f"{a}.attention.key_length", s.head_dim)
        w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    if s.sliding_window is not None:
        w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)


def _add_rope_scaling(w: gguf.GGUFWriter, s: _Spec) -> None:
    """phi3's LongRoPE context and attn_factor; mistral3's YaRN and attention temperature."""
    a = s.arch
    if s.longrope:
        w.add_uint32(f"{a}.rope.scaling.original_context_length", LONGROPE_ORIG_CTX)
        w.add_float32(f"{a}.rope.scaling.attn_factor", 1.25)
    if a == "mistral3":
        r = MINISTRAL3_ROPE
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", r["factor"])
        w.add_uint32(f"{a}.rope.scaling.original_context_length", YARN_ORIG_CTX)
        w.add_float32(f"{a}.rope.scaling.yarn_beta_fast", r["beta_fast"])
        w.add_float32(f"{a}.rope.scaling.yarn_beta_slow", r["beta_slow"])
        w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", r["log_multiplier"])
        temperature = r["temperature_scale"] if s.attn_temperature is None else s.attn_temperature
        if temperature:
            w.add_float32(f"{a}.attention.temperature_scale", temperature)


def _add_multipliers(w: gguf.GGUFWriter, s: _Spec) -> None:
    """granite's four multipliers and gemma2's soft caps, each unlike 1 (or small enough to bite)."""
    a = s.arch
    if a == "granite":
        w.add_float32(f"{a}.embedding_scale", 3.0)
        w.add_float32(f"{a}.residual_scale", 0.6)
        w.add_float32(f"{a}.attention.scale", 0.2)
        w.add_float32(f"{a}.logit_scale", 0.5)
    if a == "gemma2":
        w.add_float32(f"{a}.attn_logit_softcapping", 2.0)
        w.add_float32(f"{a}.final_logit_softcapping", 4.0)


class _Draws:
    """A tensor's (shape, dtype, draw) triple, whose data `draw()` makes from one generator when
    the tensor is written (_StreamingWriter)."""

    def __init__(self, rng: np.random.Generator, wdt):
        self.rng, self.wdt = rng, wdt

    def mat(self, n_out: int, n_in: int, gain: float = 0.8):
        """A weight matrix, std gain / sqrt(n_in). numpy shape (n_out, n_in) == GGUF ne [n_in, n_out],
        as llama.cpp expects for weights."""
        rng, wdt = self.rng, self.wdt
        return (n_out, n_in), wdt, lambda: (rng.standard_normal((n_out, n_in)) * (gain / np.sqrt(n_in))).astype(wdt)

    def embedding(self, n_vocab: int, n_embd: int):
        """std 0.1: gives logits of std ~0.8 when the embedding doubles as the (tied) LM head."""
        rng, wdt = self.rng, self.wdt
        return (n_vocab, n_embd), wdt, lambda: (rng.standard_normal((n_vocab, n_embd)) * 0.1).astype(wdt)

    def vec(self, n: int, mean: float, std: float):
        rng = self.rng
        return (n,), np.float32, lambda: (mean + std * rng.standard_normal(n)).astype(np.float32)

    def norm(self, n: int):
        """A norm's weights, near 1."""
        return self.vec(n, 1.0, 0.05)

    @staticmethod
    def const(a: np.ndarray):
        return a.shape, a.dtype, lambda: a


def _add_model_tensors(w: "_StreamingWriter", s: _Spec, d: _Draws, n_vocab: int) -> None:
    """The tensors outside the layers: embedding, final norm, head (untied), rope factors."""
    w.add_tensor("token_embd.weight", d.embedding(n_vocab, s.n_embd))
    w.add_tensor("output_norm.weight", d.norm(s.n_embd))
    if not s.tied:
        w.add_tensor("output.weight", d.mat(n_vocab, s.n_embd, gain=1.0))
    half = s.n_rot // 2
    if s.rope_freqs:
        # Per-dimension-pair divisors of the rotation frequency (llama3-style factors).
        factors = (_llama3_rope_factors(s.n_rot, **LLAMA3_ROPE[s.rope_freqs]) if isinstance(s.rope_freqs, str)
                   else np.linspace(1.0, 4.0, half, dtype=np.float32))
        w.add_tensor("rope_freqs.weight", d.const(factors))
    if s.longrope:
        # Divisors of the rotation frequencies, within the original context and beyond it.
        w.add_tensor("rope_factors_long.weight", d.const(np.linspace(1.0, 6.0, half, dtype=np.float32)))
        w.add_tensor("rope_factors_short.weight", d.const(np.linspace(1.0, 1.5, half, dtype=np.float32)))


def _add_layer_tensors(w: "_StreamingWriter", s: _Spec, d: _Draws, p: str) -> None:
    """One decoder layer's tensors (names prefixed `p`), in llama.cpp's names for the architecture."""
    a, hd, q_rows, kv_rows = s.arch, s.head_dim, s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    if a != "olmo2":
        w.add_tensor(p + "attn_norm.weight", d.norm(s.n_embd))
    if a == "phi3":
        w.add_tensor(p + "attn_qkv.weight", d.mat(q_rows + 2 * kv_rows, s.n_embd))
    else:
        w.add_tensor(p + "attn_q.weight", d.mat(q_rows, s.n_embd))
        w.add_tensor(p + "attn_k.weight", d.mat(kv_rows, s.n_embd))
        w.add_tensor(p + "attn_v.weight", d.mat(kv_rows, s.n_embd))
    if a == "qwen2":
        w.add_tensor(p + "attn_q.bias", d.vec(q_rows, 0.0, 0.1))
        w.add_tensor(p + "attn_k.bias", d.vec(kv_rows, 0.0, 0.1))
        w.add_tensor(p + "attn_v.bias", d.vec(kv_rows, 0.0, 0.1))
    if a in ("qwen3", "gemma3"):  # per head
        w.add_tensor(p + "attn_q_norm.weight", d.norm(hd))
        w.add_tensor(p + "attn_k_norm.weight", d.norm(hd))
    if a == "olmo2":  # over the whole projection
        w.add_tensor(p + "attn_q_norm.weight", d.norm(q_rows))
        w.add_tensor(p + "attn_k_norm.weight", d.norm(kv_rows))
    w.add_tensor(p + "attn_output.weight", d.mat(s.n_embd, q_rows))
    post_norms = a == "olmo2" or s.gemma
    if post_norms:
        w.add_tensor(p + "post_attention_norm.weight", d.norm(s.n_embd))
    if a != "olmo2":
        w.add_tensor(p + "ffn_norm.weight", d.norm(s.n_embd))
    if a == "phi3":
        w.add_tensor(p + "ffn_up.weight", d.mat(2 * s.n_ff, s.n_embd))  # gate rows, then up rows
    else:
        w.add_tensor(p + "ffn_gate.weight", d.mat(s.n_ff, s.n_embd))
        w.add_tensor(p + "ffn_up.weight", d.mat(s.n_ff, s.n_embd))
    w.add_tensor(p + "ffn_down.weight", d.mat(s.n_embd, s.n_ff))
    if post_norms:
        w.add_tensor(p + "post_ffw_norm.weight", d.norm(s.n_embd))


def _llama3_rope_factors(dim: int, base: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Llama 3's per-dimension rope divisors: 1 for short wavelengths, `factor` for long ones,
    and a smooth mix between (the formula of llama.cpp's convert_hf_to_gguf.py)."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


class _StreamingWriter(GGUFWriter):
    """The package's GGUFWriter, but add_tensor takes a (shape, dtype, draw) triple and
    write_streamed draws and writes each tensor's data in turn."""

    def __init__(self, path, arch):
        super().__init__(path, arch)
        self._lazy: list = []

    def add_tensor(self, name, spec):  # noqa: D102 (see the class)
        shape, dtype, draw = spec
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
        self._lazy.append((shape, draw))

    def write_streamed(self) -> None:
        self.write_header_to_file()
        self.write_kv_data_to_file()
        self.write_ti_data_to_file()
        for shape, draw in self._lazy:
            a = draw()
            assert a.shape == tuple(shape)
            self.write_tensor_data(a)


#: Random-weight shapes of the models users run (write_random_shape): for timing anything whose
#: cost does not depend on the weights (a step, a batch, a conversion), with their real
#: vocabulary size.
RANDOM_SHAPES = {
    "smollm2-135m": dict(n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, tied=True),
    "llama-3.2-1b": dict(n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192, tied=True, n_vocab=128256),
    "llama-3.2-3b": dict(n_layer=28, n_embd=3072, n_head=24, n_head_kv=8, n_ff=8192, tied=True, n_vocab=128256),
    "llama-3.1-8b": dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, tied=False, n_vocab=128256),
    # Qwen2.5(-Coder)-1.5B, untied as the project's dequantized F16 of it is (3.3 GiB)
    "qwen2.5-1.5b": dict(arch="qwen2", n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960, tied=False,
                         n_vocab=151936),
}


def write_random_shape(path: str | os.PathLike, shape: str, seed: int = 0) -> str:
    """An F16 model with random weights in one of RANDOM_SHAPES (llama unless the shape names its arch)."""
    if shape not in RANDOM_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(RANDOM_SHAPES)}")
    kw = dict(RANDOM_SHAPES[shape])
    return write_tiny_model(path, kw.pop("arch", "llama"), dtype="f16", seed=seed, **kw)
