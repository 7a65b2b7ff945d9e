"""The exit rule's scores along a text, for analysis, the tau profile and calibration: policies on a
Session whose text chooses each token, with the step's trace on (similarity_trace, and
backbone_trace in an engine of its own), and one batched backbone pass whose trace covers every
token at once (similarity_rows)."""
from dataclasses import replace
from typing import List, Optional, Sequence

import numpy as np

from .._loader import native
from ..options import ExitOptions
from ..session import STOP, Session


def _text_tokens(model, tokens: Sequence[int]) -> List[int]:
    toks = model.check_tokens(tokens)
    if not toks:
        raise ValueError("no tokens")
    if len(toks) > model.n_ctx:
        raise native.ContextOverflowError(f"{len(toks)} tokens do not fit in n_ctx={model.n_ctx}")
    return toks


def trace_text(session: Session, toks: List[int]) -> List[List[float]]:
    """The exit rule's scores of the decode step of each token after the first, the text choosing."""
    session.prefill(toks[:1])
    text = iter(toks[1:])
    steps = [step.scores for step in session.decode(lambda row, seen: next(text, STOP), trace=True)]
    return [list(sc) for sc in steps[1:] + [session.scores]] if len(toks) > 1 else []


def similarity_trace(model, tokens: Sequence[int], **options) -> List[List[float]]:
    """Per decode step of `tokens` after the first, the exit rule's score of every backbone layer
    run (cosine, the default: cos(h_in, h_out)). options: Model.options' keywords."""
    toks = _text_tokens(model, tokens)
    with model.lock, model.session(model.options(**options)) as s:
        return trace_text(s, toks)


def backbone_trace(model, tokens: Sequence[int], exit_rule: Optional[str] = None) -> List[List[float]]:
    """similarity_trace of backbone decode in a short-lived engine of its own
    (Model.backbone_session): the profile's length does not depend on the Model's n_ctx, and its
    KV cache (and any session on it) is left alone. exit_rule: that rule's scores (default: the
    default rule)."""
    toks = model.check_tokens(tokens)
    if not toks:
        raise ValueError("no tokens to profile")
    opts = ExitOptions(mode="backbone") if exit_rule is None else ExitOptions(mode="backbone", exit_rule=exit_rule)
    session = model.backbone_session(len(toks), opts)
    try:
        return trace_text(session, toks)
    finally:
        session.close()
        del session  # its engine's weights map and KV cache go now, not at the next GC


def similarity_rows(model, tokens: Sequence[int], exit_rule: Optional[str] = None) -> np.ndarray:
    """The exit rule's score of every backbone layer for every token, from one batched backbone
    pass over `tokens` (from an empty cache): float32 [len(tokens), n_layer]. Row i is what
    similarity_trace reports for the decode step of tokens[i], up to the batched kernels'
    rounding (the first token has no decode step there). exit_rule: that rule's scores (default:
    the model's rule)."""
    toks = model.check_batch(tokens)
    opts = model.options(mode="backbone")
    if exit_rule is not None:  # the scores of this rule (a plain model refuses it as an option)
        opts = replace(opts, exit_rule=exit_rule).validate(model.n_layer, model.has_river)
    # A fresh session starts from an empty cache; the next user of the cache clears it again.
    with model.lock, model.session(opts) as s:
        s.extend(toks, trace=True)  # every row's score at every layer; the head runs the last row alone
        sims = s.scores
    return np.asarray(sims, dtype=np.float32).reshape(model.n_layer, len(toks)).T
