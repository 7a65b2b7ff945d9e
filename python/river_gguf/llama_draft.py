"""Lossless drafts drawn by the call's sampler: a round's picker is a clone of the libllama chain in
its current state, so sampled drafts follow the sampler's randomness and penalties as far as the
backbone's tokens do (Session.decode's `pick`)."""
import contextlib
import functools
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


@contextlib.contextmanager
def draft_picker(chain: SamplerChain):
    """A round's draft picker: a clone of the chain in its current state samples the drafts, so
    they follow the sampler's randomness and penalties as far as the backbone's tokens do."""
    twin = chain.clone()
    try:
        yield functools.partial(pick_draft, twin)
    finally:
        twin.close()
