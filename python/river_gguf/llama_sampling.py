"""libllama's own sampler chain, run on logits that the river_gguf engine computed.

llama_cpp.Llama samples with a llama_sampler chain inside libllama (llama_sampler_sample on its
context's logits). river_gguf.Llama computes logits with its own engine, so it builds the same
chain through llama_cpp's ctypes bindings and applies it to a llama_token_data_array filled from
those logits, then accepts the chosen token, as llama_sampler_sample does. Same logits, same seed
and same parameters therefore give the same token, and the stateful samplers (penalties over the
tokens accepted so far, the grammar's parse stacks, mirostat's mu, the RNG) advance as they do
in llama_cpp.

The chain order is llama_cpp.Llama._init_sampler's (llama-cpp-python 0.3.36):
  penalties -> grammar -> greedy                         (temp == 0)
                       -> dist                           (temp < 0)
                       -> mirostat / mirostat_v2         (temp > 0, mirostat_mode 1 / 2)
                       -> top_k, typical, top_p, min_p, temp, dist   (temp > 0 otherwise)
Logits processors and logit_bias run before the chain, in Python, on the logits in token order:
that is what llama_cpp's custom first sampler does with the same unsorted array.
"""
from __future__ import annotations

import collections
import ctypes
import math
from typing import Optional

import llama_cpp.llama_cpp as lib
import numpy as np

#: llama_token_data {id: int32, logit: float, p: float}, laid out as the C struct.
TOKEN_DATA = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)

#: Mirostat v1's m (tokens used to estimate s_hat), the value llama_cpp passes.
MIROSTAT_M = 100

#: The shortlist (SamplerChain._shortlist) is used while it is at most this share of the candidates.
SHORTLIST_MAX_SHARE = 0.25
#: Every this-many-th candidate estimates the shortlist's logit threshold.
SHORTLIST_STRIDE = 16
#: Two kept logits closer than this (relative) count as tied: the full candidate array is then
#: sampled, since a tie's order depends on the partial sort's input.
SHORTLIST_TIE = 1e-5


class SamplingError(RuntimeError):
    """The chain selected no token, or one that every constraint had ruled out (for example a
    grammar that no token with a finite logit can continue)."""


def grammar_text(grammar) -> tuple:
    """(GBNF text, root rule) of a llama_cpp.LlamaGrammar, or of a GBNF string."""
    if isinstance(grammar, str):
        return grammar, "root"
    text = getattr(grammar, "_grammar", None)
    root = getattr(grammar, "_root", "root")
    if not isinstance(text, str) or not isinstance(root, str):
        raise TypeError(f"grammar must be a llama_cpp.LlamaGrammar or a GBNF string, got {type(grammar).__name__}")
    return text, root


def _grammar_sampler(vocab, grammar):
    text, root = grammar_text(grammar)
    if not text.strip():
        raise ValueError("the grammar is empty")
    smpl = lib.llama_sampler_init_grammar(vocab, text.encode("utf-8"), root.encode("utf-8"))
    if not smpl:
        # libllama logs the parse error; it returns NULL instead of raising.
        raise ValueError(f"libllama could not parse the GBNF grammar (root rule {root!r}); see its log for the "
                         "line. Grammar text starts: " + repr(text[:120]))
    return smpl


def check_grammar(vocab, grammar) -> None:
    """Parse `grammar` with libllama now (ValueError if it does not parse), so a stream fails
    before it starts rather than at its first token."""
    lib.llama_sampler_free(_grammar_sampler(vocab, grammar))


def _finite(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {v!r}")
    return int(v)


class SamplerChain:
    """One llama_sampler chain, built as llama_cpp.Llama builds it for one generation.

    `vocab` (a llama_vocab pointer) is needed only for a grammar. `seed` is a uint32 as
    libllama takes it (LLAMA_DEFAULT_SEED, 0xFFFFFFFF, draws a random one). shortlist=False
    always hands libllama every candidate (the same tokens, slower: see _shortlist)."""

    def __init__(self, n_vocab: int, *, seed: int, temp: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, typical_p: float = 1.0, repeat_penalty: float = 1.0,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, penalty_last_n: int = 64,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 grammar=None, vocab=None, shortlist: bool = True):
        temp = _finite("temperature", temp)
        top_k = _int("top_k", top_k)
        top_p, min_p, typical_p = (_finite(n, v) for n, v in
                                   (("top_p", top_p), ("min_p", min_p), ("typical_p", typical_p)))
        repeat_penalty = _finite("repeat_penalty", repeat_penalty)
        frequency_penalty = _finite("frequency_penalty", frequency_penalty)
        presence_penalty = _finite("presence_penalty", presence_penalty)
        penalty_last_n = _int("last_n_tokens_size", penalty_last_n)
        mirostat_mode = _int("mirostat_mode", mirostat_mode)
        if mirostat_mode not in (0, 1, 2):
            raise ValueError(f"mirostat_mode must be 0, 1 or 2, got {mirostat_mode}")
        mirostat_tau, mirostat_eta = _finite("mirostat_tau", mirostat_tau), _finite("mirostat_eta", mirostat_eta)
        seed = _int("seed", seed)
        if grammar is not None and vocab is None:
            raise ValueError("a grammar needs the model's vocabulary")

        self.n_vocab = int(n_vocab)
        self.has_grammar = grammar is not None
        # Greedy with neutral penalties and no grammar: libllama's chain is then the greedy sampler
        # alone (its penalties return at once), whose choice is the first highest logit; sample()
        # takes it without filling the vocabulary-wide candidate array.
        self._argmax = (temp == 0.0 and grammar is None and repeat_penalty == 1.0 and frequency_penalty == 0.0
                        and presence_penalty == 0.0)
        self._chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if not self._chain:
            raise MemoryError("llama_sampler_chain_init failed")
        try:
            # The chain owns every sampler added to it and frees them with itself.
            self._add(lib.llama_sampler_init_penalties(self.n_vocab, penalty_last_n, repeat_penalty,
                                                       frequency_penalty, presence_penalty))
            if grammar is not None:
                self._add(_grammar_sampler(vocab, grammar))
            if temp < 0.0:
                self._add(lib.llama_sampler_init_dist(seed))
            elif temp == 0.0:
                self._add(lib.llama_sampler_init_greedy())
            elif mirostat_mode == 1:
                self._add(lib.llama_sampler_init_mirostat(self.n_vocab, seed, mirostat_tau, mirostat_eta, MIROSTAT_M))
            elif mirostat_mode == 2:
                self._add(lib.llama_sampler_init_mirostat_v2(seed, mirostat_tau, mirostat_eta))
            else:
                min_keep = 1  # llama_cpp: max(1, n_probs) with n_probs = 0
                self._add(lib.llama_sampler_init_top_k(top_k))
                self._add(lib.llama_sampler_init_typical(typical_p, min_keep))
                self._add(lib.llama_sampler_init_top_p(top_p, min_keep))
                self._add(lib.llama_sampler_init_min_p(min_p, min_keep))
                self._add(lib.llama_sampler_init_temp(temp))
                self._add(lib.llama_sampler_init_dist(seed))
        except BaseException:
            self.close()
            raise
        # The chain's first stage after the penalties that keeps only the highest logits: top-k, or
        # greedy's single best. Every stage after it sees just those, so any candidate array that
        # holds them (in the same order) samples the same token (see _shortlist).
        self._keeps = 0 if grammar is not None or mirostat_mode or not shortlist else (1 if temp == 0.0 else
                                                                      max(top_k, 0) if temp > 0.0 else 0)
        penalised = not (max(penalty_last_n, 0) == 0 or (np.single(repeat_penalty) == 1 and np.single(
            frequency_penalty) == 0 and np.single(presence_penalty) == 0))
        self._penalty = (np.single(repeat_penalty), np.single(frequency_penalty), np.single(presence_penalty))
        if penalised and (self._penalty[0] < 1 or self._penalty[1] < 0 or self._penalty[2] < 0):
            self._keeps = 0  # a penalty that raises a logit can lift any token into the top
        # A draw by libllama's dist (or mirostat) leaves each candidate's probability in `p`; greedy does not.
        self._draws = temp != 0.0
        self._drawn_p: Optional[float] = None
        # The tokens libllama's penalties sampler counts: the last penalty_last_n accepted.
        self._recent = collections.deque(maxlen=penalty_last_n) if penalised else None
        # One candidate buffer per chain, refilled for every token (as libllama's chain keeps `cur`).
        self._cur = np.zeros(self.n_vocab, dtype=TOKEN_DATA)
        self._ids = np.arange(self.n_vocab, dtype=np.intc)
        self._array = lib.llama_token_data_array(
            data=self._cur.ctypes.data_as(lib.llama_token_data_p), size=self.n_vocab, selected=-1, sorted=False)

    def _add(self, smpl) -> None:
        if not smpl:
            raise MemoryError("libllama returned no sampler")
        lib.llama_sampler_chain_add(self._chain, smpl)

    def sample(self, logits: np.ndarray) -> int:
        """Apply the chain to `logits` (float32 [n_vocab], token order), accept the chosen token
        into every sampler's state, and return it: llama_sampler_sample on our logits."""
        if self._chain is None:
            raise RuntimeError("this sampler chain is closed")
        logits = np.asarray(logits, dtype=np.single)
        if logits.shape != (self.n_vocab,):
            raise ValueError(f"logits must have shape ({self.n_vocab},), got {logits.shape}")
        if self._argmax:
            best = int(np.argmax(logits))
            # libllama's greedy sampler never moves to a NaN (every comparison with one is false),
            # numpy's argmax stops at one: rows with a NaN take the chain itself.
            if not math.isnan(logits[best]):
                if logits[best] == -math.inf:
                    raise SamplingError("no token is allowed: every candidate's logit is -inf after the constraints "
                                        "(grammar, logit_bias, logits_processor)")
                self._accept(best)
                return best
        return self._apply(self._ids, logits)

    def _accept(self, token: int) -> None:
        lib.llama_sampler_accept(self._chain, token)
        if self._recent is not None:
            self._recent.append(token)

    def _shortlist(self, ids: np.ndarray, logits: np.ndarray):
        """Positions into the candidates of a few that sample exactly as all of them do, or None.

        The chain's penalties lower the logits of recent tokens (only lower, which is checked) and
        its next stage keeps the K highest (top-k, or greedy's 1). Take every recent token and at
        least K + 1 + (number of recent tokens) of the highest raw logits: at least K + 1 of those
        are not penalised, so the shortlist's K + 1 highest penalised logits are the whole
        array's. When those K + 1 are distinct, the kept K and their order are the same whatever
        else the array holds, and so is every later stage's input. Filling and penalising the whole
        vocabulary costs about 1.2 ms of CPU a row at 151,936 tokens (the penalties look every candidate up
        in a hash map); choosing and sampling a shortlist of a few hundred, about 0.25 ms."""
        keeps, n = self._keeps, len(ids)
        if keeps <= 0 or np.isnan(logits).any():
            return None
        tokens, counts = self._window()
        want = keeps + 1 + len(tokens)
        if want > SHORTLIST_MAX_SHARE * n:
            return None
        threshold = self._threshold(logits, want)
        chosen = logits >= threshold
        if len(tokens):
            if ids is self._ids:
                chosen[tokens[tokens < n]] = True
            else:
                flag = np.zeros(self.n_vocab, dtype=bool)
                flag[tokens] = True
                chosen |= flag[ids]
        top = np.flatnonzero(chosen)
        if len(top) > SHORTLIST_MAX_SHARE * n:
            return None
        values = self._penalised(ids[top], logits[top], tokens, counts)
        best = -np.sort(-values)[:keeps + 1]
        if np.isnan(best).any() or not np.isfinite(best[:keeps]).all():
            return None
        gaps = best[:-1] - best[1:]
        if (gaps <= SHORTLIST_TIE * np.maximum(np.abs(best[:-1]), 1.0)).any():
            return None
        return top

    def _window(self):
        """The tokens the penalties sampler counts (sorted, distinct) and their counts; none when
        the chain has no penalties."""
        if not self._recent:
            return np.zeros(0, np.intc), np.zeros(0, np.single)
        tokens, counts = np.unique(np.fromiter(self._recent, dtype=np.intc, count=len(self._recent)),
                                   return_counts=True)
        return tokens, counts.astype(np.single)

    @staticmethod
    def _threshold(logits: np.ndarray, want: int) -> float:
        """A logit that at least `want` logits reach and not many more (estimated from a strided
        sample, checked, else the want-th highest itself)."""
        n = len(logits)
        sample = logits[::SHORTLIST_STRIDE]
        q = min(len(sample) - 1, 2 * (want // SHORTLIST_STRIDE) + 2)
        threshold = np.partition(sample, len(sample) - 1 - q)[len(sample) - 1 - q]
        if want <= np.count_nonzero(logits >= threshold) <= 8 * want:
            return threshold
        return np.partition(logits, n - want)[n - want]

    def _penalised(self, ids: np.ndarray, logits: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The logits after libllama's penalties sampler (float32, as it computes them)."""
        values = np.array(logits, dtype=np.single, copy=True)
        if not len(tokens):
            return values
        at = np.minimum(np.searchsorted(tokens, ids), len(tokens) - 1)
        hit = tokens[at] == ids
        repeat, freq, present = self._penalty
        v = values[hit]
        v = np.where(v <= 0, v * repeat, v / repeat).astype(np.single)
        values[hit] = v - (counts[at[hit]] * freq + present)
        return values

    def _apply(self, ids: np.ndarray, logits: np.ndarray) -> int:
        """The chain over candidates ids[i] with logits[i]: the chosen token, accepted."""
        short = self._shortlist(ids, logits)
        if short is not None:
            ids, logits = ids[short], logits[short]
        n = len(ids)
        cur = self._cur[:n]
        cur["id"] = ids
        cur["logit"] = logits
        cur["p"] = 0.0
        arr = self._array
        arr.data = cur.ctypes.data_as(lib.llama_token_data_p)
        arr.size = n
        arr.selected = -1
        arr.sorted = False
        lib.llama_sampler_apply(self._chain, ctypes.byref(arr))
        sel = arr.selected
        if not 0 <= sel < arr.size:
            raise SamplingError(f"the sampler chain selected no token (index {sel} of {arr.size})")
        chosen = arr.data[sel]
        if chosen.logit == -math.inf:
            # Every candidate was ruled out (a grammar no finite-logit token can continue, or
            # logit_bias/-inf everywhere). libllama's grammar would abort the process on accept.
            raise SamplingError("no token is allowed: every candidate's logit is -inf after the constraints "
                                "(grammar, logit_bias, logits_processor)")
        token = int(chosen.id)
        self._drawn_p = float(chosen.p) if self._draws else None
        self._accept(token)
        return token

    @property
    def drawn_probability(self) -> Optional[float]:
        """The last token's probability in the distribution the chain drew it from (after every
        stage: penalties, top-k/p, min-p, temperature); None for a greedy chain or before a draw."""
        return self._drawn_p

    def clone(self) -> "SamplerChain":
        """A copy in the same state (libllama's llama_sampler_clone: the RNG's state, the
        penalties' history, the grammar's stack): it draws what this chain would draw next from
        the same logits. It shares this chain's candidate buffer: sample with one at a time."""
        if self._chain is None:
            raise RuntimeError("this sampler chain is closed")
        twin = object.__new__(SamplerChain)
        twin.n_vocab, twin.has_grammar, twin._argmax = self.n_vocab, self.has_grammar, self._argmax
        twin._keeps, twin._penalty, twin._draws, twin._drawn_p = self._keeps, self._penalty, self._draws, None
        twin._recent = None if self._recent is None else collections.deque(self._recent, maxlen=self._recent.maxlen)
        twin._chain = lib.llama_sampler_clone(self._chain)
        if not twin._chain:
            raise MemoryError("llama_sampler_clone failed")
        twin._cur, twin._ids, twin._array = self._cur, self._ids, self._array
        return twin

    @property
    def greedy(self) -> bool:
        """The chain is the first highest logit alone (greedy, neutral penalties, no grammar)."""
        return self._argmax

    def sample_from(self, tokens: np.ndarray, logits: np.ndarray) -> int:
        """sample() over some tokens only: candidate i is tokens[i] with logits[i] (a draft
        vocabulary's rows). The chain's samplers see just these candidates."""
        if self._chain is None:
            raise RuntimeError("this sampler chain is closed")
        tokens, logits = np.asarray(tokens, dtype=np.intc), np.asarray(logits, dtype=np.single)
        n = len(tokens)
        if n != len(logits) or not 0 < n <= self.n_vocab:
            raise ValueError(f"tokens and logits must have the same length in [1, {self.n_vocab}]")
        return self._apply(tokens, logits)

    def accept(self, token: int) -> None:
        """Record `token` as generated without sampling it (penalties, grammar, RNG state)."""
        if self._chain is None:
            raise RuntimeError("this sampler chain is closed")
        self._accept(int(token))

    def close(self) -> None:
        chain, self._chain = getattr(self, "_chain", None), None
        if chain:
            lib.llama_sampler_free(chain)

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def apply_processors(processors, input_ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Run llama_cpp-style logits processors (callables (input_ids, scores) -> scores) in order."""
    scores = logits
    for proc in processors:
        out = proc(input_ids, scores)
        if out is None:
            raise TypeError(f"logits processor {proc!r} returned None; it must return the scores array")
        scores = np.asarray(out, dtype=np.single)
    return scores


def logit_bias_processor(logit_bias: dict, n_vocab: int):
    """llama_cpp's logit_bias: add bias[token] to that token's logit (keys may be str, as in JSON)."""
    bias = {}
    for k, v in logit_bias.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
        if not 0 <= tok < n_vocab:
            raise ValueError(f"logit_bias token id {tok} is outside the vocabulary [0, {n_vocab})")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or math.isnan(v):
            raise ValueError(f"logit_bias[{k!r}] must be a number, got {v!r}")
        bias[tok] = float(v)
    ids = np.fromiter(bias.keys(), dtype=np.intp, count=len(bias))
    vals = np.fromiter(bias.values(), dtype=np.single, count=len(bias))

    def process(input_ids, scores):
        out = np.array(scores, dtype=np.single, copy=True)
        out[ids] = out[ids] + vals
        return out

    return process


def top_logprobs_order(logprobs: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest log-probabilities, ties broken toward the larger token id: the
    order of llama_cpp's sorted(zip(logprobs, range(n_vocab)), reverse=True)[:n]."""
    if n <= 0:
        return np.zeros(0, dtype=np.intp)
    lp = np.asarray(logprobs, dtype=np.float64)
    ids = np.arange(lp.shape[0])
    return np.lexsort((-ids, -lp))[:n]

