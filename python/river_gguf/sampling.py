"""Token sampling for river_gguf.

The sampler works on one row of logits (``float32[n_vocab]``) at a time and
applies, in this order:

1. repetition penalty over the last ``REPEAT_WINDOW`` tokens of the history
   (llama.cpp semantics: a positive logit is divided by the penalty, a
   non-positive one is multiplied by it; each distinct token once);
2. ``temperature == 0`` -> greedy argmax, no randomness consumed;
3. otherwise top-k -> top-p -> min-p -> temperature -> softmax -> one draw from
   a ``numpy.random.Generator``.

The top-k step uses ``np.argpartition`` and only sorts the surviving ``k``
candidates.  With top-k disabled the top-p step grows a partially sorted
prefix until it covers the requested mass, so the whole vocabulary is only
sorted in the worst case.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import numpy as np

__all__ = ["Sampler", "REPEAT_WINDOW"]

#: Number of most recent history tokens the repetition penalty looks at.
REPEAT_WINDOW = 64

# Initial prefix size for the top-p search when top-k is disabled.
_TOP_P_START = 64


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class Sampler:
    """Stateful token sampler (the state is the random generator)."""

    def __init__(
        self,
        temperature: float = 0.0,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: Optional[int] = None,
    ) -> None:
        if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0, got {temperature!r}"
            )
        if not _is_int(top_k) or top_k < 0:
            raise ValueError(
                f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}"
            )
        if not _is_real(top_p) or not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must satisfy 0 < top_p <= 1, got {top_p!r}")
        if not _is_real(min_p) or not (0.0 <= min_p <= 1.0):
            raise ValueError(f"min_p must satisfy 0 <= min_p <= 1, got {min_p!r}")
        if (
            not _is_real(repeat_penalty)
            or not math.isfinite(repeat_penalty)
            or repeat_penalty <= 0
        ):
            raise ValueError(
                f"repeat_penalty must be a finite number > 0, got {repeat_penalty!r}"
            )
        self._check_seed(seed)

        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.min_p = float(min_p)
        self.repeat_penalty = float(repeat_penalty)
        self.seed = None if seed is None else int(seed)
        self._rng = np.random.default_rng(self.seed)

    # ------------------------------------------------------------------ utils
    @staticmethod
    def _check_seed(seed) -> None:
        if seed is not None and (not _is_int(seed) or seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {seed!r}")

    def reset(self, seed: Optional[int] = None) -> None:
        """Re-seed the generator (``None`` -> fresh entropy from the OS)."""
        self._check_seed(seed)
        self.seed = None if seed is None else int(seed)
        self._rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __repr__(self) -> str:
        return (
            f"Sampler(temperature={self.temperature}, top_k={self.top_k}, "
            f"top_p={self.top_p}, min_p={self.min_p}, "
            f"repeat_penalty={self.repeat_penalty}, seed={self.seed})"
        )

    # --------------------------------------------------------------- penalty
    def apply_repeat_penalty(
        self, logits: np.ndarray, history: Sequence[int]
    ) -> np.ndarray:
        """Return logits with the repetition penalty applied.

        The input array is never modified; a copy is made only when a penalty
        actually applies.
        """
        if self.repeat_penalty == 1.0 or history is None or len(history) == 0:
            return logits
        recent = np.asarray(history[-REPEAT_WINDOW:], dtype=np.int64)
        n_vocab = logits.shape[0]
        recent = recent[(recent >= 0) & (recent < n_vocab)]
        if recent.size == 0:
            return logits
        ids = np.unique(recent)
        out = np.array(logits, dtype=np.float32, copy=True)
        vals = out[ids]
        out[ids] = np.where(
            vals > 0, vals / self.repeat_penalty, vals * self.repeat_penalty
        ).astype(np.float32)
        return out

    # ---------------------------------------------------------------- sample
    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """Pick the next token id from one row of logits."""
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.shape[0] == 0:
            raise ValueError(
                f"logits must be a non-empty 1-D array, got shape {logits.shape}"
            )
        if logits.dtype != np.float32:
            logits = logits.astype(np.float32)

        logits = self.apply_repeat_penalty(logits, history)

        if self.temperature == 0.0:
            return int(np.argmax(logits))

        n_vocab = logits.shape[0]

        # ---- top-k: candidate ids sorted by descending logit
        if 0 < self.top_k < n_vocab:
            k = self.top_k
            part = np.argpartition(logits, n_vocab - k)[n_vocab - k:]
            ids = part[np.argsort(-logits[part], kind="stable")]
            cand = logits[ids].astype(np.float64)
            if self.top_p < 1.0:
                ids, cand = self._top_p_sorted(ids, cand)
        elif self.top_p < 1.0:
            ids, cand = self._top_p_full(logits)
        else:
            # Neither top-k nor top-p: keep everything (unsorted is fine, the
            # remaining steps only need the maximum).  Apply min-p here on the
            # float32 row so the float64 work below only touches survivors.
            max_logit = float(logits.max())
            if self.min_p > 0.0 and math.isfinite(max_logit):
                ids = np.flatnonzero(logits >= max_logit + math.log(self.min_p))
            else:
                ids = np.arange(n_vocab)
            cand = logits[ids].astype(np.float64)

        # ---- min-p (relative to the most likely candidate)
        if self.min_p > 0.0 and ids.size > 1:
            max_logit = cand.max()
            if math.isfinite(max_logit):
                keep = cand >= max_logit + math.log(self.min_p)
                if not keep.all():
                    ids = ids[keep]
                    cand = cand[keep]

        if ids.size == 1:
            return int(ids[0])

        # ---- temperature, softmax, draw
        scaled = cand / self.temperature
        scaled -= scaled.max()
        probs = np.exp(scaled)
        cdf = np.cumsum(probs)
        total = cdf[-1]
        if not math.isfinite(total) or total <= 0.0:
            return int(ids[int(np.argmax(cand))])
        r = self._rng.random() * total
        j = int(np.searchsorted(cdf, r, side="right"))
        if j >= ids.size:
            j = ids.size - 1
        return int(ids[j])

    # ----------------------------------------------------------- top-p parts
    def _top_p_sorted(self, ids: np.ndarray, cand: np.ndarray):
        """Top-p over candidates already sorted by descending logit."""
        m = cand[0]
        p = np.exp(cand - m)
        p /= p.sum()
        cum = np.cumsum(p)
        n = int(np.searchsorted(cum, self.top_p, side="left")) + 1
        n = min(max(n, 1), ids.size)
        return ids[:n], cand[:n]

    def _top_p_full(self, logits: np.ndarray):
        """Top-p over the whole vocabulary without sorting all of it.

        The normaliser is computed over the whole vocabulary; the sorted
        prefix grows geometrically until its cumulative mass reaches top_p.
        """
        n_vocab = logits.shape[0]
        lg = logits.astype(np.float64)
        m = lg.max()
        expv = np.exp(lg - m)
        z = expv.sum()
        k = min(_TOP_P_START, n_vocab)
        while True:
            if k >= n_vocab:
                ids = np.argsort(-lg, kind="stable")
            else:
                part = np.argpartition(lg, n_vocab - k)[n_vocab - k:]
                ids = part[np.argsort(-lg[part], kind="stable")]
            cum = np.cumsum(expv[ids]) / z
            if cum[-1] >= self.top_p or k >= n_vocab:
                n = int(np.searchsorted(cum, self.top_p, side="left")) + 1
                n = min(max(n, 1), ids.size)
                ids = ids[:n]
                return ids, lg[ids]
            k = min(k * 4, n_vocab)
