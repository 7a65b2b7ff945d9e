"""When lossless mode pays: its speed against the backbone alone, predicted from the costs of a
backbone step, a draft step and a verify batch, and the rate at which drafts are accepted.

A lossless round drafts k tokens with the river (k draft steps: the token before them and the
first k-1 drafts) and verifies the token and the k drafts in one backbone batch of k+1. With each
draft accepted with probability a, independently, the round gives 1 + a + ... + a^k tokens (the
accepted drafts and the backbone's token after them), so

    speedup(k) = (1 - a^(k+1)) / (1 - a) * step / (k * draft + verify(k+1))

against the backbone alone, which spends `step` per token. A batch of k+1 costs far less than k+1
steps only where a step is bound by weight bytes (F16 backbones, large models, GPUs); where it is
not, no k pays and best_draft_max says so. The acceptance comes from calibration: the river-only
setting's same-top-token rate against the backbone, teacher-forced (the grid's `same_top`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

# The rounds' expected tokens, one model for the cost model and the drafting planner.
from ..drafters import tokens_per_round

#: How many positions the costs are timed after, where the model's n_ctx leaves room: generation
#: runs well past position 30, and a step attends over every position before it.
CONTEXT = 256
#: The text the costs are timed after, repeated to CONTEXT positions (the cost of a step depends
#: little on the text).
PROMPT = ("The river rose in the hills above the town and ran through three valleys before it reached "
          "the sea. In spring, when the snow melted,")


@dataclass
class Costs:
    """Seconds of one backbone decode step, one draft step, and a verify batch of n tokens, timed
    after `context` positions."""
    step: float
    draft: float
    verify: Dict[int, float] = field(default_factory=dict)
    context: int = 0

    def as_dict(self) -> dict:
        return {"step": self.step, "draft": self.draft, "verify": {str(n): s for n, s in self.verify.items()},
                "context": self.context}


def acceptance_of(mean_accepted: float, k: int) -> float:
    """The acceptance at which rounds of k drafts accept `mean_accepted` drafts on average in
    tokens_per_round's model: a run's measured rounds in the cost model's terms. (Accepted over
    drafted is lower: a round stops at its first rejection, and text has runs of easy tokens.)"""
    if not 0 <= mean_accepted <= k:
        raise ValueError(f"mean_accepted must be in [0, {k}], got {mean_accepted!r}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # tokens_per_round grows with the acceptance
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(mid, k) - 1 < mean_accepted else (lo, mid)
    return (lo + hi) / 2


def predicted_speedup(costs: Costs, acceptance: float, k: int) -> float:
    """Lossless decoding with k drafts a round, in tokens per second, over the backbone alone."""
    if k == 0:
        return 1.0
    return tokens_per_round(acceptance, k) * costs.step / (k * costs.draft + costs.verify[k + 1])


def best_draft_max(costs: Costs, acceptance: float) -> dict:
    """The draft_max with the highest predicted speedup among the verify sizes timed, and whether
    it beats the backbone alone: {"draft_max", "speedup", "pays", "per_k": {k: speedup}}."""
    per_k = {n - 1: predicted_speedup(costs, acceptance, n - 1) for n in sorted(costs.verify) if n >= 2}
    if not per_k:
        raise ValueError("no verify batch of 2 or more tokens was timed")
    k = max(per_k, key=per_k.get)
    return {"draft_max": k, "speedup": per_k[k], "pays": per_k[k] > 1.0, "per_k": per_k,
            "acceptance": acceptance}


def describe(choice: dict, costs: Costs) -> str:
    """One line saying whether lossless pays here, with the numbers behind it."""
    k = choice["draft_max"]
    head = (f"lossless: draft_max={k} predicts {choice['speedup']:.2f}x the backbone alone"
            if choice["pays"] else
            f"lossless does not pay here: the best, draft_max={k}, predicts {choice['speedup']:.2f}x the backbone")
    return (f"{head} (backbone step {1e3 * costs.step:.1f} ms, draft step {1e3 * costs.draft:.1f} ms, "
            f"verify of {k + 1} {1e3 * costs.verify[k + 1]:.1f} ms = {costs.verify[k + 1] / costs.step:.2f} steps, "
            f"acceptance {100 * choice['acceptance']:.0f}%)")


def river_only_acceptance(grid_rows: Sequence[dict]) -> Optional[float]:
    """The calibration acceptance of river-only drafts: the plain river-only setting's same-top
    rate against the backbone, as a fraction (None when the grid has no such row)."""
    for r in grid_rows:  # each {"options": a presets.Setting, numbers...}
        if r["options"].plain_river_only and r.get("same_top") is not None:
            v = float(r["same_top"])
            return v / 100.0 if v > 1.0 else v
    return None


def measure_costs(model, options, max_batch: int, rounds: int = 5, steps: int = 16,
                  context: int = CONTEXT) -> Costs:
    """Time, on a session of `model`, a backbone decode step, a draft step (options' draft setting,
    through the engine's draft itself: its draft vocabulary's head) and verify batches of
    2..max_batch tokens, each the median of `rounds` interleaved rounds of `steps` runs after the
    same prompt of `context` positions (fewer where n_ctx leaves less room, never fewer than
    PROMPT's tokens). The engine is timed alone (no sampling)."""
    text = model.tokenize(PROMPT)
    room = model.n_ctx - steps - max_batch - 1
    if len(text) > room:
        raise ValueError(f"n_ctx={model.n_ctx} is too small to time {steps} steps after the prompt")
    n_prompt = max(len(text), min(int(context), room))
    prompt = (text * (n_prompt // len(text) + 1))[:n_prompt]
    # One draft of `steps` tokens, timed whole: drafts stop early only at a NaN row (p_min 0).
    timing = options.with_overrides(draft_max=steps, draft_p_min=0.0)
    times: Dict[str, List[float]] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)

    with model.session(timing) as session:
        session.prefill(prompt)
        base = session.n_past
        for _ in range(rounds):
            session.truncate(base)
            for i in range(steps):
                timed("step", lambda: session.extend([prompt[i % len(prompt)]], decode=True))
            session.truncate(base)
            t0 = time.perf_counter()
            drafted = len(session.draft(prompt[0]))
            times.setdefault("draft", []).append((time.perf_counter() - t0) / max(drafted, 1))
            for n in range(2, max_batch + 1):
                for i in range(max(steps // n, 2)):
                    session.truncate(base)
                    timed(f"verify{n}", lambda: session.verify(prompt[:n]))
        session.truncate(0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return Costs(step=med["step"], draft=med["draft"], verify={n: med[f"verify{n}"] for n in range(2, max_batch + 1)},
                 context=base)
