"""Activation-aware ("importance matrix") quantization of the exit river.

A river quantized with plain rounding treats every input column of a weight alike. ggml's
weighted quantizers instead minimise sum_j w_j * (W_ij - Q_ij)^2 with w_j the mean square of
input column j over real text: columns that carry large activations are kept more precisely.
On SmolLM2 this cut river-only perplexity from 11.69 to 10.51 (Q4_K_M: 10.58), for free at
decode time: the file has the same types and size as the plain river.

The pieces:

- ``collect_imatrix(backbone, texts)``: run the precise backbone over calibration text in
  river_gguf's engine and sum x_j^2 of the input of every weight mat-mul (the statistic
  llama.cpp's ``llama-imatrix`` collects). ``calibration_texts()`` is the calibration split of
  GSM8K and HumanEval, never the evaluation split.
- ``write_imatrix_gguf`` / ``read_imatrix_gguf``: llama.cpp's GGUF imatrix format, so files go
  both ways between this package and ``llama-imatrix`` / ``llama-quantize``.
- ``check_fits(imatrix, tensors)``: is a matrix one of this model's (its entries' widths).
- ``llama_quantize(src, dst, ftype, imatrix)``: llama.cpp's own quantizer given the importance,
  what the converter makes its river with (its mix changes with an imatrix: for Q4_0 the first
  n_layer/8 ffn_down become Q4_1).

    imx = collect_imatrix(f16, calibration_texts(), dataset=CALIBRATION_DATASET)
    llama_quantize(f16, "imatrix-q4_0.gguf", "q4_0", imx)
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import gguf
import numpy as np
from tqdm import tqdm

from .._loader import native
from ..gguf.io import atomic_output, deferred_interrupts, quantize
from ..gguf.reader import GGUFReader
from ..measure import data as eval_data
from ..model import Model

IMATRIX_TYPE = "imatrix"  # general.type of an imatrix GGUF
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUM_SUFFIX = ".in_sum2"
COUNT_SUFFIX = ".counts"

CALIBRATION_DATASET = "river_gguf calibration split: gsm8k + humaneval items with index % 5 == 0"


@dataclass
class Imatrix:
    """Per weight (by GGUF tensor name): the per-column sums of squared inputs and the number of
    input rows (tokens) they cover. ``importance(name)`` is their ratio, the mean square."""

    sums: Dict[str, np.ndarray] = field(default_factory=dict)   # name -> float32 [n_cols]
    counts: Dict[str, int] = field(default_factory=dict)        # name -> rows seen
    datasets: List[str] = field(default_factory=list)           # what the statistics were collected on
    chunk_count: int = 0                                        # texts (llama.cpp: chunks) evaluated
    chunk_size: int = 0                                         # tokens per text at most (n_ctx)
    n_tokens: int = 0                                           # tokens evaluated in all

    def __post_init__(self):
        if set(self.sums) != set(self.counts):
            raise ValueError("sums and counts must name the same weights")
        # Own copies in canonical types: the caller's dicts are left alone.
        sums = {}
        for name, s in self.sums.items():
            s = np.asarray(s, dtype=np.float32)
            if s.ndim != 1 or not len(s):
                raise ValueError(f"{name}: sums must be a non-empty 1-D array")
            sums[name] = s
        self.sums = sums
        self.counts = {name: int(c) for name, c in self.counts.items()}
        self.datasets = list(self.datasets)

    def __contains__(self, name: str) -> bool:
        return name in self.sums

    def __len__(self) -> int:
        return len(self.sums)

    def names(self) -> List[str]:
        return sorted(self.sums)

    def importance(self, name: str) -> np.ndarray:
        """Mean squared input per column of weight ``name`` (float32). A weight that saw no rows
        gets all ones, i.e. plain unweighted rounding, as llama.cpp's quantizer does."""
        s, c = self.sums[name], self.counts[name]
        if c <= 0:
            return np.ones_like(s)
        return (s / np.float32(c)).astype(np.float32)


# ----- calibration text -----------------------------------------------------------------
def calibration_texts(domains: Sequence[str] = ("gsm8k", "humaneval"), held_out: Sequence = ()) -> List[str]:
    """Prompt + completion of every **calibration** item of each domain (eval_data's split:
    index % 5 == 0). Evaluation items are never returned, so a river tuned on these is judged
    on text it has not seen. held_out: calibration items (eval_data.Item) left out as well, e.g.
    the ones the converter scores its presets on, so that they are scored out of sample."""

    skip = {(it.domain, it.index) for it in held_out}
    out: List[str] = []
    for d in domains:
        out.extend(it.prompt + it.completion for it in eval_data.select(eval_data.load_domain(d), "calibration")
                   if (it.domain, it.index) not in skip)
    return out


# ----- collection -----------------------------------------------------------------------
def collect_imatrix(
    backbone_path: Union[str, os.PathLike],
    texts: Sequence[str],
    n_ctx: int = 1024,
    n_threads: int = 2,
    progress: bool = True,
    dataset: Optional[str] = None,
) -> Imatrix:
    """Run each text (tokenized with the vocabulary's special tokens, BOS where it adds one, cut
    to ``n_ctx`` tokens, from an empty cache) through the backbone of ``backbone_path`` and
    collect the input statistics of every weight mat-mul, the LM head's included (its input is
    the final norm's output, taken without running the head; a tied head's statistics are kept
    under token_embd.weight, which llama-imatrix leaves out). ``dataset`` describes the texts in
    the result (and in the file)."""
    texts = _check_texts(texts)
    if not isinstance(n_ctx, int) or n_ctx < 2:
        raise ValueError(f"n_ctx must be an int >= 2, got {n_ctx!r}")
    with deferred_interrupts():  # Ctrl-C would be dropped in libllama's log callback during the load
        # No repacked copies: a batched pass reads the weights in place, and holds no second F16.
        model = Model(os.fspath(backbone_path), n_ctx=n_ctx, n_threads=n_threads, mode="backbone", repack=False)
    return collect_on(model, texts, progress=progress, dataset=dataset)


def _check_texts(texts: Sequence[str]) -> List[str]:
    if isinstance(texts, str):
        raise ValueError("texts must be a sequence of strings, not one string")
    texts = list(texts)
    if not texts:
        raise ValueError("no calibration texts")
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("texts must be strings")
    return texts


def collect_on(model: Model, texts: Sequence[str], progress: bool = True, dataset: Optional[str] = None) -> Imatrix:
    """collect_imatrix on an open Model (its backbone), each text cut to the Model's n_ctx."""
    texts = _check_texts(texts)
    return collect_chunks(model, text_chunks(model.tokenize, texts, model.n_ctx), total=len(texts),
                          progress=progress, dataset=dataset)


def text_chunks(tokenize: Callable[..., List[int]], texts: Sequence[str], n_ctx: int) -> Iterator[List[int]]:
    """The token lists collect_on runs: each text with the vocabulary's special tokens (BOS where
    it adds one), cut to n_ctx tokens. tokenize: Model.tokenize, or a vocabulary's with its
    signature (the dry run counts the converter's tokens with it)."""
    for text in texts:
        yield list(tokenize(text, add_special=True))[:n_ctx]


def collect_chunks(model: Model, chunks, total: Optional[int] = None, progress: bool = True,
                   dataset: Optional[str] = None) -> Imatrix:
    """The importance matrix of `chunks` (token lists, each run through the Model's backbone from an
    empty cache, as given: BOS is the caller's), e.g. llama-imatrix's chunks of one tokenized text.
    Empty chunks are skipped; total: how many there are, for the progress bar."""
    stats = native.ActivationStats()
    n_tokens = n_texts = 0
    t0 = time.perf_counter()
    with tqdm(total=total, desc="imatrix", unit="text", disable=not progress) as bar:
        for toks in chunks:
            if toks:
                model.collect_activations(toks, stats)
                n_tokens += len(toks)
                n_texts += 1
            bar.update(1)
            bar.set_postfix(tok=n_tokens, tok_s=f"{n_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
    if not n_tokens:
        raise ValueError("the texts hold no tokens")

    result = stats.result()
    return Imatrix(
        sums={k: v[0] for k, v in result.items()},
        counts={k: v[1] for k, v in result.items()},
        datasets=[dataset if dataset is not None else f"{n_texts} texts"],
        chunk_count=n_texts,
        chunk_size=model.n_ctx,
        n_tokens=n_tokens,
    )


# ----- llama.cpp's imatrix GGUF -----------------------------------------------------------
def write_imatrix_gguf(imatrix: Imatrix, path: Union[str, os.PathLike]) -> str:
    """Write ``imatrix`` in llama.cpp's GGUF imatrix format (what ``llama-imatrix`` writes and
    ``llama-quantize --imatrix`` reads): general.type = "imatrix", imatrix.datasets,
    imatrix.chunk_count, imatrix.chunk_size, and per weight F32 tensors ``<name>.in_sum2``
    [n_cols, 1] (raw sums) and ``<name>.counts`` [1, 1]. Written atomically."""
    if not isinstance(imatrix, Imatrix):
        raise ValueError("imatrix must be an Imatrix")
    if not len(imatrix):
        raise ValueError("the imatrix has no entries (llama.cpp refuses such a file)")
    with atomic_output(path) as tmp, contextlib.closing(gguf.GGUFWriter(tmp, IMATRIX_TYPE)) as w:
        # GGUFWriter always declares an architecture; an imatrix file belongs to none (llama.cpp
        # writes none), so the key is dropped again.
        for kv in getattr(w, "kv_data", []):
            kv.pop(gguf.Keys.General.ARCHITECTURE, None)
        w.add_type(IMATRIX_TYPE)
        datasets = [d for d in imatrix.datasets if d]
        if datasets:  # GGUF has no empty arrays; an absent key means the same to llama.cpp
            w.add_array(KEY_DATASETS, datasets)
        w.add_uint32(KEY_CHUNK_COUNT, int(imatrix.chunk_count))
        w.add_uint32(KEY_CHUNK_SIZE, int(imatrix.chunk_size))
        for name in imatrix.names():
            # numpy (n_mat, n_cols) is GGUF ne [n_cols, n_mat]; dense weights have n_mat = 1.
            w.add_tensor(name + SUM_SUFFIX, imatrix.sums[name].reshape(1, -1).astype(np.float32))
            w.add_tensor(name + COUNT_SUFFIX, np.array([[imatrix.counts[name]]], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    return os.fspath(path)


def read_imatrix_gguf(path: Union[str, os.PathLike]) -> Imatrix:
    """Read an imatrix GGUF (ours or llama.cpp's). Raises GGUFFormatError for a file that is
    not a GGUF (llama.cpp's legacy .dat imatrix included) and ValueError for a GGUF that is
    not an imatrix or whose entries do not pair up."""

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"imatrix file not found: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct.error/... on bad bytes
        raise native.GGUFFormatError(
            f"{path} is not a readable GGUF file ({e}); legacy .dat imatrix files are not supported"
        ) from e

    def field(key):
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    kind = field("general.type")
    sums = {t.name[: -len(SUM_SUFFIX)]: t for t in reader.tensors if t.name.endswith(SUM_SUFFIX)}
    counts = {t.name[: -len(COUNT_SUFFIX)]: t for t in reader.tensors if t.name.endswith(COUNT_SUFFIX)}
    if kind != IMATRIX_TYPE and not sums:
        what = f"general.type = {kind!r}" if kind is not None else f"general.architecture = {field('general.architecture')!r}"
        raise ValueError(f"{path} is not an imatrix GGUF ({what}; no *{SUM_SUFFIX} tensors)")
    if not sums:
        raise ValueError(f"{path}: imatrix GGUF without entries")
    unpaired = sorted(set(sums) ^ set(counts))
    if unpaired:
        raise ValueError(f"{path}: {SUM_SUFFIX} and {COUNT_SUFFIX} do not pair up for {', '.join(unpaired[:5])}")

    out_sums: Dict[str, np.ndarray] = {}
    out_counts: Dict[str, int] = {}
    for name in sums:
        s, c = sums[name], counts[name]
        if s.tensor_type != gguf.GGMLQuantizationType.F32 or c.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: {name}: imatrix tensors must be F32")
        n_mat = int(np.prod(c.shape))
        if n_mat != 1:
            # Stacked experts (MoE) keep one vector per expert; the engine runs dense models only.
            raise ValueError(f"{path}: {name} has statistics for {n_mat} experts; only dense weights are supported")
        out_sums[name] = np.array(s.data, dtype=np.float32).reshape(-1)
        out_counts[name] = int(round(float(np.asarray(c.data).reshape(-1)[0])))

    datasets = field(KEY_DATASETS)
    if isinstance(datasets, str):
        datasets = [datasets]
    chunk_size = int(field(KEY_CHUNK_SIZE) or 0)
    return Imatrix(
        sums=out_sums,
        counts=out_counts,
        datasets=list(datasets or []),
        chunk_count=int(field(KEY_CHUNK_COUNT) or 0),
        chunk_size=chunk_size,
        n_tokens=max(out_counts.values()),
    )


# ----- an importance matrix against a model ----------------------------------------------------
def check_fits(imatrix: Imatrix, tensors, source: str = "the importance matrix") -> None:
    """ValueError unless `imatrix` fits the model whose GGUF tensors (reader tensors, ggml
    order) are `tensors`: each entry that names one of its weight matrices has one value per
    input column of it (llama.cpp's quantizer stops at the first that has not, after the weights
    before it), and at least one entry names one (else llama.cpp's quantizer rounds every weight
    plainly without a word). Entries for other names are left alone, as llama.cpp leaves them."""
    widths = {t.name: int(t.shape[0]) for t in tensors if len(t.shape) >= 2}
    matched = 0
    for name in imatrix.names():
        if name in widths:
            n = len(imatrix.sums[name])
            if n != widths[name]:
                raise ValueError(f"{source}: {name} has {n} importance values but the model's weight has "
                                 f"{widths[name]} columns (an importance matrix of another model?)")
            matched += 1
    if not matched:
        raise ValueError(f"{source} names none of the model's weights (an importance matrix of another model?)")


# ----- llama.cpp's quantizer with an imatrix --------------------------------------------------
def llama_quantize(
    src_path: Union[str, os.PathLike],
    dst_path: Union[str, os.PathLike],
    ftype: str,
    imatrix: Optional[Imatrix] = None,
    n_threads: int = 2,
    allow_requantize: bool = False,
    head_type: Optional[str] = None,
) -> str:
    """llama.cpp's own quantizer (``llama_model_quantize``) of ``src_path`` to ``ftype``, given
    the importance of ``imatrix`` as llama-quantize would read it from the file (sums / counts):
    the same bytes as ``llama-quantize --imatrix``. Note that llama.cpp changes its mix when an
    imatrix is given (Q4_0: the first n_layer/8 ffn_down tensors become Q4_1), so this file's
    types can differ from a plain quantization's."""
    importance = None
    if imatrix is not None:
        if not isinstance(imatrix, Imatrix) or not len(imatrix):
            raise ValueError("imatrix must be a non-empty Imatrix")
        if not os.path.isfile(os.fspath(src_path)):
            raise FileNotFoundError(f"model file not found: {os.fspath(src_path)}")
        check_fits(imatrix, GGUFReader(os.fspath(src_path)).tensors)
        importance = {name: imatrix.importance(name) for name in imatrix.names()}
    return quantize(src_path, dst_path, ftype, n_threads=n_threads, allow_requantize=allow_requantize,
                    head_type=head_type, importance=importance)
