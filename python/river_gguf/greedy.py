"""Greedy decoding, for measurement: evaluation, task accuracy and tuning. A policy on a Session:
the argmax chooses each token (river_gguf.session runs the loop and times each evaluation).

Text generation for users (sampling, stop strings, streaming, OpenAI dicts) is river_gguf.Llama's.
"""
from dataclasses import dataclass, field
from typing import List, Sequence, Union

import numpy as np

from .options import is_int, never_exit
from .results import exit_stats
from .session import STOP


@dataclass
class GreedyResult:
    text: str
    tokens: List[int]
    finish_reason: str          # "stop" (end of generation or a stop string) or "length"
    exit_layers: List[int] = field(default_factory=list)  # of the pass that predicted each token
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    n_layer: int = 0
    tail: int = 0
    mode: str = "backbone"      # as Llama.last_stats: the mode, or "exit_layer=k" for a forced exit
    threshold: float = field(default_factory=never_exit)

    @property
    def decode_exit_layers(self) -> List[int]:
        """Exit layers of the decode steps (the first token comes from the prefill)."""
        return self.exit_layers[1:]

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def stats(self) -> dict:
        """The exit statistics (results.exit_stats) and the decode counts."""
        return {"decode_tokens": self.decode_steps, "decode_tok_s": self.decode_tok_s, "mode": self.mode,
                "threshold": self.threshold, "tail": self.tail,
                **exit_stats(self.exit_layers, self.n_layer, self.tail)}


def greedy(model, prompt: Union[str, Sequence[int]], max_tokens: int, stop: Sequence[str] = (),
           stop_at_eog: bool = True, **options) -> GreedyResult:
    """Prefill `prompt` (text is tokenized with special tokens parsed, as a chat prompt needs),
    then decode the argmax token by token with exits live, until an end-of-generation token
    (unless stop_at_eog=False: benchmarks time a fixed count of steps), a stop string (the text is
    cut before it), max_tokens or the end of the context (the prompt and the reply fill at most
    n_ctx positions, as in llama_cpp). The session's counters time each evaluation alone."""
    if not is_int(max_tokens) or max_tokens < 0:
        raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
    if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a list of str, got {stop!r}")
    toks = (model.tokenize(prompt, add_special=True, parse_special=True) if isinstance(prompt, (str, bytes))
            else list(prompt))
    if not toks:
        raise ValueError("the prompt is empty")
    opts = model.options(**options)
    stops = [s for s in stop if s]
    max_tokens = min(int(max_tokens), model.n_ctx - len(toks))
    res = GreedyResult("", [], "length", n_layer=model.n_layer, tail=opts.tail, threshold=opts.threshold,
                       mode=opts.label)
    out, text, cut_at_stop = res.tokens, "", False

    def argmax(row, seen):
        tok = int(np.argmax(row))
        return STOP if stop_at_eog and model.is_eog(tok) else tok

    with model.session(opts) as session:
        session.prefill(toks)
        for step in session.decode(argmax, limit=max_tokens):
            out.append(step.token)
            res.exit_layers.append(step.exit_layer)
            if stops:  # the text so far, only when a stop string may end it
                text = model.detokenize(out)
                cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    text, res.finish_reason, cut_at_stop = text[:cut], "stop", True
                    break
        else:
            if len(out) < max_tokens:
                res.finish_reason = "stop"  # an end-of-generation token
        c = session.counters
        res.prefill_seconds, res.decode_steps, res.decode_seconds = c.prefill_s, c.decode_steps, c.decode_s
    res.text = text if cut_at_stop else model.detokenize(out)
    return res
