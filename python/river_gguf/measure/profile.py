"""Exit-rule profile: an exit rule's score per backbone layer (cosine, the default rule:
cos(h_in, h_out)) on a small built-in text.

Until a threshold is calibrated against a quality budget, a River GGUF's default tau is a fixed
quantile of its rule's mid-layer scores. Layer 0 and the last layer are excluded: they rewrite
the residual stream (cosine s ~ 0.02 and ~ 0.7 on SmolLM2) and say nothing about where tokens
settle. At the 0.70 quantile, SmolLM2 (F16) gets cosine tau ~ 0.97 and tokens leave after ~6
backbone layers. Where a rule has no hand-placed tau grid, its grids are quantiles of its profile
too (rule_taus).
"""
from importlib import resources
from typing import Optional, Sequence, Tuple

import numpy as np

from .traces import backbone_trace, similarity_rows
from ..options import EXIT_RULES

DEFAULT_QUANTILE = 0.70


def profile_text() -> str:
    return resources.files("river_gguf").joinpath("data/profile.txt").read_text(encoding="utf-8")


def similarity_profile(model, text: Optional[str] = None, max_tokens: int = 256, own_engine: bool = True,
                       exit_rule: Optional[str] = None) -> np.ndarray:
    """[steps, n_layer] scores of `exit_rule` (default: the default rule) in backbone-only decode
    over `text`.

    It runs in a short-lived engine of its own (measure.traces.backbone_trace), sized to the profile: a
    Model with a small n_ctx can still be profiled, and the Model's own KV cache is untouched.
    own_engine=False runs it in the Model's engine instead (its cache is cleared; it must hold
    max_tokens), in one batched pass (measure.traces.similarity_rows): a caller that owns the Model saves a
    second load of the weights and the decode steps."""
    rule = EXIT_RULES[0] if exit_rule is None else exit_rule
    toks = model.tokenize(text or profile_text())[:max_tokens]
    if not own_engine:
        return similarity_rows(model, toks, exit_rule=rule)[1:]  # decode's trace has no step for the first token
    return np.array(backbone_trace(model, toks, exit_rule=rule))


def _mid(sims: np.ndarray) -> np.ndarray:
    return sims[:, 1:-1] if sims.shape[1] > 3 else sims


def default_threshold(model, quantile: float = DEFAULT_QUANTILE, own_engine: bool = True, sims=None,
                      exit_rule: Optional[str] = None) -> dict:
    """tau of `exit_rule` (default: the default rule) from its profile, with the numbers behind it
    (written into River GGUF metadata). sims: that rule's profile already taken
    (similarity_profile), instead of taking one."""
    rule = EXIT_RULES[0] if exit_rule is None else exit_rule
    sims = similarity_profile(model, own_engine=own_engine, exit_rule=rule) if sims is None else np.asarray(sims)
    tau = float(np.quantile(_mid(sims), quantile))
    return {
        "threshold": round(tau, 4),
        "exit_rule": rule,
        "quantile": quantile,
        "profile_tokens": int(sims.shape[0]),
        "predicted_mean_exit_layer": predicted_mean_exit(sims, tau),
        "median_similarity_per_layer": [float(x) for x in np.median(sims, 0)],
    }


def rule_taus(sims, quantiles: Sequence[float]) -> Tuple[float, ...]:
    """Thresholds of a rule at these quantiles of its profile's mid-layer scores (sims, from
    similarity_profile), ascending and distinct: a tau grid for a rule with no hand-placed one."""
    taus = sorted({round(float(np.quantile(_mid(np.asarray(sims)), q)), 4) for q in quantiles})
    return tuple(taus)


def predicted_mean_exit(sims: np.ndarray, threshold: float, min_exit_layer: int = 0, tail: int = 0) -> float:
    """Where tokens of the profile would leave with this setting, on average: the first layer at
    or after min_exit_layer whose similarity passes the threshold, before the river's last layer
    (n_layer - 1 - tail); the last layer for a token that never passes. A prediction from
    backbone decode: once tokens exit, later tokens read the river's KV, so a run differs."""
    sims = np.asarray(sims)
    n_layer = sims.shape[1]
    last = n_layer - 1 - tail  # the river needs at least one layer: exits up to last - 1
    passed = sims[:, :-1] > threshold
    passed[:, :min(min_exit_layer, n_layer - 1)] = False
    passed[:, max(last, 0):] = False
    exits = np.where(passed.any(1), passed.argmax(1), n_layer - 1)
    return float(exits.mean())
