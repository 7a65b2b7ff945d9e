"""Teacher-forced scoring: a policy on a Session whose text chooses each token, so a text is scored
through the same decode steps and lossless rounds that generate one."""
from typing import Sequence

import numpy as np

from .._loader import native
from ..options import is_bool, is_int
from ..results import ScoreResult, log_softmax_at


def score(model, tokens: Sequence[int], prefix: int = 1, keep_logits: bool = False, **options) -> ScoreResult:
    """Teacher-forced scoring through the decode path, a policy on a Session: prefill
    tokens[:prefix], then decode the rest with exits, the text choosing each token, and report
    log p of each actual next token. In lossless mode the river drafts and the backbone verifies,
    and a draft is kept while it equals the text, as lossless generation keeps it when the text is
    what it samples. keep_logits: also return the logits that predicted each scored token
    (float32 [n_scored, n_vocab]), for divergence from a reference model. options: Model.options'
    keywords."""
    if not is_bool(keep_logits):
        raise ValueError(f"keep_logits must be a bool, got {keep_logits!r}")
    toks = model.check_tokens(tokens)
    if not is_int(prefix) or not 1 <= prefix < len(toks):
        raise ValueError(f"prefix must be an int in [1, {len(toks) - 1}], got {prefix!r}")
    if len(toks) > model.n_ctx:
        raise native.ContextOverflowError(f"{len(toks)} tokens do not fit in n_ctx={model.n_ctx}")
    logprobs, exits, kept = [], [], []
    text = iter(toks[prefix:])
    with model.lock, model.session(model.options(**options)) as s:
        s.prefill(toks[:prefix])
        for step in s.decode(lambda row, seen: next(text), limit=len(toks) - prefix):
            logprobs.append(log_softmax_at(step.row, step.token))
            exits.append(step.exit_layer)
            if keep_logits:
                kept.append(np.array(step.row, dtype=np.float32))
    return ScoreResult(np.array(logprobs), np.array(exits, dtype=np.int32),
                       np.stack(kept) if keep_logits else None)
