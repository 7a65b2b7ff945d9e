"""Closeness to a reference model, as llama.cpp's community measures quants.

For every scored position, the reference (the F16 backbone) gives a next-token distribution P
and the configuration under test gives Q. Per position this module records

- KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)), over the whole vocabulary, in float64;
- whether both put their top token on the same id ("same top token");
- the negative log-likelihood of the actual next token (for perplexity).

This is what ``llama-perplexity --kl-divergence`` reports. Unlike perplexity, KLD is zero only
for a model that predicts exactly what the reference predicts, so a quant cannot "beat" its own
backbone by chance agreement with the text.

Summaries (``summarize``) pool tokens over items: the mean, median and 99th percentile KLD,
same-top %, and perplexity, each mean with a percentile bootstrap interval obtained by
resampling **items** (not tokens: tokens of one item are correlated). ``paired_delta`` gives the
interval of a difference between two configurations scored on the same items, resampling the
same items for both, which is the interval to read before claiming one beats the other.

Logits come through the decode path (``teacher.score(keep_logits=True)``): the prompt prefilled,
every scored token one decode step, with exits live; the reference's too, so a file scored
against itself is exactly 0. A batched pass (``Model.logits``, each item whole, the prompt run in
the setting as it prefills in use) is offered for static settings (backbone, or river-only with a
tail), but it is not the same computation for quantized weights: ggml's batched and single-token
kernels quantize activations differently, and on SmolLM2's Q4_0 the two paths' logits differ by up
to 1.3 (top token on 7 of 8 positions), in stock llama.cpp exactly as in river_gguf
(tests/measure/test_divergence.py); F16 weights agree to 0.04. Averaged over a calibration's
tokens the two agree within their intervals (BENCHMARKS.md), so the converter's presets score
static settings batched, and reports score every row through decode.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._loader import native
from .teacher import score

BOOTSTRAP_DRAWS = 1000
BOOTSTRAP_SEED = 20261201
CONFIDENCE = 0.95

# Settings in which every token, prompt included, runs the same layers, so that one batched pass
# computes what token-by-token decoding computes (up to float summation order).
STATIC_MODES = ("backbone", "river-only")


@dataclass
class ItemDivergence:
    """Per scored position of one item."""
    kld: np.ndarray        # float64
    same_top: np.ndarray   # bool
    nll: np.ndarray        # float64: -log Q(actual next token)

    @property
    def n(self) -> int:
        return int(len(self.kld))


def compare(reference_logits: np.ndarray, logits: np.ndarray, targets: Sequence[int]) -> ItemDivergence:
    """KLD, same-top and NLL per row, in native code on every core (native.divergence: each row
    in double, one thread a row, so the result does not depend on the thread count; a row equal to
    the reference's scores exactly 0). reference_logits, logits: the reference's and the
    configuration's raw logits [n, n_vocab]; targets: the actual next token of each row."""
    return compare_many(reference_logits, [logits], targets)[0]


def compare_many(reference_logits: np.ndarray, configs: Sequence[np.ndarray],
                 targets: Sequence[int]) -> List[ItemDivergence]:
    """compare() of each configuration's logits in `configs` with one reference, in one native
    pass: the reference's softmax, most of a row's work, is computed once per row for all of them,
    and each result is what compare() gives it alone, bit for bit."""
    ref = np.asarray(reference_logits)
    qs = [np.asarray(q) for q in configs]
    if ref.ndim != 2:
        raise ValueError(f"the reference's logits must be 2-D, got shape {ref.shape}")
    for q in qs:
        if ref.shape != q.shape:
            raise ValueError(f"reference has shape {ref.shape}, the configuration {q.shape}")
    t = np.asarray(targets, dtype=np.int64)
    if t.shape != (ref.shape[0],):
        raise ValueError(f"need {ref.shape[0]} targets, got {t.shape}")
    out = native.divergence(ref, qs, t.astype(np.int32), os.cpu_count() or 1)
    return [ItemDivergence(kld, same, nll) for kld, same, nll in out]


def reference_logits(model, tokens: Sequence[int], prefix: int, batched: bool = False, **options) -> np.ndarray:
    """The reference's logits at every scored position (prefix-1 .. len-2), through the decode
    path (batched=True: one batched pass; the reference runs a static setting)."""
    logits, _ = config_logits(model, tokens, prefix, batched=batched, **options)
    return logits


def is_static(options: dict) -> bool:
    """Whether a setting runs every token through the same layers (so a batched pass equals
    decode): backbone or river-only, with no forced exit layer."""
    return options.get("mode") in STATIC_MODES and options.get("exit_layer") is None


def config_logits(model, tokens: Sequence[int], prefix: int, batched: bool = False,
                  **options) -> Tuple[np.ndarray, List[int]]:
    """(logits that predict tokens[prefix:], exit layers of the decode steps). batched=True runs
    one pass (only for static settings); otherwise teacher-forced decode with exits live."""
    if batched:
        if not is_static(options):
            raise ValueError(f"a batched pass equals decode only for static settings, not {options}")
        # The scored rows alone: the last token predicts nothing scored, and the prompt's rows but
        # its last need no head.
        if len(tokens) - 1 <= model.n_batch:
            logits = model.logits(tokens[:len(tokens) - 1], first_row=prefix - 1, **options)
        else:  # more than one batch: every row's head, then the scored ones
            logits = model.logits(tokens, **options)[prefix - 1:len(tokens) - 1]
        # The exit layer every decode step would report: the last layer (never exited) for the
        # backbone, -1 (before layer 0) for river-only, as the engine reports them.
        exit_layer = model.n_layer - 1 if options.get("mode") == "backbone" else -1
        return logits, [exit_layer] * (len(tokens) - prefix - 1)
    r = score(model, tokens, prefix=prefix, keep_logits=True, **options)
    return r.logits, [int(e) for e in r.exit_layers[1:]]


@dataclass
class DivergenceRun:
    """One configuration over a list of items."""
    items: List[ItemDivergence] = field(default_factory=list)
    exits: List[List[int]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, d: ItemDivergence, exits: Sequence[int] = ()) -> None:
        self.items.append(d)
        self.exits.append(list(exits))

    @property
    def n_tokens(self) -> int:
        return sum(d.n for d in self.items)

    def pooled(self, key: str) -> np.ndarray:
        return np.concatenate([getattr(d, key) for d in self.items]) if self.items else np.zeros(0)

    @property
    def perplexity(self) -> float:
        nll = self.pooled("nll")
        return float(np.exp(nll.mean())) if len(nll) else float("nan")

    @property
    def mean_exit_layer(self) -> float:
        flat = [e for ex in self.exits for e in ex]
        return float(np.mean(flat)) if flat else float("nan")


def merge(runs: Sequence[DivergenceRun]) -> DivergenceRun:
    """Runs over disjoint item lists (e.g. one per domain) as one run."""
    out = DivergenceRun()
    for r in runs:
        out.items += r.items
        out.exits += r.exits
        out.seconds += r.seconds
    return out


def item_klds(run: DivergenceRun) -> List[List[float]]:
    """Per item: [scored tokens, summed KLD], what a paired comparison of two settings needs
    (cost_model.choose keeps them with each measured setting)."""
    return [[int(d.n), float(d.kld.sum())] for d in run.items]


def _item_sums(run: DivergenceRun) -> np.ndarray:
    """Per item: [n tokens, sum KLD, same-top count, sum NLL]."""
    return np.array([[d.n, d.kld.sum(), d.same_top.sum(), d.nll.sum()] for d in run.items], dtype=np.float64)


def _stats(sums: np.ndarray) -> np.ndarray:
    """[mean KLD, same-top share, perplexity] from summed item rows (any leading axes)."""
    n = sums[..., 0]
    return np.stack([sums[..., 1] / n, sums[..., 2] / n, np.exp(sums[..., 3] / n)], axis=-1)


def _draws(n_items: int, draws: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_items, size=(draws, n_items))


def _interval(samples: np.ndarray, confidence: float) -> Tuple[np.ndarray, np.ndarray]:
    lo = (1.0 - confidence) / 2.0
    return np.quantile(samples, lo, axis=0), np.quantile(samples, 1.0 - lo, axis=0)


STAT_NAMES = ("kld", "same_top", "ppl")


def _named(point: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> dict:
    """{"kld": .., "kld_ci": [lo, hi], "same_top": .., ...} from _stats-ordered arrays."""
    out = {}
    for i, name in enumerate(STAT_NAMES):
        out[name] = float(point[i])
        out[f"{name}_ci"] = [float(lo[i]), float(hi[i])]
    return out


def summarize(run: DivergenceRun, draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED,
              confidence: float = CONFIDENCE) -> dict:
    """Token-pooled statistics with item-bootstrap intervals:
    {"n_items", "n_tokens", "kld", "kld_ci", "kld_median", "kld_p99", "same_top", "same_top_ci",
    "ppl", "ppl_ci"}. The same seed gives the same intervals for the same items."""
    if not run.items or run.n_tokens == 0:
        return {"n_items": len(run.items), "n_tokens": 0}
    sums = _item_sums(run)
    point = _stats(sums.sum(axis=0))
    idx = _draws(len(sums), draws, seed)
    lo, hi = _interval(_stats(sums[idx].sum(axis=1)), confidence)
    kld = run.pooled("kld")
    out = {"n_items": len(run.items), "n_tokens": run.n_tokens,
           "kld_median": float(np.median(kld)), "kld_p99": float(np.quantile(kld, 0.99)),
           "confidence": confidence, "bootstrap_draws": draws}
    out.update(_named(point, lo, hi))
    return out


def paired_delta(a: DivergenceRun, b: DivergenceRun, draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED,
                 confidence: float = CONFIDENCE) -> dict:
    """a minus b for each statistic (KLD, same-top share, perplexity), with an interval from
    resampling the same items for both. The runs must cover the same items in the same order.
    {"kld": d, "kld_ci": [lo, hi], ...}; an interval that excludes 0 supports the sign of d."""
    if len(a.items) != len(b.items) or any(x.n != y.n for x, y in zip(a.items, b.items)):
        raise ValueError("paired_delta needs two runs over the same items")
    sa, sb = _item_sums(a), _item_sums(b)
    point = _stats(sa.sum(axis=0)) - _stats(sb.sum(axis=0))
    idx = _draws(len(sa), draws, seed)
    lo, hi = _interval(_stats(sa[idx].sum(axis=1)) - _stats(sb[idx].sum(axis=1)), confidence)
    return _named(point, lo, hi)


class ReferenceRows:
    """A reference's logits for a list of scored items, one [n_scored, n_vocab] float32 block per
    item, kept in an anonymous temp file and read back one item at a time: with a 150k-token
    vocabulary 1,024 scored rows are 0.6 GB, which a conversion should not hold while the model it
    came from is open. ``label`` names the reference ("F16"). Use as a context manager, or close()."""

    def __init__(self, label: str, folder: Optional[str] = None):
        self.label = label
        # Unlinked at once: nothing is left behind however the process ends (the name stays
        # readable in /proc/PID/fd while it is open).
        fd, path = tempfile.mkstemp(prefix=".river-reference-", dir=folder)
        os.unlink(path)
        self._file = os.fdopen(fd, "w+b")
        self._index: List[Tuple[int, Tuple[int, int]]] = []

    def add(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2:
            raise ValueError(f"reference rows must be 2-D, got shape {rows.shape}")
        self._file.seek(0, os.SEEK_END)
        self._index.append((self._file.tell(), rows.shape))
        if rows.size:
            self._file.write(memoryview(rows).cast("B"))  # the array's own bytes: no copy first

    def add_logits_of(self, model, prepared: Sequence[Tuple[List[int], int]], bar=None) -> int:
        """Add `model`'s logits on each prepared (tokens, prefix) item's scored rows, its backbone
        in one batched pass per item (the F16 a conversion measures its presets against). Returns
        the rows added; bar: a progress bar to step once per item."""
        n = 0
        for toks, prefix in prepared:
            rows, _ = config_logits(model, toks, prefix, batched=True, mode="backbone")
            self.add(rows)
            n += len(rows)
            if bar is not None:
                bar.update(1)
        return n

    def __len__(self) -> int:
        return len(self._index)

    @property
    def nbytes(self) -> int:
        """The bytes the rows take on disk: the temp file's size, as the file system reports it."""
        return os.fstat(self._file.fileno()).st_size

    def __getitem__(self, i: int) -> np.ndarray:
        """Item i's rows, read-only: a map of the file's pages (the rows were just written, so they
        are in the page cache; a copy into fresh memory per setting and item cost more than the
        KLDs of a 150k vocabulary)."""
        offset, shape = self._index[i]
        n = shape[0] * shape[1]
        if not n:
            empty = np.zeros(shape, dtype=np.float32)
            empty.flags.writeable = False
            return empty
        self._file.flush()
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        pages = mmap.mmap(self._file.fileno(), offset - start + 4 * n, access=mmap.ACCESS_READ, offset=start)
        return np.frombuffer(pages, dtype=np.float32, count=n, offset=offset - start).reshape(shape)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ReferenceRows":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def score_configs(reference, configs: Dict[str, Tuple[object, dict]], prepared: Sequence[Tuple[List[int], int]],
                  reference_options: Optional[dict] = None, batched_static: bool = False, bar=None
                  ) -> Dict[str, DivergenceRun]:
    """Score each configuration against the reference, item by item (the reference's
    distribution of one item is computed once and dropped after its configurations: the whole
    split's would not fit in memory for a 150k vocabulary).

    configs: {label: (model, exit options)}; prepared: (tokens, prefix) per item. Everything,
    the reference included, decodes token by token with exits live; batched_static runs the
    reference and static settings in one batched pass instead (see the module docstring)."""
    ref_opts = dict(mode="backbone") if reference_options is None else dict(reference_options)
    runs = {k: DivergenceRun() for k in configs}
    for toks, prefix in prepared:
        ref = reference_logits(reference, toks, prefix, batched=batched_static, **ref_opts)
        targets = toks[prefix:]
        for label, (model, opts) in configs.items():
            t0 = time.perf_counter()
            logits, exits = config_logits(model, toks, prefix, batched=batched_static and is_static(opts), **opts)
            runs[label].add(compare(ref, logits, targets), exits)
            runs[label].seconds += time.perf_counter() - t0
            if bar is not None:
                bar.update(len(targets))
    return runs


def fmt_ci(value: Optional[float], ci: Optional[Sequence[float]], fmt: str = "{:.4f}") -> str:
    """'0.0670 [0.0611, 0.0733]' (or '-' when missing)."""
    if value is None:
        return "-"
    s = fmt.format(value)
    return s if not ci else f"{s} [{fmt.format(ci[0])}, {fmt.format(ci[1])}]"
