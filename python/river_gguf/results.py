"""What scoring returns, and the exit statistics generation and scoring report."""
import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np


def exit_stats(exit_layers: List[int], n_layer: int, tail: int = 0) -> dict:
    """Summary of per-token exit layers; layer n_layer-1 means the token never exited. A token
    that exited after layer e ran river layers e+1 .. n_layer-1-tail (the tail is backbone)."""
    n = len(exit_layers)
    hist: Dict[int, int] = {}
    for e in exit_layers:
        hist[int(e)] = hist.get(int(e), 0) + 1
    river_layers = sum(max(n_layer - 1 - tail - e, 0) for e in exit_layers)
    return {
        "exit_layers": [int(e) for e in exit_layers],
        "exit_histogram": dict(sorted(hist.items())),
        "mean_exit_layer": float(np.mean(exit_layers)) if n else float("nan"),
        "river_layer_share": river_layers / (n * n_layer) if n else 0.0,
    }


def lossless_stats(rounds: int, drafted: int, accepted: int, draft_s: float, verify_s: float) -> dict:
    """Summary of lossless decoding's rounds: each drafts some tokens with the river and verifies
    them in one backbone batch; `accepted` drafts equalled the token sampled at their position."""
    return {
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else float("nan"),
        "mean_accepted": accepted / rounds if rounds else float("nan"),
        "draft_s": draft_s,
        "verify_s": verify_s,
    }


@dataclass
class ScoreResult:
    logprobs: np.ndarray        # log p(actual next token), one per scored token
    exit_layers: np.ndarray     # exit layer of the pass that predicted each token
    logits: Optional[np.ndarray] = None  # with keep_logits: the logits that predicted each token

    @property
    def perplexity(self) -> float:
        return float(np.exp(-np.mean(self.logprobs))) if len(self.logprobs) else float("nan")


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """log p(token) under softmax(logits), in float64 for a stable sum over the vocabulary."""
    x = logits.astype(np.float64)
    m = x.max()
    return float(x[token] - m - np.log(np.exp(x - m).sum()))


def json_safe(x):
    """Plain JSON values: NaN/inf become null, numpy scalars become Python ones, keys become str."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        return json_safe(x.item())
    return x
