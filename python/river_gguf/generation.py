"""The generation loop: prefill, then sample and decode one token at a time, streaming text."""
import time
from typing import List, Optional

from .results import Generation, exit_stats
from .text_stream import StopStringFilter, Utf8Decoder


class Stream:
    """Iterator of text pieces; after it ends, `.generation` holds the full result."""

    def __init__(self, model, prompt_tokens: List[int], max_tokens: Optional[int], sampler, opts, stop):
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.generation: Optional[Generation] = None
        self._stop_filter = StopStringFilter(stop)  # validates stop strings now, not at first next()
        self._it = self._run(max_tokens, sampler, opts)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._it)

    def _run(self, max_tokens, sampler, opts):
        m, engine = self.model, self.model._engine
        room = m.n_ctx - len(self.prompt_tokens)
        limit = room if max_tokens is None else min(max_tokens, room)
        decoder, stops = Utf8Decoder(), self._stop_filter
        history = list(self.prompt_tokens)
        out_tokens: List[int] = []
        exit_layers: List[int] = []
        text_parts: List[str] = []
        finish = "length"

        engine.truncate(0)
        t0 = time.perf_counter()
        logits, exit_layer, _ = m._eval(self.prompt_tokens, opts, prompt=True)
        t1 = time.perf_counter()
        decode_time, decode_steps = 0.0, 0
        while len(out_tokens) < limit:
            tok = sampler.sample(logits[-1], history)
            if m.is_eog(tok):
                finish = "stop"
                break
            out_tokens.append(tok)
            exit_layers.append(exit_layer)
            history.append(tok)
            piece, stopped = stops.push(decoder.push(m.token_to_piece(tok)))
            if piece:
                text_parts.append(piece)
                yield piece
            if stopped:
                finish = "stop"
                break
            if len(out_tokens) >= limit:
                break
            ts = time.perf_counter()
            logits, exit_layer, _ = m._eval([tok], opts, prompt=False)
            decode_time += time.perf_counter() - ts
            decode_steps += 1
        if not stops.stopped:
            tail, _ = stops.push(decoder.flush())
            tail += stops.flush()
            if stops.stopped:
                finish = "stop"
            if tail:
                text_parts.append(tail)
                yield tail

        stats = {
            "prefill_tokens": len(self.prompt_tokens),
            "prefill_tok_s": len(self.prompt_tokens) / max(t1 - t0, 1e-9),
            "decode_tokens": decode_steps,
            "decode_tok_s": decode_steps / decode_time if decode_time > 0 else 0.0,
            "mode": opts.mode if opts.exit_layer is None else f"exit_layer={opts.exit_layer}",
            "threshold": opts.threshold,
            "tail": opts.tail,
        }
        stats.update(exit_stats(exit_layers, m.n_layer, opts.tail))
        self.generation = Generation("".join(text_parts), out_tokens, finish, stats)
