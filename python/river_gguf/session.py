"""A Session: a decode cursor over a Model's KV cache, and the one token loop.

A Session is what a llama.cpp server slot is: it knows which tokens the cache holds, the exit
options they ran under (resolved and validated once, when the session starts) and the logits rows
that came with them. Its loop, `decode`, runs plain decode steps or lossless rounds (the river
drafts, or an n-gram of the context does, as river_gguf.drafters chooses; the backbone verifies
the drafts in one batch) and applies one acceptance rule
(`accept`): the rows are walked in order, a policy's `choose(row)` picks each token, and a draft
is kept while it equals the token chosen at its position. Every caller is such a policy: the
drop-in Llama's sampler chain, greedy's argmax, teacher-forced scoring's "the text's next token".

Several Sessions may share one Model. Each decodes one sequence of the KV cache (`seq`, default
0): sessions on different sequences keep their tokens side by side, and their decode steps, when
they decode at once from several threads, are evaluated together in one batch by the Model's step
batcher (river_gguf.batching; `evaluate_steps` is its evaluation). A sequence holds one session at
a time: a session that finds another session of its sequence (or a one-shot Model call, which
clears every sequence) used the cache since, starts again from an empty sequence, and
re-evaluates what it needs through `prefill`'s prefix reuse. Lossless rounds run on any sequence
(the native draft and the verify batch go to the session's own): each round holds the Model's lock
and is evaluated alone, never joined with other sessions' steps, because the verify batch's
kernels are what makes its rows the exact reference's.
"""
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ._loader import native
from .drafters import DraftPlanner
from .options import ExitOptions, is_int

#: What `choose` returns to end the loop.
STOP = None

#: choose(row, seen) -> token or STOP: `row` is the logits row that follows the first `seen`
#: tokens of the session (Session.tokens[:seen]).
Choose = Callable[[np.ndarray, int], Optional[int]]


class NumericalError(RuntimeError):
    """The model produced NaN or infinite logits: its weights or hyperparameters are broken (or
    overflow in this precision). Raised instead of returning text or scores computed from them."""


class Step(NamedTuple):
    """One token of a decode loop, as the policy chose it."""
    token: int
    row: np.ndarray             # the logits row it was chosen from (valid until the next step)
    seen: int                   # the row follows the session's first `seen` tokens
    exit_layer: int             # of the pass that computed the row (n_layer - 1: never exited)
    scores: Optional[List[float]]  # with trace: the exit rule's score per backbone layer of that pass


@dataclass
class Counters:
    """What a session ran, for statistics: tokens and seconds of prefill and decode, the exit
    layer of every row a token was chosen from, and lossless rounds."""
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0      # tokens chosen from decode steps' and rounds' rows
    decode_steps: int = 0       # evaluations: plain steps and rounds
    decode_s: float = 0.0
    exit_layers: List[int] = field(default_factory=list)
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    ngram_rounds: int = 0       # rounds whose drafts came from the n-gram drafter
    ngram_drafted: int = 0
    ngram_accepted: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def evaluate(engine, tokens: List[int], opts: ExitOptions, prompt: bool, all_logits: bool = False,
             trace: bool = False, first_row: int = 0, seq_ids: Optional[List[int]] = None,
             decode_kernels: bool = False):
    """One native Engine.eval of `tokens` under `opts` (a prompt batch, or a decode step with
    prompt=False), refusing NaN or infinite logits; returns its (logits, exit layer, scores).
    seq_ids: each token's sequence, for several sequences in one batch (the rows are then each
    sequence's last, all of them read). decode_kernels: every row as a decode step computes it."""
    several = {} if seq_ids is None else {"seq_ids": seq_ids}
    out = engine.eval(tokens, all_logits=all_logits, trace=trace, first_row=first_row, decode_kernels=decode_kernels,
                      **several, **opts.engine_args(prompt))
    # Only the rows a caller reads are checked: the last one per step costs ~n_vocab compares.
    rows = out[0] if all_logits or seq_ids is not None else out[0][-1:]
    if not np.isfinite(rows).all():
        seqs = sorted(set(seq_ids)) if seq_ids else [0]
        where = ", ".join(f"sequence {s} after {engine.sequence_length(s)} positions" for s in seqs)
        raise NumericalError(
            f"the model produced NaN or infinite logits ({where}, "
            f"mode={opts.mode!r}); its weights or hyperparameters are broken, so no text or score is returned")
    return out


def accept(rows: np.ndarray, drafts: Sequence[int], choose: Choose, seen: int) -> Iterator[Tuple[int, int]]:
    """The acceptance rule (llama.cpp's speculative one): rows[j] predicts the token after the
    j-th of (token, *drafts), which is the session's token seen + j - 1. Yields (j, chosen token)
    in order, asking choose(rows[j], seen + j) for each;
    the walk goes on while the chosen token equals drafts[j] and ends after the first that does
    not (or after the last row, or at STOP, which is yielded too)."""
    for j in range(len(rows)):
        token = choose(rows[j], seen + j)
        yield j, token
        if token is STOP or j >= len(drafts) or token != drafts[j]:
            return


class Session:
    """A decode cursor over `model`'s KV cache under one resolved exit setting. Made by
    Model.session(); use it as a context manager or call close() to let the cache go.

    tokens: what the cache holds. prefill(tokens) makes it hold `tokens` (reusing the longest
    common prefix); extend(tokens) appends; decode(choose) runs the token loop from the last
    position's logits. keep_rows: keep every position's logits row (llama_cpp's logits_all);
    otherwise only the last evaluation's rows are kept (an attribute: a caller may switch it
    between calls; the buffer [n_ctx, n_vocab] is allocated at the first evaluation that keeps
    rows)."""

    def __init__(self, model, engine, lock, options: ExitOptions, keep_rows: bool = False, own_cache: bool = False,
                 verify_kernels: bool = False, seq: int = 0, batcher=None, decode_kernels: bool = False):
        self._model = model
        self._own_cache = own_cache  # an engine of the session's own, shared with nobody
        self._engine = engine
        self._lock = lock
        self.options = options.validate(model.n_layer, model.has_river)
        #: The sequence of the KV cache this session decodes.
        self.seq = int(seq)
        # The Model's step batcher: decode steps of sessions decoding at once share one batch.
        self._batcher = batcher
        self._tokens: List[int] = []
        # The last evaluation's rows: _rows[i] follows position _rows_from + i.
        self._rows: Optional[np.ndarray] = None
        self._rows_from = 0
        self._exit_layer = -1
        self._scores: Optional[List[float]] = None
        self._kept: Optional[np.ndarray] = None
        self._kept_valid = 0     # rows [0, _kept_valid) of _kept follow those positions
        self.keep_rows = bool(keep_rows)
        # Lossless verify batches in the decode steps' kernels (Model.lossless_kernels "decode"):
        # every row is a decode step's, so lossless text is plain decoding's bit for bit.
        self.decode_kernels = bool(decode_kernels)
        # Otherwise, decode steps may take the verify batch's kernels instead: each step evaluates
        # its token with a throwaway copy, so the text is bit for bit lossless mode's (at a step's
        # extra cost). With decode kernels there is nothing to match.
        self.verify_kernels = bool(verify_kernels) and not self.decode_kernels
        self._unchanged = 0      # positions unchanged since the last changes() call
        self._from_decode = False  # whether the last evaluation was a decode step or round
        self.counters = Counters()
        # Lossless rounds' choice of drafter and draft length (made at the first round), and how
        # many leading positions its n-gram context still shares with the cache's tokens.
        self._planner: Optional[DraftPlanner] = None
        self._planned_valid = 0
        self._draft_probs: List[float] = []  # the last round's greedy river drafts' probabilities
        self._closed = False

    # ----- what the cache holds ------------------------------------------------------------
    @property
    def tokens(self) -> List[int]:
        """The tokens the cache holds for this session (a copy; empty when another user of the
        cache displaced it)."""
        return list(self._tokens) if self._holds_cache() else []

    @property
    def n_past(self) -> int:
        return len(self._tokens)

    @property
    def model(self):
        return self._model

    @property
    def exit_layer(self) -> int:
        """The exit layer of the last evaluation (n_layer - 1: no token left the backbone)."""
        return self._exit_layer

    @property
    def scores(self) -> Optional[List[float]]:
        """The exit rule's score per backbone layer of the last evaluation, when it was traced."""
        return self._scores

    def row(self, pos: int) -> Optional[np.ndarray]:
        """The logits row that follows position `pos` (predicts the token after it), or None when
        it was not kept."""
        if not 0 <= pos < len(self._tokens):
            return None
        if self._rows is not None and 0 <= pos - self._rows_from < len(self._rows):
            return self._rows[pos - self._rows_from]
        if self._kept is not None and pos < self._kept_valid:
            return self._kept[pos]
        return None

    def kept_rows(self, allocate: bool = False) -> Optional[np.ndarray]:
        """The buffer of kept rows, [n_ctx, n_vocab]: row i follows position i, for i below
        rows_valid() (None before any was kept, unless allocate)."""
        if self._kept is None and allocate:
            self._kept = np.zeros((self._engine.n_ctx, self._model.n_vocab), dtype=np.float32)
        return self._kept

    def changes(self) -> Tuple[int, List[int]]:
        """(n, tokens[n:]): the cache's first n positions are the same as at the last call, and
        these tokens follow them now. For a caller that mirrors the tokens (Llama's input_ids)."""
        n = min(self._unchanged, len(self._tokens))
        self._unchanged = len(self._tokens)
        return n, self._tokens[n:]

    def rows_valid(self) -> int:
        """With keep_rows: how many leading positions have their row kept."""
        if self._kept is None:
            return 0
        return min(self._kept_valid, len(self._tokens))

    def reset_counters(self) -> Counters:
        """Start counting afresh; returns the counters so far."""
        done, self.counters = self.counters, Counters()
        return done

    # ----- changing what the cache holds -----------------------------------------------------
    def _claim(self) -> None:
        """Own the cache: when another session or a one-shot call used it since, it holds nothing
        of ours, so start from empty."""
        if self._closed:
            raise RuntimeError("this session is closed")
        if not self._holds_cache():
            self._model.give_cache(self)
            self._tokens.clear()
            self._rows, self._exit_layer, self._kept_valid, self._unchanged = None, -1, 0, 0
            self._planned_valid = 0

    def _holds_cache(self) -> bool:
        return self._own_cache or self._model.holds_cache(self)

    def truncate(self, n: int) -> None:
        """Keep the first n positions."""
        if not is_int(n) or not 0 <= n <= len(self._tokens):
            raise ValueError(f"n must be an int in [0, {len(self._tokens)}], got {n!r}")
        with self._lock:
            self._claim()
            n = max(0, min(int(n), len(self._tokens)))
            self._engine.truncate(n, seq=self.seq)
            del self._tokens[n:]
            self._unchanged = min(self._unchanged, n)
            self._planned_valid = min(self._planned_valid, n)
            self._kept_valid = min(self._kept_valid, n)
            if self._rows is not None:
                keep = n - self._rows_from
                self._rows = self._rows[:keep] if keep > 0 else None

    def prefill(self, tokens: Sequence[int], all_logits: bool = False, need_row: bool = True) -> int:
        """Make the cache hold `tokens`: keep the longest prefix it shares with them and evaluate
        the rest as a prompt batch. The last position's row is live afterwards (a token is
        evaluated again when its row was not kept), unless need_row=False; with all_logits, every
        position's row is kept too. Returns how many positions were reused."""
        tokens = self._model.check_tokens(tokens)
        if not tokens:
            raise ValueError("no tokens to evaluate")
        with self._lock:
            self._claim()
            common = common_prefix(self._tokens, tokens)
            if all_logits:
                common = min(common, self.rows_valid())
            if need_row and common == len(tokens) and self.row(common - 1) is None:
                common -= 1  # the last row must be fresh to sample from
            self.truncate(common)
            if common < len(tokens):
                self.extend(tokens[common:], all_logits=all_logits)
            return common

    def extend(self, tokens: Sequence[int], *, decode: bool = False, all_logits: bool = False,
               trace: bool = False, options: Optional[ExitOptions] = None) -> np.ndarray:
        """Evaluate `tokens` after the cache's positions: a prompt batch (the prefill policy
        applies), or with decode=True one decode step (exits live). Returns the last row, or every
        row with all_logits. options: this evaluation's setting (a forced exit layer for one
        step); default the session's."""
        tokens = self._model.check_tokens(tokens)
        if decode and len(tokens) > 1:
            raise ValueError(f"a decode step takes one token, got {len(tokens)}")
        if not tokens:
            raise ValueError("no tokens to evaluate")
        opts = self.options if options is None else options
        with self._lock:
            self._claim()
            t0 = time.perf_counter()
            rows, exit_layer, scores = self._eval(tokens, opts, prompt=not decode, all_logits=all_logits,
                                                  trace=trace)
            seconds = time.perf_counter() - t0
            c = self.counters
            if decode:
                c.decode_steps += 1
                c.decode_s += seconds
            else:
                c.prefill_tokens += len(tokens)
                c.prefill_s += seconds
            self._record(tokens, rows, all_logits, exit_layer, scores, decode)
            return rows if all_logits else rows[-1]

    def _eval(self, tokens: List[int], opts: ExitOptions, prompt: bool, all_logits: bool = False,
              trace: bool = False, decode_kernels: bool = False):
        n_ctx, used = self._engine.n_ctx, self._engine.cache_used
        if used + len(tokens) > n_ctx:
            raise native.ContextOverflowError(
                f"{len(tokens)} tokens after {used} need more than n_ctx={n_ctx} positions")
        try:
            out = evaluate(self._engine, tokens, opts, prompt, all_logits, trace,
                           seq_ids=None if self.seq == 0 else [self.seq] * len(tokens), decode_kernels=decode_kernels)
        except Exception:
            # The cache may hold what the failed evaluation wrote: the session holds its own tokens.
            self._engine.truncate(len(self._tokens), seq=self.seq)
            raise
        rows = out[0] if all_logits else out[0][-1:]
        return rows, int(out[1]), (list(out[2]) if trace else None)

    def _record(self, tokens: List[int], rows: np.ndarray, all_rows: bool, exit_layer: int, scores,
                decode: bool) -> None:
        first = len(self._tokens)
        self._tokens.extend(tokens)
        self._rows_from = first if all_rows else len(self._tokens) - 1
        self._rows = rows
        self._exit_layer = exit_layer
        self._scores = scores
        self._from_decode = decode
        if self.keep_rows and all_rows and self._kept_valid >= first:
            self.kept_rows(allocate=True)[first:len(self._tokens)] = rows
            self._kept_valid = len(self._tokens)
        else:
            self._kept_valid = min(self._kept_valid, first)

    # ----- the token loop --------------------------------------------------------------------
    def decode(self, choose: Choose, limit: Optional[int] = None, *, trace: bool = False,
               exit_layers: Optional[Sequence[int]] = None, pick=None) -> Iterator[Step]:
        """The token loop, from the last position's row: choose(row, seen) -> token (or STOP) picks
        each token, which is yielded and then evaluated, as a decode step, or in lossless mode as a
        round (drafts after it from the river or the n-gram drafter, as the session's DraftPlanner
        chooses; the backbone verifies it and the drafts in one batch, and `accept` walks the
        rows). Ends at STOP, after `limit` tokens, or when the caller stops; the cache then holds
        the positions before the last token yielded.
        trace: each step's exit-rule scores (Step.scores). exit_layers: the forced exit layer of
        each decode step in turn (a plain step each, the session's other options kept).
        pick: how the river chooses each round's drafts (default greedy): a callable returning a
        context manager that gives pick(logits, tokens) -> token (Session.draft says more), made
        afresh each round (a sampler's clone in its current state). The lock is taken per
        evaluation, not across yields: a session that another user of the cache displaced between
        two steps evaluates its tokens again. Plain decode steps (no trace, forced exits or
        verify_kernels) go through the Model's step batcher: run from several threads, sessions on
        different sequences share each step's batch. A thread that holds the Model's lock across
        the loop evaluates its steps alone (nothing displaces its session meanwhile), and other
        threads' steps wait for the lock."""
        if limit is not None and limit <= 0:
            return
        with self._lock:
            self._resume()
            row = self.row(len(self._tokens) - 1)
        if row is None:
            raise RuntimeError("decode needs the last position's logits: prefill or extend first")
        lossless = self.options.lossless and exit_layers is None
        batched = (self._batcher is not None and not lossless and exit_layers is None and not trace
                   and not self.verify_kernels)
        if batched:
            self._batcher.join(self)
        try:
            yield from self._loop(row, choose, limit, lossless, batched, trace, exit_layers, pick)
        finally:
            if batched:
                self._batcher.leave(self)

    def _loop(self, row: np.ndarray, choose: Choose, limit: Optional[int], lossless: bool, batched: bool, trace: bool,
              exit_layers: Optional[Sequence[int]], pick) -> Iterator[Step]:
        """decode's loop, from the last position's row."""
        forced = {}
        n = 0
        rows, drafts, base = row[None, :], [], len(self._tokens) - 1
        from_decode = self._from_decode
        while True:
            j, token = 0, STOP
            kept, rejected = 0, False  # this round's accepted drafts, and whether one was rejected
            try:
                for j, token in accept(rows, drafts, choose, base + 1):
                    if token is STOP:
                        return
                    c = self.counters
                    c.exit_layers.append(self._exit_layer)
                    c.decode_tokens += from_decode
                    hit = j < len(drafts) and token == drafts[j]
                    c.accepted += hit
                    kept += hit
                    rejected = j < len(drafts) and not hit
                    yield Step(int(token), rows[j], base + j + 1, self._exit_layer, self._scores)
                    n += 1
                    if limit is not None and n >= limit:
                        return
            finally:
                if lossless and self._planner is not None and self._planner.last is not None:
                    self._settle(kept, rejected)
                # Rows up to the last one a token was chosen from stay; the drafts after it leave
                # (a session closed meanwhile has nothing left to tidy).
                with self._lock:
                    if not self._closed:
                        self._resume()
                        if base + j + 1 < len(self._tokens):
                            self.truncate(base + j + 1)
            if batched:
                rows, drafts = self._batched_step(token), []
            else:
                with self._lock:
                    self._resume()
                    if lossless:
                        rows, drafts = self._round(token, None if limit is None else limit - n - 1, pick)
                    else:
                        opts = None
                        if exit_layers is not None:
                            k = int(exit_layers[n - 1])
                            if k not in forced:
                                forced[k] = self.options.with_overrides(mode="river", exit_layer=k).validate(
                                    self._model.n_layer, self._model.has_river)
                            opts = forced[k]
                        if self.verify_kernels and not trace:
                            rows = self._step_batched(token, opts or self.options)
                        else:
                            out = self.extend([token], decode=True, all_logits=self.keep_rows, trace=trace,
                                              options=opts)
                            rows = out.reshape(-1, out.shape[-1])
                        drafts = []
            base = len(self._tokens) - len(rows)
            from_decode = True

    def _batched_step(self, token: int) -> np.ndarray:
        """A decode step through the Model's step batcher (evaluate_steps runs it, alone or with
        other sessions' steps): the step's rows."""
        return self._batcher.step(self, self._model.check_token(token), self.options)

    def _resume(self) -> None:
        """When another user of the cache displaced this session, evaluate its tokens again (a
        prompt batch) so that the loop goes on from where it was."""
        if self._closed:
            raise RuntimeError("this session is closed")
        if self._holds_cache():
            return
        tokens = list(self._tokens)
        self._claim()
        if tokens:
            self.extend(tokens)

    def _step_batched(self, token: int, opts: ExitOptions) -> np.ndarray:
        """A decode step in the verify batch's kernels (verify_kernels)."""
        t0 = time.perf_counter()
        rows, exit_layer = self._eval_batched([int(token)], opts, prompt=False)
        c = self.counters
        c.decode_steps += 1
        c.decode_s += time.perf_counter() - t0
        self._record([int(token)], rows, True, exit_layer, None, True)
        return rows

    def draft(self, token: int, max_drafts: Optional[int] = None, pick=None, p_min: Optional[float] = None,
              with_probs: bool = False):
        """The river's drafts after `token` (which goes at position n_past of the session's sequence):
        the drafts' cache rows are removed again, so the sequence keeps n_past positions (the
        verify batch writes its own rows) and the other sequences are untouched.
        max_drafts: fewer than the options' draft_max; p_min: this draft's draft_p_min.
        with_probs: return (drafts, each one's probability under the draft) instead, at the cost
        of a softmax over the vocabulary per draft. pick(logits, tokens) -> token, when given,
        chooses each draft instead of the greedy rule (-1: stop), from the draft's logits and the
        token of each (None: the whole vocabulary in order; read-only arrays valid during the
        call); draft_p_min and the probabilities then do not apply."""
        token = self._model.check_token(token)
        if not self._model.has_river:
            raise ValueError(f"{self._model.model_path} has no river to draft with")
        with self._lock:
            self._claim()
            self._check_room()
            args = self.options.draft_args()
            if max_drafts is not None:
                args["n_max"] = max(0, min(args["n_max"], int(max_drafts)))
            if p_min is not None:
                args["p_min"] = float(p_min)
            if args["n_max"] == 0:
                return ([], []) if with_probs else []
            # Drafts beyond the cache's free rows (every sequence's count) have no room to be verified.
            args["n_max"] = min(args["n_max"], self._engine.n_ctx - self._engine.cache_used - 1)
            tokens, probs = self._engine.draft(token, **args, seq=self.seq, with_probs=bool(with_probs), pick=pick)
            return (list(tokens), list(probs)) if with_probs else list(tokens)

    def verify(self, tokens: Sequence[int]) -> np.ndarray:
        """The backbone's rows for a round's batch (its token and drafts), evaluated as a lossless
        round evaluates them (in one batch, in the session's lossless kernels) with every layer's
        K/V written: float32 [len(tokens), n_vocab]."""
        tokens = self._model.check_tokens(tokens)
        if not tokens:
            raise ValueError("no tokens to verify")
        with self._lock:
            self._claim()
            rows, exit_layer = self._eval_batched(tokens, self.options, prompt=True)
            self._record(tokens, rows, True, exit_layer, None, False)
            return rows

    def _eval_batched(self, tokens: List[int], opts: ExitOptions, prompt: bool) -> Tuple[np.ndarray, int]:
        """Every row of `tokens` in the kernels all of lossless mode's rows take. With decode
        kernels: each row as a decode step computes it (a lone token is a decode step). Otherwise
        from a batch of at least two: one token goes with a throwaway copy of itself, whose row
        and cache position are dropped. Rows then come from the batched kernels whatever the
        batch's size (a lone token would take the single-token kernels, which round
        differently), so a verify batch and a decode step in this form agree bit for bit."""
        if self.decode_kernels:
            # The engine evaluates a lone token as the decode step it is.
            rows, exit_layer, _ = self._eval(tokens, opts, prompt=prompt, all_logits=True, decode_kernels=True)
            return rows, exit_layer
        if len(tokens) > 1:
            rows, exit_layer, _ = self._eval(tokens, opts, prompt=prompt, all_logits=True)
            return rows, exit_layer
        rows, exit_layer, _ = self._eval(tokens * 2, opts, prompt=prompt, all_logits=True)
        self._engine.truncate(self._engine.sequence_length(self.seq) - 1, seq=self.seq)
        return rows[:1], exit_layer

    def _check_room(self) -> None:
        if self._engine.cache_used + 1 > self._engine.n_ctx:
            raise native.ContextOverflowError(
                f"no room after {self._engine.cache_used} positions in n_ctx={self._engine.n_ctx}")

    def _round(self, token: int, room: Optional[int], pick) -> Tuple[np.ndarray, List[int]]:
        """One lossless round after `token`: the drafts the planner chooses (the river's, an
        n-gram's, or a free guess where there are none), and the verify batch's rows."""
        t0 = time.perf_counter()
        plan = self._plan(token, room)
        self._draft_probs = []
        if plan.source == "river" and pick is None:
            # The probabilities teach the planner where the early stop pays (adaptive_draft).
            if self.options.adaptive_draft:
                drafts, self._draft_probs = self.draft(token, plan.k, p_min=plan.p_min, with_probs=True)
            else:
                drafts = self.draft(token, plan.k, p_min=plan.p_min)
        elif plan.source == "river":
            with pick() as picker:
                # A picker that reports its drafts' probabilities (llama_draft.DraftPicker) stops
                # early as greedy drafts do, and teaches the planner where that pays.
                learns = self.options.adaptive_draft and hasattr(picker, "probs")
                if learns:
                    picker.p_min = plan.p_min
                drafts = self.draft(token, plan.k, picker)
                if learns:
                    self._draft_probs = list(picker.probs)
        else:
            drafts = list(plan.tokens)
        river_drafts = len(drafts)
        if not drafts and plan.source == "river":
            drafts = self._planner.guess_instead()
        t1 = time.perf_counter()
        rows, exit_layer = self._eval_batched([int(token)] + drafts, self.options, prompt=True)
        t2 = time.perf_counter()
        self._record([int(token)] + drafts, rows, True, exit_layer, None, True)
        self._planner.observe(plan, river_drafts, t1 - t0, t2 - t1)
        c = self.counters
        c.rounds += 1
        c.decode_steps += 1
        c.drafted += len(drafts)
        if self._planner.last.source in ("ngram", "guess"):
            c.ngram_rounds += 1
            c.ngram_drafted += len(drafts)
        c.draft_s += t1 - t0
        c.verify_s += t2 - t1
        c.decode_s += t2 - t0
        return rows, drafts

    def _plan(self, token: int, room: Optional[int]):
        """This round's drafts (drafters.Plan), at most `room` and what the context has room for;
        the n-gram drafter's context first catches up with the cache's tokens and `token`."""
        self._claim()
        self._check_room()
        if self._planner is None:
            o = self.options
            self._planner = DraftPlanner(o.draft_max, ngram=o.ngram_draft, adaptive=o.adaptive_draft,
                                         p_min=o.draft_p_min, min_verify=1 if self.decode_kernels else 2)
        ngram = self._planner.ngram
        if ngram is not None:
            ngram.truncate(min(self._planned_valid, len(ngram)))
            ngram.extend(self._tokens[len(ngram):])
            ngram.extend([int(token)])
            self._planned_valid = len(self._tokens)
        space = self._engine.n_ctx - self._engine.cache_used - 1
        return self._planner.plan(space if room is None else min(space, room))

    def _settle(self, kept: int, rejected: bool) -> None:
        """Tell the planner how the round's drafts fared (and count an n-gram round's)."""
        if self._planner.last.source in ("ngram", "guess"):
            self.counters.ngram_accepted += kept
        self._planner.settle(kept, rejected, self._draft_probs)

    # ----- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Let the cache go: sequence 0's contents stay until another user clears them; another
        sequence's rows are freed for the other sequences."""
        if not self._closed:
            self._closed = True
            if self._batcher is not None:
                self._batcher.leave(self, every_loop=True)
            if not self._own_cache:
                self._model.give_cache(None, only_from=self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def evaluate_steps(engine, requests) -> None:
    """The step batcher's evaluation (river_gguf.batching), under the Model's lock: the decode steps
    of sessions on different sequences, under one exit setting. One step runs as a session's own
    decode step would; several run in one batch (Engine.eval with seq_ids), and each session
    records its token and its row. A session displaced from its sequence since its last step
    evaluates its tokens again first (here: a batch holds one step per sequence, so no other step
    of it displaces it again before its own runs); the steps beyond the cache's free rows, and a
    step whose row is not finite, raise in their own sessions."""
    live = []
    for r in requests:
        try:
            r.session._resume()
        except Exception as e:  # closed, or its tokens no longer evaluate: that session's error
            r.error = e
        else:
            live.append(r)
    free = engine.n_ctx - engine.cache_used
    if len(live) > 1 and len(live) > free:
        for r in live[max(free, 1):]:
            r.error = native.ContextOverflowError(
                f"no room for a decode step of sequence {r.session.seq}: the cache's n_ctx={engine.n_ctx} rows "
                f"hold {engine.cache_used} positions of {len(engine.sequences)} sequences")
        live = live[:max(free, 1)]
    if len(live) == 1:
        r = live[0]
        s = r.session
        try:
            out = s.extend([r.token], decode=True, all_logits=s.keep_rows)
            r.rows = out.reshape(-1, out.shape[-1])
        except Exception as e:  # the session's own step: its error is its session's
            r.error = e
    elif live:
        _evaluate_together(engine, live)


def _evaluate_together(engine, live) -> None:
    """Several sessions' decode steps in one batch, one token per sequence (evaluate_steps)."""
    opts = live[0].options
    t0 = time.perf_counter()
    try:
        logits, exit_layer, _ = engine.eval([r.token for r in live], seq_ids=[r.session.seq for r in live],
                                            all_logits=True, **opts.engine_args(False))
    except Exception:
        for r in live:  # whatever the failed batch wrote is no session's
            engine.truncate(len(r.session._tokens), seq=r.session.seq)
        raise
    seconds = time.perf_counter() - t0
    for i, r in enumerate(live):
        s, row = r.session, logits[i:i + 1]
        if not np.isfinite(row).all():
            engine.truncate(len(s._tokens), seq=s.seq)
            r.error = NumericalError(
                f"the model produced NaN or infinite logits (sequence {s.seq} after {len(s._tokens)} positions, "
                f"mode={opts.mode!r}); its weights or hyperparameters are broken, so no text or score is returned")
            continue
        s.counters.decode_steps += 1
        s.counters.decode_s += seconds
        s._record([r.token], row, s.keep_rows, int(exit_layer), None, True)
        r.rows = row
