"""Where a lossless round's drafts come from, and how many it asks for.

Two drafters, as llama.cpp's speculative types are several behind one interface:
  - the river: the native `Engine.draft`, k river steps after the round's token (Session.draft);
  - an n-gram drafter (`NgramDrafter`) over the prompt and the text so far: where the context's
    last `key` tokens occurred before, the tokens that followed that occurrence are proposed. It
    costs no model step, so on text that repeats its context (edits, quotes, JSON, code that
    reuses its names) it drafts long runs for the price of the verify batch alone; on fresh text
    it has nothing to propose, or proposes what is rarely accepted.

`DraftPlanner` chooses, before each round, which drafter drafts and how many tokens, by the
expected tokens per second of the round: the drafter's running acceptance (`Acceptance`: a
geometric model, each draft accepted with probability a once the drafts before it were) against
the measured cost of its drafts and of the verify batch (`RoundCosts`, from the session's own
rounds). A round with no drafts is one of the choices: where no draft pays, the round verifies its
token alone. Which tokens come out never depends on any of this: the backbone's rows choose every
token (`session.accept`), the drafts only decide how many are verified at once.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

#: The n-gram drafter's key: how many trailing tokens of the context must have occurred before.
NGRAM_KEY = 2
#: The most tokens an n-gram draft proposes in one round (its verify batch is one more).
NGRAM_MAX = 16
#: How far back an occurrence's match with the context is measured (longer matches are trusted more).
NGRAM_MAX_MATCH = 32
#: How many of a key's latest occurrences are compared with the context.
NGRAM_OCCURRENCES = 4
#: Match lengths that share one acceptance estimate: [2, 4), [4, 8), [8, ...).
MATCH_BUCKETS = (4, 8)


def tokens_per_round(acceptance: float, k: int) -> float:
    """Expected tokens a round gives with k drafts, each accepted with probability `acceptance`
    once the drafts before it were: the accepted drafts and the backbone's token after them."""
    a = min(max(float(acceptance), 0.0), 1.0)
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class NgramDrafter:
    """An index of the context's `key`-grams: each maps to the positions just after its
    occurrences, in order. Appending a token adds one entry and truncating removes the entries of
    the removed positions, so the index always equals one built afresh over the same tokens, at a
    cost per changed token (no pass over the context per round)."""

    def __init__(self, key: int = NGRAM_KEY, max_match: int = NGRAM_MAX_MATCH,
                 occurrences: int = NGRAM_OCCURRENCES):
        if key < 1 or max_match < key or occurrences < 1:
            raise ValueError(f"need key >= 1, max_match >= key and occurrences >= 1, got {key}, {max_match}, "
                             f"{occurrences}")
        self.key = key
        self.max_match = max_match
        self.occurrences = occurrences
        self._tokens: List[int] = []
        self._ends: Dict[Tuple[int, ...], List[int]] = {}
        # token -> the positions after its occurrences: the one-token key of `guess`.
        self._after: Dict[int, List[int]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> List[int]:
        return list(self._tokens)

    def index(self) -> Dict[Tuple[int, ...], List[int]]:
        """The index: key-gram -> the positions after its occurrences (a copy)."""
        return {k: list(v) for k, v in self._ends.items() if v}

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self._tokens.append(int(t))
            end = len(self._tokens)
            self._after.setdefault(int(t), []).append(end)
            if end >= self.key:
                self._ends.setdefault(tuple(self._tokens[end - self.key:end]), []).append(end)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens."""
        n = max(0, int(n))
        for end in range(len(self._tokens), n, -1):
            after = self._after[self._tokens[end - 1]]
            after.pop()
            if not after:
                del self._after[self._tokens[end - 1]]
            if end >= self.key:
                gram = tuple(self._tokens[end - self.key:end])
                ends = self._ends[gram]
                ends.pop()  # the latest occurrence is the one at `end`: positions only grow
                if not ends:
                    del self._ends[gram]
        del self._tokens[n:]

    def guess(self) -> Optional[int]:
        """The token that followed the latest earlier occurrence of the context's last token (None
        where it never occurred before): a one-token draft for a round that would otherwise
        verify its token beside a throwaway copy (DraftPlanner.plan)."""
        if not self._tokens:
            return None
        after = self._after[self._tokens[-1]]
        return self._tokens[after[-2]] if len(after) >= 2 else None

    def propose(self, limit: int) -> Tuple[List[int], int]:
        """(drafts, match): what followed the earlier occurrence of the context's last `key`
        tokens that matches the context furthest back (the latest among equals), up to `limit`
        tokens, and how many tokens that occurrence matches (0 and no drafts when the key never
        occurred before). A continuation that runs into the context's end goes on with the tokens
        it proposed: a repeating pattern repeats."""
        n = len(self._tokens)
        if limit <= 0 or n < self.key:
            return [], 0
        ends = self._ends.get(tuple(self._tokens[n - self.key:]), ())
        best, best_match = -1, 0
        # The last entry is the context's own end; the ones before it are earlier occurrences.
        for end in reversed(ends[max(0, len(ends) - 1 - self.occurrences):]):
            if end >= n:
                continue
            match, tokens = self.key, self._tokens
            while match < self.max_match and end - match > 0 and tokens[end - match - 1] == tokens[n - match - 1]:
                match += 1
            if match > best_match:
                best, best_match = end, match
        if best < 0:
            return [], 0
        out: List[int] = []
        for i in range(limit):
            at = best + i
            out.append(self._tokens[at] if at < n else out[at - n])
        return out, best_match


@dataclass
class Acceptance:
    """A drafter's running acceptance: each draft is accepted with probability a once the drafts
    before it were. The estimate is accepted / (accepted + rejections) over recent rounds (older
    rounds weigh `decay` less each round) with `prior` counted as `weight` rounds' evidence, so a
    drafter that stopped being chosen drifts back to its prior and is tried again."""
    prior: float
    weight: float = 3.0
    decay: float = 0.95
    accepted: float = 0.0
    rejected: float = 0.0

    @property
    def value(self) -> float:
        return (self.accepted + self.prior * self.weight) / (self.accepted + self.rejected + self.weight)

    def fade(self) -> None:
        self.accepted *= self.decay
        self.rejected *= self.decay

    def observe(self, accepted: int, rejected: bool) -> None:
        self.accepted += accepted
        self.rejected += bool(rejected)


#: Costs in units of a verify of one token, until the session has timed its own rounds: a river
#: draft step at 0.4 of it and each more token of a verify batch at 0.15 (memory-bound decoding;
#: compute-bound machines grow faster, which the timed rounds then show).
PRIOR_DRAFT_STEP = 0.4
PRIOR_VERIFY_SLOPE = 0.15


@dataclass
class RoundCosts:
    """Seconds of a river draft step and of verify batches by size, from the session's rounds (a
    moving average each; a batch size's first round builds its graph, so it is not counted)."""
    smoothing: float = 0.25
    draft_step: Optional[float] = None
    verify: Dict[int, float] = field(default_factory=dict)
    _seen: set = field(default_factory=set)
    _draft_seen: bool = False

    def observe_draft(self, steps: int, seconds: float) -> None:
        if steps <= 0:
            return
        if not self._draft_seen:
            self._draft_seen = True
            return
        self.draft_step = self._average(self.draft_step, seconds / steps)

    def observe_verify(self, n: int, seconds: float) -> None:
        if n not in self._seen:
            self._seen.add(n)
            return
        self.verify[n] = self._average(self.verify.get(n), seconds)

    def _average(self, old: Optional[float], new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def verify_cost(self, n: int) -> float:
        """A verify batch of n tokens: measured, interpolated between measured sizes, or
        extrapolated along the measured (or prior) slope."""
        if not self.verify:
            return 1.0 + PRIOR_VERIFY_SLOPE * (n - 1)
        sizes = sorted(self.verify)
        if n in self.verify:
            return self.verify[n]
        i = bisect.bisect_left(sizes, n)
        if 0 < i < len(sizes):
            lo, hi = sizes[i - 1], sizes[i]
            return self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (n - lo) / (hi - lo)
        slope = self._slope(sizes)
        edge = sizes[0] if i == 0 else sizes[-1]
        if i == 0:
            # Below the smallest size timed: a batch costs no less per token than a larger one, so
            # never less than that size's cost per token (a steep slope would reach 0).
            return max(self.verify[edge] + slope * (n - edge), self.verify[edge] * n / edge)
        return self.verify[edge] + slope * (n - edge)

    def _slope(self, sizes: List[int]) -> float:
        if len(sizes) >= 2:
            lo, hi = sizes[0], sizes[-1]
            return max((self.verify[hi] - self.verify[lo]) / (hi - lo), 0.0)
        return PRIOR_VERIFY_SLOPE * self.verify[sizes[0]] / (1.0 + PRIOR_VERIFY_SLOPE * (sizes[0] - 1))

    def draft_cost(self) -> float:
        """A river draft step (the prior share of a one-token verify until one was timed)."""
        return self.draft_step if self.draft_step is not None else PRIOR_DRAFT_STEP * self.verify_cost(1)


@dataclass(frozen=True)
class Plan:
    """What a round drafts: `source` "river" (k river drafts, stopping early below p_min), "ngram"
    (these tokens), "guess" (one token from NgramDrafter.guess, in the place of the throwaway
    copy a round with no drafts verifies anyway: it costs no more than none), or "none" (the
    token alone); `rate`: the expected tokens per second."""
    source: str
    k: int = 0
    tokens: Tuple[int, ...] = ()
    p_min: float = 0.0
    match: int = 0
    rate: float = 0.0


#: A one-token guess's acceptance before evidence (NgramDrafter.guess: what followed the last token).
GUESS_PRIOR = 0.15

#: The adaptive early stop never asks a draft for more probability than this.
MAX_P_MIN = 0.9
#: River drafts' acceptance is kept per probability bin of this width: a draft's probability under
#: the river says how likely the backbone is to take it only as far as the text so far shows (a
#: random-weight river's flat rows still agree with its backbone's argmax).
P_BIN = 0.1
#: A bin's acceptance before evidence: high, so the early stop waits for rejections to show.
BIN_PRIOR = 0.8


class ProbabilityBins:
    """River drafts' acceptance by their probability under the river (bins of P_BIN), and the
    early stop that follows from it: below the highest bin whose acceptance does not pay."""

    def __init__(self):
        self.bins = [Acceptance(prior=BIN_PRIOR) for _ in range(round(1 / P_BIN))]

    def bin(self, p: float) -> Acceptance:
        return self.bins[min(max(int(p / P_BIN), 0), len(self.bins) - 1)]

    def observe(self, probs: Sequence[float], accepted: int, rejected: bool) -> None:
        """A round's drafts in order: the first `accepted` were kept, the next rejected (when
        `rejected`); any after it were never compared."""
        for j, p in enumerate(probs[:accepted + bool(rejected)]):
            self.bin(p).observe(int(j < accepted), j >= accepted)

    def fade(self) -> None:
        for b in self.bins:
            b.fade()

    def p_min(self, pays: float) -> float:
        """The probability below which a draft's bin (or a higher one) is accepted less often
        than `pays`: drafting stops there."""
        low = [i for i, b in enumerate(self.bins) if b.value < pays]
        return min((max(low) + 1) * P_BIN, MAX_P_MIN) if low else 0.0


class DraftPlanner:
    """The per-round choice between the drafters and of the draft length, from the running
    acceptance of each and the session's measured costs. river_max: the most river drafts a
    round (draft_max); ngram: whether the n-gram drafter is used; adaptive: whether k and the
    early stop follow acceptance and costs (otherwise the river always drafts river_max, stopping
    at p_min alone, as a round did before either existed, and the choice between the drafters
    uses the prior costs, never the clock: the same text then drafts the same way on any machine
    and under any load). min_verify: the fewest tokens a verify evaluates: 1 where a round's
    rows take the decode steps' kernels (a round with no drafts is a decode step), 2 where they
    take the batched ones (a round with no drafts verifies its token beside a throwaway copy,
    Session._eval_batched, whose place a one-token guess may take for nothing)."""

    def __init__(self, river_max: int, ngram: bool = True, adaptive: bool = True, p_min: float = 0.0,
                 ngram_max: int = NGRAM_MAX, min_verify: int = 2):
        self.river_max = int(river_max)
        # draft_max 0 drafts nothing at all; otherwise an n-gram may draft further than the river.
        self.ngram_max = max(int(ngram_max), self.river_max) if ngram and self.river_max else 0
        self.adaptive = bool(adaptive)
        self.p_min = float(p_min)
        self.min_verify = max(1, int(min_verify))
        self.ngram = NgramDrafter() if self.ngram_max else None
        self.costs = RoundCosts()
        self.river = Acceptance(prior=0.7)
        self.by_match = [Acceptance(prior=p) for p in (0.3, 0.6, 0.85)]
        self.guesses = Acceptance(prior=GUESS_PRIOR)
        self.by_probability = ProbabilityBins()
        self.last: Optional[Plan] = None

    def ngram_acceptance(self, match: int) -> Acceptance:
        return self.by_match[bisect.bisect_right(MATCH_BUCKETS, match)]

    def rate(self, acceptance: float, k: int, draft_step: float) -> float:
        """Expected tokens per second of a round of k drafts made at `draft_step` seconds each."""
        return tokens_per_round(acceptance, k) / (k * draft_step + self.verify_cost(k + 1))

    def verify_cost(self, n: int) -> float:
        """A round's verify of n tokens, which evaluates at least min_verify."""
        return self.costs.verify_cost(max(n, self.min_verify))

    def plan(self, room: int) -> Plan:
        """This round's drafts, at most `room` of them. With the n-gram drafter, its context must
        be the session's tokens and the round's token (the caller keeps it so)."""
        room = max(0, int(room))
        best = Plan("none", rate=self.rate(0.0, 0, 0.0))
        if room and self.river_max:
            offer = self._river_plan(min(room, self.river_max))
            if not self.adaptive or offer.rate > best.rate:
                best = offer
        if self.ngram is not None and room:
            drafts, match = self.ngram.propose(min(room, self.ngram_max))
            if drafts:
                a = self.ngram_acceptance(match).value
                k = max(range(1, len(drafts) + 1), key=lambda n: self.rate(a, n, 0.0))
                offer = Plan("ngram", k=k, tokens=tuple(drafts[:k]), match=match, rate=self.rate(a, k, 0.0))
                if offer.rate > best.rate:
                    best = offer
        if self.ngram is not None and room:
            # With a batch of two at least, its second place is evaluated whatever it holds: a
            # guess there costs no more than a round with no drafts, and wins over drafts that
            # cost more than they bring. Otherwise a guess is a one-token draft like any other.
            guess = self.ngram.guess()
            if guess is not None:
                offer = Plan("guess", k=1, tokens=(guess,), rate=self.rate(self.guesses.value, 1, 0.0))
                free = best.source == "none" and self.min_verify >= 2
                if (self.adaptive and offer.rate > best.rate) or free:
                    best = offer
        self.last = best
        return best

    def guess_instead(self) -> List[int]:
        """Where a verify evaluates two tokens at least (min_verify 2), the batch has a second
        place whichever drafter drafts, so a round left without drafts (none planned, or river
        drafts that stopped before the first) verifies a guess there for nothing:
        NgramDrafter.guess, which becomes the round's plan (settled as a guess, teaching the
        guesses' acceptance). [] where there is none, or where the round can verify its token
        alone."""
        guess = self.ngram.guess() if self.ngram is not None and self.min_verify >= 2 else None
        if guess is None:
            return []
        self.last = Plan("guess", k=1, tokens=(guess,), rate=self.rate(self.guesses.value, 1, 0.0))
        return [guess]

    def _river_plan(self, k_max: int) -> Plan:
        a, d = self.river.value, self.costs.draft_cost()
        if not self.adaptive:
            return Plan("river", k=k_max, p_min=self.p_min, rate=self.rate(a, k_max, d))
        k = max(range(1, k_max + 1), key=lambda n: self.rate(a, n, d))
        rate = self.rate(a, k, d)
        # A draft pays when its chance of acceptance buys a token at least at the round's rate:
        # acceptance * 1 token >= rate * (its draft step + its share of the verify batch).
        marginal = d + (self.verify_cost(k + 1) - self.verify_cost(1)) / k
        return Plan("river", k=k, p_min=max(self.p_min, self.by_probability.p_min(rate * marginal)), rate=rate)

    def observe(self, plan: Plan, drafted: int, draft_s: float, verify_s: float) -> None:
        """A round's costs: its river draft time (for `drafted` drafts of plan.k asked: one step
        more when the draft stopped early) and its verify batch of drafted + 1 tokens. Only an
        adaptive planner learns from the clock."""
        if not self.adaptive:
            return
        if plan.source == "river":
            self.costs.observe_draft(drafted + (drafted < plan.k), draft_s)
        self.costs.observe_verify(max(drafted + 1, self.min_verify), verify_s)

    def settle(self, accepted: int, rejected: bool, probs: Optional[Sequence[float]] = None) -> None:
        """The last plan's outcome: `accepted` drafts kept, and whether one was rejected (a walk
        that the caller ended first says nothing about the rest); probs: the river drafts'
        probabilities under the river, when the draft gave them. Every drafter's evidence ages
        one round."""
        plan, self.last = self.last, None
        for acc in (self.river, self.guesses, *self.by_match):
            acc.fade()
        self.by_probability.fade()
        if plan is None or plan.source == "none":
            return
        if plan.source == "river" and probs:
            self.by_probability.observe(probs, accepted, rejected)
        target = {"river": self.river, "guess": self.guesses}.get(plan.source) or self.ngram_acceptance(plan.match)
        target.observe(accepted, rejected)
