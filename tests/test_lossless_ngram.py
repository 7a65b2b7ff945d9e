"""Lossless rounds with n-gram drafts beside the river's and a draft length that follows
acceptance (river_gguf.drafters): the text stays the exact reference's (the backbone decoding in
the verify batch's kernels, `verify_kernels=True`), greedy and sampled; the n-gram drafter's
index follows appends and truncations as a fresh one would; the planner's choices, fed acceptance
and costs, are the ones the cost model says pay."""
import random

import pytest

from river_gguf.drafters import DraftPlanner, NgramDrafter, Plan, ProbabilityBins, RoundCosts, tokens_per_round
from river_gguf.llama import Llama
from river_gguf.options import ExitOptions, RiverOptions

from support import THREADS, generated_tokens

N_TOKENS = 24
SAMPLED = dict(temp=0.8, top_k=40, top_p=0.9, repeat_penalty=1.1)
#: A prompt whose continuation repeats it: the n-gram drafter has long matches to propose.
REPEATING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"


# --- the n-gram drafter ---------------------------------------------------------------------------

def _drafter(tokens, **kw):
    d = NgramDrafter(**kw)
    d.extend(tokens)
    return d


def test_ngram_proposes_the_continuation_of_a_repeat():
    d = _drafter([5, 1, 2, 3, 4, 9, 1, 2])
    assert d.propose(3) == ([3, 4, 9], 2)
    assert d.propose(0) == ([], 0)


def test_ngram_prefers_the_occurrence_that_matches_furthest_back():
    # (1, 2) occurs twice before the end; the later one also matches the 6 before it.
    d = _drafter([7, 1, 2, 3, 8, 6, 1, 2, 4, 8, 6, 1, 2])
    assert d.propose(2) == ([4, 8], 4)
    # Among equal matches, the latest occurrence.
    d = _drafter([0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2])
    assert d.propose(1) == ([4], 3)


def test_ngram_repeats_a_pattern_past_the_context_end():
    d = _drafter([1, 2, 3, 1, 2, 3, 1, 2])
    assert d.propose(5) == ([3, 1, 2, 3, 1], 5)


def test_ngram_proposes_nothing_on_fresh_text():
    d = _drafter(list(range(50)))
    assert d.propose(8) == ([], 0)
    assert _drafter([3]).propose(4) == ([], 0)


def test_ngram_index_follows_truncation_as_a_fresh_one():
    rng = random.Random(0)
    d, tokens = NgramDrafter(key=2), []
    for _ in range(300):
        if tokens and rng.random() < 0.35:  # a round's rejected drafts leave
            n = rng.randrange(len(tokens) + 1)
            d.truncate(n)
            del tokens[n:]
        else:
            new = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
            d.extend(new)
            tokens.extend(new)
        fresh = _drafter(tokens, key=2)
        assert d.tokens == tokens and d.index() == fresh.index()
        assert d.propose(4) == fresh.propose(4)
        assert d.guess() == fresh.guess()


def test_ngram_guess_is_what_followed_the_last_token_before():
    assert _drafter([4, 7, 5, 9, 4, 8, 4]).guess() == 8  # the latest earlier occurrence of 4
    assert _drafter([1, 2, 3]).guess() is None           # 3 never occurred before
    assert NgramDrafter().guess() is None


def test_ngram_drafter_refuses_bad_settings():
    with pytest.raises(ValueError):
        NgramDrafter(key=0)
    with pytest.raises(ValueError):
        NgramDrafter(key=4, max_match=3)


# --- the planner: acceptance and costs in, a round's drafts out -------------------------------

def _costs(step_share, verify):
    """RoundCosts with these verify seconds by batch size and a draft step of step_share of a
    one-token verify (each observed twice: a size's first round is not counted)."""
    c = RoundCosts(smoothing=1.0)
    for n, s in verify.items():
        c.observe_verify(n, s)
        c.observe_verify(n, s)
    c.observe_draft(1, step_share * verify[1])
    c.observe_draft(1, step_share * verify[1])
    return c


#: Memory-bound verify costs: one more token adds 5% of a one-token verify.
CHEAP_VERIFY = {n: 1.0 + 0.05 * (n - 1) for n in range(1, 18)}


def _planner(acceptance, costs, **kw):
    p = DraftPlanner(river_max=kw.pop("river_max", 8), **kw)
    p.costs = costs
    p.river.prior, p.river.accepted, p.river.rejected = acceptance, 0.0, 0.0
    return p


def _best_k(acceptance, costs, k_max):
    # A round verifies at least two tokens (its token beside a throwaway copy when it has no drafts).
    rates = {k: tokens_per_round(acceptance, k) / (k * costs.draft_cost() + costs.verify_cost(max(k + 1, 2)))
             for k in range(0, k_max + 1)}
    return max(rates, key=rates.get)


@pytest.mark.parametrize("acceptance", [0.3, 0.6, 0.8, 0.95])
def test_river_k_is_the_cost_models_best(acceptance):
    costs = _costs(0.3, CHEAP_VERIFY)
    plan = _planner(acceptance, costs, ngram=False).plan(room=100)
    want = _best_k(acceptance, costs, 8)
    assert (plan.source, plan.k) == (("river", want) if want else ("none", 0))


def test_a_round_that_does_not_pay_drafts_nothing():
    # Compute-bound verify (each more token costs 40%) and a draft step at half a verify.
    costs = _costs(0.5, {n: 1.0 + 0.4 * (n - 1) for n in range(1, 10)})
    # A round without drafts costs a batch of two as well: 30% acceptance does not pay, 50% would.
    assert _planner(0.3, costs, ngram=False).plan(room=100).source == "none"
    assert _planner(0.5, costs, ngram=False).plan(room=100).source == "river"
    assert _planner(0.99, costs, ngram=False).plan(room=100).source == "river"
    # Without adaptation the river always drafts draft_max (room permitting).
    fixed = _planner(0.5, costs, ngram=False, adaptive=False, river_max=4)
    assert fixed.plan(room=100) == Plan("river", k=4, p_min=0.0, rate=fixed.plan(room=100).rate)
    assert fixed.plan(room=2).k == 2 and fixed.plan(room=0).source == "none"


def _recorded(planner, seconds_by_batch, draft_step_s):
    """Feed the planner rounds as Session._round does: a river round of k drafts with its draft
    time, each verify batch timed (a round with no drafts is a batch of two)."""
    for n, s in seconds_by_batch.items():
        for _ in range(2):  # a size's first round builds its graph and is not counted
            k = n - 1
            planner.observe(Plan("river", k=k), k, k * draft_step_s, s)


def test_low_acceptance_stops_the_river_and_high_acceptance_drafts():
    """With the costs the session recorded (a draft step 0.36 of a plain step, a verify of n
    tokens 1 + 0.33 (n - 1) steps: compute-bound, as at 0.5B on 2 cores), river drafts accepted
    rarely lose to a round without them, and accepted often win."""
    seconds = {n: 0.1 * (1.0 + 0.33 * (n - 1)) for n in range(2, 10)}
    # The round's second place is evaluated anyway, so one river draft pays from acceptance above
    # draft step / verify of two (0.27 here): below, none does; well above, several do.
    for acceptance, drafts in ((0.1, False), (0.25, False), (0.9, True), (0.97, True)):
        p = DraftPlanner(river_max=8, ngram=False)
        _recorded(p, seconds, 0.036)
        p.river.prior, p.river.accepted, p.river.rejected = acceptance, 0.0, 0.0
        plan = p.plan(room=100)
        assert (plan.source == "river" and plan.k > 1) == drafts, (acceptance, plan)
        assert (plan.source == "river") == drafts, (acceptance, plan)
        if not drafts:
            assert plan == Plan("none", rate=pytest.approx(1 / seconds[2]))
    # A round with no drafts is costed as what it evaluates: two tokens, never a lone one.
    assert 1 not in p.costs.verify


def test_below_the_sizes_timed_a_verify_costs_its_share_at_least():
    # Timed at 5 and 9 tokens only, a steep slope extrapolated down would price a lone token at 0.
    c = _costs(0.3, {1: 1.0, 5: 1.0, 9: 4.0})
    del c.verify[1]
    assert c.verify_cost(1) == pytest.approx(1.0 / 5)
    assert c.verify_cost(4) == pytest.approx(1.0 * 4 / 5)
    assert c.verify_cost(7) == pytest.approx(2.5)
    assert c.verify_cost(11) == pytest.approx(5.5)
    assert DraftPlanner(river_max=4, min_verify=1).rate(0.0, 0, 0.0) > 0


def test_in_the_decode_kernels_a_round_without_drafts_is_a_lone_token():
    """Where verify rows take the decode steps' kernels (min_verify 1), a round that drafts
    nothing evaluates its token alone, is timed as such, and a guess is a draft that must pay."""
    costs = _costs(0.5, {n: 1.0 + 0.4 * (n - 1) for n in range(1, 10)})
    p = _planner(0.3, costs, ngram=False, min_verify=1)
    plan = p.plan(room=100)
    assert plan == Plan("none", rate=pytest.approx(1 / costs.verify_cost(1)))
    p = _planner(0.2, costs, min_verify=1)
    p.ngram.extend([4, 7, 5, 9, 4, 8, 3, 4])  # a guess (8) exists but does not pay at its prior
    assert p.plan(room=100).source == "none"
    assert p.guess_instead() == []
    p.guesses.prior = 0.9  # a guess taken 90% of the time: 1.9 tokens for 1.4 pays
    assert p.plan(room=100).source == "guess"
    q = DraftPlanner(river_max=4, ngram=False, min_verify=1)
    for _ in range(2):
        q.observe(Plan("none"), 0, 0.0, 0.05)
    assert q.costs.verify == {1: 0.05}


def test_a_round_without_drafts_verifies_a_free_guess():
    p = _planner(0.2, _costs(0.5, {n: 1.0 + 0.4 * (n - 1) for n in range(1, 10)}))
    p.ngram.extend([4, 7, 5, 9, 4, 8, 3, 4])  # no earlier (3, 4): no n-gram draft; 4 was followed by 8
    plan = p.plan(room=100)
    assert plan.source == "guess" and plan.tokens == (8,) and plan.k == 1
    # Its outcome teaches the guesses' acceptance, no drafter's.
    before = (p.river.accepted, p.river.rejected, [(a.accepted, a.rejected) for a in p.by_match])
    p.settle(0, True)
    assert before == (p.river.accepted, p.river.rejected, [(a.accepted, a.rejected) for a in p.by_match])
    assert p.guesses.rejected == 1
    assert p.plan(room=0).source == "none"
    # River drafts that stopped before the first leave the same free place: the guess takes it.
    p.river.prior = 0.99
    assert p.plan(room=100).source == "river"
    assert p.guess_instead() == [8] and p.last.source == "guess"
    p.settle(1, False)
    assert p.river.accepted == 0 and p.guesses.accepted == 1


def test_a_guess_accepted_often_wins_over_river_drafts_that_barely_pay():
    costs = _costs(0.5, {n: 1.0 + 0.4 * (n - 1) for n in range(1, 10)})
    p = _planner(0.6, costs)  # one river draft: 1.6 tokens for 0.5 + 1.4: 0.84 a unit of cost
    p.ngram.extend([4, 7, 5, 9, 4, 8, 3, 4])
    assert p.plan(room=100).source == "river"
    p.guesses.prior = 0.4  # a guess: 1.4 tokens for 1.4: 1.0 a unit of cost
    assert p.plan(room=100).source == "guess"
    # Without adaptation the river drafts draft_max whatever a guess would bring.
    fixed = _planner(0.6, costs, adaptive=False, river_max=4)
    fixed.ngram.extend([4, 7, 5, 9, 4, 8, 3, 4])
    fixed.guesses.prior = 0.9
    assert fixed.plan(room=100).source == "river"


def _bins(acceptance_by_bin):
    """ProbabilityBins whose bin i has (about) acceptance_by_bin[i] on much evidence."""
    bins = ProbabilityBins()
    for b, a in zip(bins.bins, acceptance_by_bin):
        b.accepted, b.rejected = 1000 * a, 1000 * (1 - a)
    return bins


def test_early_stop_where_the_drafts_probability_stops_paying():
    # Drafts below p 0.3 are accepted 20% of the time, below 0.6 60%, above 95%.
    by_bin = [0.2] * 3 + [0.6] * 3 + [0.95] * 4
    cheap = _planner(0.8, _costs(0.1, CHEAP_VERIFY), ngram=False)
    dear = _planner(0.8, _costs(0.6, CHEAP_VERIFY), ngram=False)
    cheap.by_probability = dear.by_probability = _bins(by_bin)
    # Cheap drafts pay at 30% acceptance: stop below 0.3; dear ones need ~70%: stop below 0.6.
    assert cheap.plan(room=100).p_min == pytest.approx(0.3)
    assert dear.plan(room=100).p_min == pytest.approx(0.6)
    # The user's draft_p_min is a floor.
    floor = _planner(0.8, _costs(0.1, CHEAP_VERIFY), ngram=False, p_min=0.95)
    assert floor.plan(room=100).p_min == 0.95
    # Before evidence no bin is below the prior: no stop, however flat the river's rows are.
    assert ProbabilityBins().p_min(0.7) == 0.0


def test_probability_bins_count_only_compared_drafts():
    bins = ProbabilityBins()
    bins.observe([0.95, 0.55, 0.15, 0.05], accepted=1, rejected=True)
    assert (bins.bin(0.95).accepted, bins.bin(0.95).rejected) == (1, 0)
    assert (bins.bin(0.55).accepted, bins.bin(0.55).rejected) == (0, 1)
    assert all(b.accepted == b.rejected == 0 for b in (bins.bin(0.15), bins.bin(0.05)))
    # A walk the caller ended after the first draft says nothing about the second.
    bins.observe([0.35, 0.25], accepted=1, rejected=False)
    assert bins.bin(0.35).accepted == 1 and bins.bin(0.25).rejected == 0


def test_ngram_draft_chosen_where_it_pays():
    costs = _costs(0.4, CHEAP_VERIFY)
    p = _planner(0.8, costs)
    p.ngram.extend(list(range(10)) + list(range(9)))  # a 9-token match: proposes 9, 0, 1, ...
    plan = p.plan(room=100)
    assert plan.source == "ngram" and plan.tokens[:3] == (9, 0, 1) and plan.match == 9 and plan.k > 4
    # Rejected every time: the n-gram's long matches lose to the river.
    for _ in range(40):
        p.plan(room=100)
        p.last = Plan("ngram", k=4, tokens=(9, 0, 1, 2), match=9)
        p.settle(0, True)
    assert p.ngram_acceptance(9).value < 0.15 and p.plan(room=100).source == "river"
    # Evidence ages: rounds that settle without it bring the prior back.
    for _ in range(200):
        p.plan(room=100)
        p.settle(0, False)
    assert p.plan(room=100).source == "ngram"


def test_no_drafts_at_all_with_draft_max_0():
    p = _planner(0.9, _costs(0.1, CHEAP_VERIFY), river_max=0)
    assert p.ngram is None and p.plan(room=100).source == "none"


def test_options_refuse_non_bools():
    for name in ("ngram_draft", "adaptive_draft"):
        with pytest.raises(ValueError, match=name):
            ExitOptions(mode="lossless", **{name: 1}).validate(4, True)
    assert RiverOptions.of(ngram_draft=False).exit_overrides() == {"ngram_draft": False}


# --- exactness with n-gram drafts -------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol(river_gguf_path):
    return Llama(river_gguf_path, n_ctx=256, n_threads=THREADS, flash_attn=True, verbose=False)


@pytest.fixture(scope="module")
def exact(river_gguf_path):
    return Llama(river_gguf_path, n_ctx=256, n_threads=THREADS, flash_attn=True, verbose=False,
                 verify_kernels=True)


def _tokens(llm, prompt, **kw):
    return generated_tokens(llm, prompt, N_TOKENS, **kw)[1]


@pytest.fixture(scope="module")
def exact_greedy(exact):
    return _tokens(exact, REPEATING, temp=0.0, mode="backbone")


def _fresh(path):
    """A Llama whose planner has seen nothing: what an adaptive planner drafts depends on the
    rounds before (and on the clock), so the counts are asserted on a fresh one that drafts
    without the clock (adaptive_draft=False)."""
    return Llama(path, n_ctx=256, n_threads=THREADS, flash_attn=True, verbose=False)


@pytest.mark.parametrize("options", [dict(), dict(adaptive_draft=False), dict(ngram_draft=False, adaptive_draft=False)])
def test_greedy_with_ngram_drafts_is_the_exact_backbone(smol, river_gguf_path, exact_greedy, options):
    # The default (adaptive) planner: exact whatever it chose, after whatever the session saw.
    llm = smol if options.get("adaptive_draft", True) else _fresh(river_gguf_path)
    got = _tokens(llm, REPEATING, temp=0.0, mode="lossless", **options)
    stats = dict(llm.last_stats)
    assert got == exact_greedy
    if options.get("adaptive_draft", True):
        return
    if options.get("ngram_draft", True):
        assert stats["ngram_drafted"] > 0 and stats["ngram_accepted"] > 0, stats
    else:
        assert stats["ngram_drafted"] == 0 and stats["drafted"] > 0, stats


def test_sampled_with_ngram_drafts_is_the_exact_backbone(river_gguf_path, exact):
    llm = _fresh(river_gguf_path)
    llm.set_seed(7)
    got = _tokens(llm, REPEATING, mode="lossless", adaptive_draft=False, **SAMPLED)
    stats = dict(llm.last_stats)
    exact.set_seed(7)
    assert got == _tokens(exact, REPEATING, mode="backbone", **SAMPLED)
    assert stats["ngram_drafted"] > 0, stats
