"""The generation loop: prefill, then sample and decode one token at a time, streaming text."""
import time
from typing import List, Optional

from .results import Generation, exit_stats
from .text_stream import StopStringFilter, Utf8Decoder


class StreamInvalidatedError(RuntimeError):
    """A stream was advanced after another call on the same Model reused the KV cache it was
    generating in. Continuing would produce wrong tokens, so the stream refuses instead."""


class Stream:
    """Iterator of text pieces; after it ends, `.generation` holds the full result.

    Nothing runs until the first next(). Each step holds the Model's lock while it computes, and
    first checks that the cache is still this stream's (Model._check_owner). A step that raises
    ends the stream: every later next() raises the same error again."""

    def __init__(self, model, prompt_tokens: List[int], max_tokens: Optional[int], sampler, opts, stop):
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.generation: Optional[Generation] = None
        self._stop_filter = StopStringFilter(stop)  # validates stop strings now, not at first next()
        self._error: Optional[BaseException] = None
        self._it = self._run(max_tokens, sampler, opts)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if self._error is not None:
            raise self._error
        with self.model._lock:
            try:
                return next(self._it)
            except StopIteration:
                raise
            except Exception as e:
                self._error = e  # the generator is finished now; a later next() must not look like the end
                raise
            except BaseException as e:  # KeyboardInterrupt mid-step: the cache state is unknown
                self._error = StreamInvalidatedError(f"the stream was interrupted ({type(e).__name__})")
                raise

    def _run(self, max_tokens, sampler, opts):
        m = self.model
        room = m.n_ctx - len(self.prompt_tokens)
        limit = room if max_tokens is None else min(max_tokens, room)
        decoder, stops = Utf8Decoder(), self._stop_filter
        history = list(self.prompt_tokens)
        out_tokens: List[int] = []
        exit_layers: List[int] = []
        text_parts: List[str] = []
        finish = "length"

        epoch = m._begin()  # from here on the cache is this stream's until another call takes it
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
            # The caller may have run other calls on this Model while we were suspended at yield.
            m._check_owner(epoch, len(self.prompt_tokens) + decode_steps)
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
