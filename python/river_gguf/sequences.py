"""Several sequences decoded together over one Model's KV cache: each step evaluates the next
token of every unfinished sequence in one batch (native Engine.eval with seq_ids), so the weights
are read once for the batch. River's exit is decided for the batch: it leaves the backbone after a
layer only when every token's score passes tau (RIVER.md), and the river writes the K/V each
sequence's skipped layers owe.

`greedy_sequences` is the argmax policy over such batches. It holds the Model's lock for the
whole call, starts from an empty cache (a session holding it is displaced) and leaves it empty."""
from dataclasses import dataclass, field
from typing import List, Sequence

import numpy as np

from .session import evaluate
from .options import is_int


@dataclass
class SequenceText:
    """One sequence's greedy continuation: its tokens, why it stopped ("stop": an
    end-of-generation token, not included; "length": max_tokens or the context), and the exit
    layer of each batch that decoded one of its tokens (the batch's, shared by its sequences)."""
    tokens: List[int] = field(default_factory=list)
    finish_reason: str = "length"
    exit_layers: List[int] = field(default_factory=list)


def greedy_sequences(model, prompts: Sequence[Sequence[int]], max_tokens: int, stop_at_eog: bool = True,
                     **options) -> List[SequenceText]:
    """The greedy continuation of each prompt (token lists), decoded together: one prompt batch
    holding every prompt, then one batch per step holding each unfinished sequence's last token,
    under the exit options of model.options(**options) (lossless mode is not batched). Each
    sequence sees only its own tokens, so its text is what it would be alone, up to the rounding
    of a larger batch's kernels (a near-tie may part). All prompts and replies must fit n_ctx
    together."""
    if not is_int(max_tokens) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
    prompts = [list(p) for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("give at least one prompt, and no empty one")
    opts = model.options(**options)
    if opts.lossless:
        raise ValueError("lossless mode decodes one sequence at a time: use greedy() per prompt")
    opts.validate(model.n_layer, model.has_river)
    out = [SequenceText() for _ in prompts]
    if max_tokens == 0:
        return out
    with model.sequences() as cache:
        seqs = [s for s, p in enumerate(prompts) for _ in p]
        toks = [t for p in prompts for t in p]
        rows, exit_layer = cache.eval(toks, seqs, opts, prompt=True)
        active = list(range(len(prompts)))
        while active:
            step = []
            for s, row in zip(active, rows):
                tok = int(np.argmax(row))
                if stop_at_eog and model.is_eog(tok):
                    out[s].finish_reason = "stop"
                    continue
                out[s].tokens.append(tok)
                out[s].exit_layers.append(exit_layer)
                # The next step needs a cache row for each of its tokens.
                if len(out[s].tokens) < max_tokens and cache.used + len(step) < model.n_ctx:
                    step.append(s)
            active = step
            if active:
                rows, exit_layer = cache.eval([out[s].tokens[-1] for s in active], active, opts, prompt=False)
    return out


class SequenceCache:
    """A Model's KV cache lent to several sequences at once (Model.sequences() makes one, under
    the Model's lock, from an empty cache to an empty cache): one batch may hold tokens of any of
    them, and each sequence sees only its own cells."""

    def __init__(self, engine):
        self._engine = engine

    @property
    def used(self) -> int:
        """Cache rows that hold a token of some sequence."""
        return self._engine.cache_used

    @property
    def sequences(self) -> List[int]:
        """The ids of the sequences the cache holds tokens of."""
        return list(self._engine.sequences)

    def eval(self, tokens: Sequence[int], seq_ids: Sequence[int], options, prompt: bool):
        """One batch: tokens[i] appended to sequence seq_ids[i]; returns (each sequence's last
        row, in the order the sequences first appear in the batch; the batch's exit layer)."""
        rows, exit_layer, _ = evaluate(self._engine, list(tokens), options, prompt, seq_ids=list(seq_ids))
        return rows, exit_layer

    def truncate(self, n: int, seq: int) -> None:
        """Keep sequence `seq`'s first n tokens (0: clear it)."""
        self._engine.truncate(n, seq=seq)
