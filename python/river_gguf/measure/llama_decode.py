"""Stock llama.cpp's decode through its C API, timed alone: the speed reference for benchmarks
and the Pareto report.

llama-cpp-python's `Llama.eval` fills a batch in a Python loop and copies logits into its own
score buffer after every call. That Python work is not llama.cpp's decode, so it is kept out of
the clock here: only `llama_decode` itself is timed, as river_gguf's side times only its engine's
eval. Flash attention is on, as the engine runs. With layers offloaded (n_gpu_layers) the clock
includes llama_synchronize: a GPU's llama_decode returns before its work is done.
"""
from __future__ import annotations

import time
from typing import List, Sequence, Tuple

import llama_cpp
import numpy as np


class LlamaDecoder:
    """One llama.cpp context on `path`; `decode` returns the seconds `llama_decode` took."""

    def __init__(self, path: str, n_ctx: int, n_threads: int, n_batch: int = 512, n_gpu_layers: int = 0):
        self._lc = llama_cpp
        # The high-level object owns model and context lifetimes (and frees them on close).
        self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                                   n_threads_batch=n_threads, flash_attn=True, n_gpu_layers=n_gpu_layers,
                                   verbose=False)
        self._ctx = self.llm._ctx.ctx
        self.n_vocab = self.llm.n_vocab()
        self.n_batch = n_batch
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.n_past = 0

    def tokenize(self, text: str) -> List[int]:
        return self.llm.tokenize(text.encode())

    def is_eog(self, tok: int) -> bool:
        return bool(self._lc.llama_vocab_is_eog(self.llm._model.vocab, tok))

    def reset(self) -> None:
        self._lc.llama_memory_clear(self._lc.llama_get_memory(self._ctx), True)
        self.n_past = 0

    def decode(self, tokens: Sequence[int]) -> float:
        """Decode `tokens` after the cache; logits of the last one. Returns llama_decode's seconds."""
        secs = 0.0
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            b = self._batch
            b.n_tokens = len(chunk)
            for i, t in enumerate(chunk):
                b.token[i] = int(t)
                b.pos[i] = self.n_past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = i == len(chunk) - 1
            t0 = time.perf_counter()
            rc = self._lc.llama_decode(self._ctx, b)
            # On a GPU llama_decode returns once the work is queued; the clock stops when it is
            # done (on the CPU, where decode is synchronous, this returns at once).
            self._lc.llama_synchronize(self._ctx)
            secs += time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
            self.n_past += len(chunk)
        return secs

    def last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self._lc.llama_get_logits_ith(self._ctx, -1), shape=(self.n_vocab,))

    def greedy(self, prompt: Sequence[int], n_new: int, stop_at_eog: bool = True) -> Tuple[List[int], int, float]:
        """Greedy tokens after `prompt`: (tokens, decode steps, seconds of those steps)."""
        self.reset()
        self.decode(prompt)
        out: List[int] = []
        secs, steps = 0.0, 0
        tok = int(np.argmax(self.last_logits()))
        while True:
            if stop_at_eog and self.is_eog(tok):
                break
            out.append(tok)
            if len(out) >= n_new:
                break
            secs += self.decode([tok])
            steps += 1
            tok = int(np.argmax(self.last_logits()))
        return out, steps, secs

    def close(self) -> None:
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        self.llm.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
