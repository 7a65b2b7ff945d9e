"""What generation and scoring return, and the exit statistics both report."""
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np


def exit_stats(exit_layers: List[int], n_layer: int) -> dict:
    """Summary of per-token exit layers; layer n_layer-1 means the token never exited."""
    n = len(exit_layers)
    hist: Dict[int, int] = {}
    for e in exit_layers:
        hist[int(e)] = hist.get(int(e), 0) + 1
    river_layers = sum(n_layer - 1 - e for e in exit_layers)
    return {
        "exit_layers": [int(e) for e in exit_layers],
        "exit_histogram": dict(sorted(hist.items())),
        "mean_exit_layer": float(np.mean(exit_layers)) if n else float("nan"),
        "river_layer_share": river_layers / (n * n_layer) if n else 0.0,
    }


@dataclass
class Generation:
    text: str
    tokens: List[int]
    finish_reason: str  # "stop" or "length"
    stats: dict = field(default_factory=dict)


@dataclass
class ScoreResult:
    logprobs: np.ndarray        # log p(actual next token), one per scored token
    exit_layers: np.ndarray     # exit layer of the pass that predicted each token

    @property
    def perplexity(self) -> float:
        return float(np.exp(-np.mean(self.logprobs))) if len(self.logprobs) else float("nan")
