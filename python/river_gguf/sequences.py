"""Several sequences decoded together over one Model's KV cache: a Session per sequence, each
running the ordinary decode loop in a thread of its own, whose decode steps the Model's step
batcher (river_gguf.batching) evaluates in one batch (native Engine.eval with seq_ids), so the
weights are read once for the batch. River's exit is decided for the batch: it leaves the backbone
after a layer only when every token's score passes tau (RIVER.md), and the river writes the K/V
each sequence's skipped layers owe.

`greedy_sequences` is the argmax policy on such sessions. It starts from an empty cache (any
session holding it is displaced) and leaves it empty."""
import threading
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from ._loader import native
from .options import is_int
from .session import STOP


@dataclass
class SequenceText:
    """One sequence's greedy continuation: its tokens, why it stopped ("stop": an
    end-of-generation token, not included; "length": max_tokens or the context), and the exit
    layer of each evaluation that gave one of its tokens (a batch's is shared by its sequences)."""
    tokens: List[int] = field(default_factory=list)
    finish_reason: str = "length"
    exit_layers: List[int] = field(default_factory=list)


def greedy_sequences(model, prompts: Sequence[Sequence[int]], max_tokens: int, stop_at_eog: bool = True,
                     **options) -> List[SequenceText]:
    """The greedy continuation of each prompt (token lists), decoded together: prompt i goes to a
    Session on sequence i, each prompt is evaluated as a prompt batch, then one thread per
    session runs its decode loop with the argmax choosing, and the decode steps of the sessions
    share their batches. Exit options: model.options(**options) (lossless mode is refused here:
    its rounds run alone under the Model's lock, one sequence at a time, and share no batch). Each sequence sees only its own tokens, so its text is what
    it would be alone, up to the rounding of a larger batch's kernels (a near-tie may part). All
    prompts must fit n_ctx together; a sequence that finds no room for its next step ends with
    "length"."""
    if not is_int(max_tokens) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
    prompts = [list(p) for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("give at least one prompt, and no empty one")
    opts = model.options(**options)
    if opts.lossless:
        raise ValueError("lossless mode decodes one sequence at a time: use greedy() per prompt")
    out = [SequenceText() for _ in prompts]
    if max_tokens == 0:
        return out
    model.give_cache(None)
    sessions = [model.session(opts, seq=s) for s in range(len(prompts))]
    try:
        for session, prompt in zip(sessions, prompts):
            session.prefill(prompt)
        errors: List[Optional[BaseException]] = [None] * len(prompts)
        threads = [threading.Thread(target=_decode_greedy, args=(model, session, max_tokens, stop_at_eog, text,
                                                                   errors, i), daemon=True)
                   for i, (session, text) in enumerate(zip(sessions, out))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in errors:
            if e is not None:
                raise e
    finally:
        for session in sessions:
            session.close()
        model.give_cache(None)
    return out


def _decode_greedy(model, session, max_tokens: int, stop_at_eog: bool, text: SequenceText,
                   errors: List[Optional[BaseException]], i: int) -> None:
    """One sequence's argmax loop (a thread of greedy_sequences): its tokens go into `text`, its
    error into errors[i]."""
    def argmax(row, seen):
        tok = int(np.argmax(row))
        if stop_at_eog and model.is_eog(tok):
            text.finish_reason = "stop"
            return STOP
        return tok

    try:
        for step in session.decode(argmax, limit=max_tokens):
            text.tokens.append(step.token)
            text.exit_layers.append(step.exit_layer)
    except native.ContextOverflowError:
        text.finish_reason = "length"  # no room for the next step: the text so far stands
    except BaseException as e:  # raised in the caller's thread
        errors[i] = e
