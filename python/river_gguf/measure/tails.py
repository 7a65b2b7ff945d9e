"""River tails: the logits of river-only runs with a backbone tail of each length, from one batched
pass over a text (the preset grid prices every tail with it)."""
from typing import Optional, Sequence, Tuple

import numpy as np

from ..options import is_bool, is_int


def river_tails(model, tokens: Sequence[int], tails: Sequence[int], river_attention: str = "river",
                river_head: bool = True, first_row: int = 0, start: Optional[Tuple[int, np.ndarray]] = None,
                keep: bool = False):
    """Model.logits(tokens, mode="river-only", tail=t, ...)[first_row:] for each tail t, from one
    batched pass (from an empty cache) of the river layers the tails share: each tail runs only
    its own backbone layers and the head, on rows first_row.. (Model.river_tails_pass). float32
    [len(tokens) - first_row, n_vocab] per tail, in the order given.

    keep=True returns (those rows, {layer: the river's hidden state entering river layer `layer`,
    float32 [len(tokens), n_embd]}) for each tail t > 0's branch (layer n_layer - t); a later
    pass over the same tokens, attention and head given one as start=(layer, state) runs only
    the river layers from `layer` on, with the same rows bit for bit (a calibration's later
    rounds). start's layer: at most n_layer - max(tails)."""
    toks = model.check_batch(tokens)
    if river_attention not in ("river", "backbone"):
        raise ValueError(f"river_attention must be 'river' or 'backbone', got {river_attention!r}")
    tails = list(tails)
    for t in tails:
        if not is_int(t) or not 0 <= t <= model.n_layer - 1:
            raise ValueError(f"tail must be an int in [0, {model.n_layer - 1}], got {t!r}")
    if not is_int(first_row) or not 0 <= first_row <= len(toks) - 1:
        raise ValueError(f"first_row must be an int in [0, {len(toks) - 1}], got {first_row!r}")
    if not is_bool(river_head):
        raise ValueError(f"river_head must be a bool, got {river_head!r}")
    if start is not None:
        layer, hidden = start
        if not is_int(layer) or not 1 <= layer <= model.n_layer - max(tails):
            raise ValueError(f"start's layer must be an int in [1, {model.n_layer - max(tails)}], got {layer!r}")
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        if hidden.shape != (len(toks), model.n_embd):
            raise ValueError(f"start's hidden state must be [{len(toks)}, {model.n_embd}], got {hidden.shape}")
        start = (int(layer), hidden)
    return model.river_tails_pass(toks, [int(t) for t in tails], river_attention == "backbone", bool(river_head),
                                  int(first_row), start=start, keep=bool(keep))
