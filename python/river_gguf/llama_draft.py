"""Lossless drafts drawn by the call's sampler: a round's picker is a clone of the libllama chain in
its current state, so sampled drafts follow the sampler's randomness and penalties as far as the
backbone's tokens do (Session.decode's `pick`)."""
import contextlib
from typing import Optional

import numpy as np

from .llama_sampling import SamplerChain, SamplingError


def pick_draft(chain: SamplerChain, logits: np.ndarray, tokens: Optional[np.ndarray]) -> int:
    """A lossless draft drawn by a copy of the call's sampler chain (Session.draft's `pick`). In
    the same random state and history as the chain that will sample the backbone's row, it draws
    the same token wherever the river's distribution is the backbone's: a coupling that keeps
    sampled drafts accepted about as often as greedy ones against greedy text. The backbone's row
    is still what the real chain samples, so the text does not change. -1 (stop drafting) where
    the copy can draw nothing."""
    try:
        return chain.sample(logits) if tokens is None else chain.sample_from(tokens, logits)
    except SamplingError:
        return -1


class DraftPicker:
    """A round's sampled drafts (Session.draft's `pick`), drawn by `pick_draft` with one chain.
    p_min: drafting stops before a draft whose probability in the distribution it was drawn from
    is below it (the planner's early stop; 0 never stops); probs: each kept draft's probability,
    in order (from which the planner learns where stopping pays)."""

    def __init__(self, chain: SamplerChain):
        self._chain = chain
        self.p_min = 0.0
        self.probs = []

    def __call__(self, logits: np.ndarray, tokens: Optional[np.ndarray]) -> int:
        token = pick_draft(self._chain, logits, tokens)
        p = self._chain.drawn_probability
        if token < 0 or p is None:
            return token
        if not p >= self.p_min:  # a NaN row (a broken river) stops the draft, as the native greedy rule does
            return -1
        self.probs.append(p)
        return token


@contextlib.contextmanager
def draft_picker(chain: SamplerChain):
    """A round's draft picker: a clone of the chain in its current state samples the drafts, so
    they follow the sampler's randomness and penalties as far as the backbone's tokens do."""
    twin = chain.clone()
    try:
        yield DraftPicker(twin)
    finally:
        twin.close()
