"""Similarity profile: cos(h_in, h_out) per backbone layer on a small built-in text.

Until a threshold is calibrated against a quality budget, a River GGUF's default tau is a fixed
quantile of the mid-layer similarities. Layer 0 and the last layer are excluded: they rewrite
the residual stream (s ~ 0.02 and ~ 0.7 on SmolLM2) and say nothing about where tokens settle.
At the 0.70 quantile, SmolLM2 (F16) gets tau ~ 0.97 and tokens leave after ~6 backbone layers.
"""
from importlib import resources
from typing import Optional

import numpy as np

DEFAULT_QUANTILE = 0.70


def profile_text() -> str:
    return resources.files("river_gguf").joinpath("data/profile.txt").read_text(encoding="utf-8")


def similarity_profile(model, text: Optional[str] = None, max_tokens: int = 256) -> np.ndarray:
    """[steps, n_layer] similarities of backbone-only decode over `text`.

    It runs in a short-lived engine of its own (Model.backbone_trace), sized to the profile: a
    Model with a small n_ctx can still be profiled, and the Model's own KV cache is untouched."""
    toks = model.tokenize(text or profile_text())[:max_tokens]
    return np.array(model.backbone_trace(toks))


def default_threshold(model, quantile: float = DEFAULT_QUANTILE) -> dict:
    """tau from the profile, with the numbers behind it (written into River GGUF metadata)."""
    sims = similarity_profile(model)
    mid = sims[:, 1:-1] if sims.shape[1] > 3 else sims
    tau = float(np.quantile(mid, quantile))
    # Where tokens would leave with this tau (first layer whose similarity passes).
    passed = sims[:, :-1] > tau
    exits = np.where(passed.any(1), passed.argmax(1), sims.shape[1] - 1)
    return {
        "threshold": round(tau, 4),
        "quantile": quantile,
        "profile_tokens": int(sims.shape[0]),
        "predicted_mean_exit_layer": float(exits.mean()),
        "median_similarity_per_layer": [float(x) for x in np.median(sims, 0)],
    }
